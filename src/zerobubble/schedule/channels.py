"""Which messages cross which rank-to-rank channel, in which order: a pure function of the schedule.

The runtime gives every ordered pair of ranks that exchange tensors its own FIFO channel
(:mod:`zerobubble.runtime.execute.comm`).  A receiver posts its receives in the order the sender sends,
so both sides must derive that order from the schedule alone; this module is that derivation,
testable without spawning ranks.
"""

from __future__ import annotations

from typing import NamedTuple

from .ir import Kind, Op, Schedule

ACTIVATIONS = 0
"""``MessageKey.direction`` of a forward message (stage ``boundary`` to ``boundary + 1``)."""
GRADIENTS = 1
"""``MessageKey.direction`` of a backward message (stage ``boundary + 1`` to ``boundary``)."""


class MessageKey(NamedTuple):
    """One message: the tensors crossing the boundary after stage ``boundary`` for one microbatch.

    ``direction`` 0 (:data:`ACTIVATIONS`) carries the activations of stage ``boundary`` to
    ``boundary + 1``; 1 (:data:`GRADIENTS`) carries the input gradient of stage ``boundary + 1``
    back to ``boundary``.
    """

    direction: int
    boundary: int
    microbatch: int

    def describe(self) -> str:
        """The message in words, e.g. ``"act 2->3 mb 5"``."""
        if self.direction == ACTIVATIONS:
            return f"act {self.boundary}->{self.boundary + 1} mb {self.microbatch}"
        return f"grad {self.boundary + 1}->{self.boundary} mb {self.microbatch}"


def sent_message(op: Op, num_stages: int) -> MessageKey | None:
    """The message ``op`` sends when it ends (None for W, for F of the last stage, for B of the first)."""
    if op.kind is Kind.F:
        return MessageKey(ACTIVATIONS, op.stage, op.microbatch) if op.stage < num_stages - 1 else None
    if op.computes_input_grad and op.stage > 0:
        return MessageKey(GRADIENTS, op.stage - 1, op.microbatch)
    return None


def received_message(op: Op, num_stages: int) -> MessageKey | None:
    """The message ``op`` waits for when it starts (None for W, F of the first stage, B of the last)."""
    if op.kind is Kind.F:
        return MessageKey(ACTIVATIONS, op.stage - 1, op.microbatch) if op.stage > 0 else None
    if op.computes_input_grad and op.stage < num_stages - 1:
        return MessageKey(GRADIENTS, op.stage, op.microbatch)
    return None


def receiving_stage(key: MessageKey) -> int:
    """The stage that consumes message ``key``."""
    return key.boundary + 1 if key.direction == ACTIVATIONS else key.boundary


def sending_stage(key: MessageKey) -> int:
    """The stage that sends message ``key``."""
    return key.boundary if key.direction == ACTIVATIONS else key.boundary + 1


def channel_messages(schedule: Schedule, src: int, dst: int) -> list[MessageKey]:
    """The messages rank ``src`` sends to rank ``dst`` in one step, in the order it sends them.

    Messages between two stages of the same rank are handed over locally and never listed.
    """
    placement, stages = schedule.placement, schedule.num_stages
    messages = []
    for op in schedule.programs[src]:
        key = sent_message(op, stages)
        if key is not None and placement.rank_of(receiving_stage(key)) == dst:
            messages.append(key)
    return messages


def delivered_before(schedule: Schedule, src: int, dst: int) -> dict[MessageKey, list[MessageKey]]:
    """For each message of rank ``dst`` to rank ``src``: the messages of ``src`` to ``dst`` that
    ``dst`` has received (waited for) before sending it, each listed at the first such message.

    Rank ``src`` holds each tensor it sends until the send is known to be over (gloo's send work
    reports completion only to a ``wait()``, which may block until the receiver posts its receive).
    Once ``src`` has received a message of ``dst``, every message listed for it has arrived, so
    waiting for those sends returns at once and their tensors can go.
    """
    stages, placement = schedule.num_stages, schedule.placement
    delivered: dict[MessageKey, list[MessageKey]] = {}
    arrived: list[MessageKey] = []
    for op in schedule.programs[dst]:
        key = received_message(op, stages)
        if key is not None and placement.rank_of(sending_stage(key)) == src:
            arrived.append(key)
        key = sent_message(op, stages)
        if key is not None and placement.rank_of(receiving_stage(key)) == src:
            delivered[key], arrived = arrived, []
    return delivered


def directed_pairs(schedule: Schedule) -> list[tuple[int, int]]:
    """Every ``(src, dst)`` pair of ranks that exchange tensors, sorted (the channels' creation order)."""
    pairs = set()
    for s in range(schedule.num_stages - 1):
        a, b = schedule.placement.rank_of(s), schedule.placement.rank_of(s + 1)
        if a != b:
            pairs.update({(a, b), (b, a)})
    return sorted(pairs)


__all__ = [
    "ACTIVATIONS",
    "GRADIENTS",
    "MessageKey",
    "channel_messages",
    "delivered_before",
    "directed_pairs",
    "received_message",
    "receiving_stage",
    "sending_stage",
    "sent_message",
]
