"""Which messages cross which rank-to-rank channel, in which order: a pure function of the schedule.

The runtime gives every ordered pair of ranks that exchange tensors its own FIFO channel
(:mod:`zerobubble.runtime.comm`).  A receiver posts its receives in the order the sender sends,
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


def receiving_stage(key: MessageKey) -> int:
    """The stage that consumes message ``key``."""
    return key.boundary + 1 if key.direction == ACTIVATIONS else key.boundary


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
    "directed_pairs",
    "receiving_stage",
    "sent_message",
]
