"""The experts' all-to-all posted and awaited as two autograd nodes, so that what runs between them
overlaps the exchange, in the forward and again in the backward.

``token = Post.apply(rows, pending, send, receive, groups)`` starts ``all_to_all_single`` with
uneven splits (``async_op=True``) and returns an empty *token*; ``Arrive.apply(token, pending)``
waits and returns the received rows.  The token carries ``rows``' dependency, so autograd keeps the
two in order.  Backward: :class:`Arrive`'s posts the reverse exchange of the gradient, :class:`Post`'s
waits for it.  Autograd's engine runs the ready node created last first, so nodes created between the
two in the forward — :class:`~.experts.ExpertParallelExperts` computes its own tokens there — run
between them in the backward too, while the gradient travels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Arrive", "Pending", "Post"]


class Pending:
    """One exchange in flight: its output and handle in the forward, its gradient's in the backward,
    and what the reverse exchange needs (the sizes, the backward's group)."""

    __slots__ = ("group", "out", "receive", "send", "sent", "work")

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None
        self.sent: torch.Tensor | None = None  # the rows being sent, alive until the exchange ends
        self.work: Any = None
        self.send: Sequence[int] = ()
        self.receive: Sequence[int] = ()
        self.group: Any = None

    def take(self) -> torch.Tensor:
        """Wait for the exchange in flight; its output (the handle and the output let go)."""
        if self.work is not None:
            self.work.wait()
        out, self.out, self.sent, self.work = self.out, None, None, None
        assert out is not None, "an exchange awaited twice"
        return out


class Post(torch.autograd.Function):
    """Start the exchange of ``rows`` (``send[r]`` rows to rank ``r``, ``receive[r]`` from it) over
    ``groups[0]``; the backward's reverse exchange goes over ``groups[1]`` (module docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        rows: torch.Tensor,
        pending: Pending,
        send: Sequence[int],
        receive: Sequence[int],
        groups: tuple[Any, Any],
    ) -> torch.Tensor:
        pending.out, pending.sent, pending.work = _exchange(rows, send, receive, groups[0])
        pending.send, pending.receive, pending.group = send, receive, groups[1]
        ctx.pending = pending
        return rows.new_empty(0)

    @staticmethod
    def backward(ctx: Any, token: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        return ctx.pending.take(), None, None, None, None


class Arrive(torch.autograd.Function):
    """Wait for the exchange :class:`Post` started; the received rows, by source rank."""

    @staticmethod
    def forward(ctx: Any, token: torch.Tensor, pending: Pending) -> torch.Tensor:
        ctx.pending = pending
        return pending.take()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        pending = ctx.pending  # the reverse exchange: what arrived from rank r goes back to it
        posted = _exchange(grad, pending.receive, pending.send, pending.group)
        pending.out, pending.sent, pending.work = posted
        return grad.new_empty(0), None


def _exchange(
    rows: torch.Tensor, send: Sequence[int], receive: Sequence[int], group: Any
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """``rows`` cut by ``send`` to the group's ranks, posted: the buffer their rows arrive in (by
    ``receive``), the rows sent and the handle to wait on."""
    out, sent = rows.new_empty((sum(receive), *rows.shape[1:])), rows.contiguous()
    work = dist.all_to_all_single(out, sent, list(receive), list(send), group=group, async_op=True)
    return out, sent, work
