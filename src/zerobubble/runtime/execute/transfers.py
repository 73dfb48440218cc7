"""The pipeline's sends and receives as entries of the executor's program.

The lowering places each message's actions (``schedule/lowering``, ``docs/communication.md`` §7):
``issue send`` right after the op that produces it, ``issue recv`` ahead of its consumer (in the
sender's order on its channel), ``wait recv`` just before the consumer and ``wait send`` at the
program's end.  :class:`Transfers` binds them, through the :class:`~.program.Communication`
protocol, to the rank's channels (:class:`~.comm.Comm`) and to the executor's mailbox: an op leaves
each message it produces in the mailbox, a send's issue takes it out and posts it; a receive's wait
puts the tensors in, and the consuming op takes them out.  A hand-over between two stages of one
rank has no action at all: the consumer takes what the producer left.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch

from ...schedule.channels import ACTIVATIONS, MessageKey, receiving_stage
from ...schedule.ir import Op, Placement
from ...schedule.lowering import CommKind, Issue, Wait
from .. import PipelineError

Mailbox = dict[MessageKey, tuple[torch.Tensor, ...]]
"""The messages produced and not yet consumed or sent on this rank, by key (the executor's)."""


class Transfers:
    """Binds a lowered program's sends and receives to ``channels`` (a :class:`~.comm.Comm`) and
    ``mailbox``; ``placement`` says the rank of each message's receiving stage."""

    def __init__(self, channels: Any, mailbox: Mailbox, placement: Placement, rank: int):
        self._channels = channels  # looked up when an entry runs: a one-rank executor may have none
        self._mailbox = mailbox
        self._rank_of = placement.rank_of
        self._rank = rank

    def comm_handler(self, action: Issue | Wait) -> Callable[[], None] | None:
        """The work of a send's or receive's ``action``; None for any other communication."""
        kind, key = action.comm.kind, action.comm.message
        if kind is CommKind.SEND:
            if isinstance(action, Issue):
                return partial(self._send, key, self._rank_of(receiving_stage(key)))
            return partial(self._wait_send, key)
        if kind is CommKind.RECV:
            return partial(self._post if isinstance(action, Issue) else self._receive, key)
        return None

    def compute_handler(self, op: Op, handler: Callable[[Any, int], None]) -> Callable[[Any, int], None]:
        """``handler`` itself: an op's own transfers are entries of their own."""
        return handler

    def _send(self, key: MessageKey, dst: int) -> None:
        try:
            tensors = self._mailbox.pop(key)
        except KeyError:
            raise PipelineError(
                f"rank {self._rank}: the program sends message {key} before the op that produces it "
                "ran: the lowered program places a send ahead of its producer (a lowering bug)"
            ) from None
        self._channels.send(key, dst, tensors)

    def _wait_send(self, key: MessageKey) -> None:
        self._channels.wait_send(key)

    def _post(self, key: MessageKey) -> None:
        self._channels.post(key)

    def _receive(self, key: MessageKey) -> None:
        self._mailbox[key] = self._channels.recv(key)


def forward_transfer(action: Issue | Wait) -> bool:
    """True for the actions of a forward-only step's transfers: the activations' sends and receives."""
    comm = action.comm
    return comm.kind in (CommKind.SEND, CommKind.RECV) and comm.message.direction == ACTIVATIONS


def outgoing(index: int, name: str, outputs: tuple) -> tuple[torch.Tensor, ...]:
    """The outputs of stage ``index`` (named ``name``) cut from its graph, to cross the stage
    boundary: only tensors can (raises PipelineError saying what to return instead)."""
    for position, value in enumerate(outputs):
        if isinstance(value, Mapping):
            layer = name.rpartition("..")[2].removeprefix("layers ")
            raise PipelineError(
                f"stage {index} ({name}) returns a {type(value).__name__} with keys "
                f"{sorted(map(str, value))} as output {position} (from its last layer, {layer}); only "
                "tensors can pass between stages — make layer "
                f"{layer} return a tuple of tensors (e.g. tuple(out[k] for k in sorted(out))) that the next "
                "layer takes positionally, or keep the layers exchanging the dict in one stage (partition=)"
            )
        if not isinstance(value, torch.Tensor):
            raise PipelineError(
                f"stage {index} ({name}) returns a {type(value).__name__} as output {position}; "
                "only tensors can pass between stages — return tensors only (encode other values as tensors)"
            )
    return tuple(t.detach() for t in outputs)
