"""Optimizer post-validation: step before the global gradient state is known, fix it up later.

Gradient clipping and the Inf/NaN check need global facts (the norm over the whole model, "is a
gradient non-finite anywhere"), and a collective right before the optimizer step makes every rank
wait for the slowest.  Following the zero-bubble paper (§4), :class:`PostValidator` passes a
partial state ``[Σ|g|^p, non-finite flag]`` point to point along a chain of ranks; each rank steps
at once when its prefix of the chain allows it, and the full state travels back down the chain
during the next iteration's warm-up, when each rank confirms its step, or undoes it in place
(:mod:`.rollback`) and redoes it clipped or drops it.  The result equals ``clip_grad_norm_`` +
``step`` on the whole model.  :class:`PipelineOptimizer` is what :class:`~zerobubble.Pipeline`
uses: one validator per optimizer, the chain ordered by :func:`validation_chain`.

The protocol's message flow, why it is exact, and measured errors:
``docs/optimizer-post-validation.md``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import PipelineError
from .grad_state import check_max_norm, clip_coefficient, combine_states, local_state, reduce_op
from .rollback import OptimizerValidationError, ReversibleStep, rollback_support, zero_local_optimizer

__all__ = [
    "OptimizerStats",
    "PipelineOptimizer",
    "PostValidator",
    "StepOutcome",
    "Verdict",
    "chain_neighbours",
    "check_max_norm",
    "check_sharded_optimizer",
    "clip_coefficient",
    "combine_states",
    "local_state",
    "partial_decision",
    "reduce_op",
    "validation_chain",
    "verdict_of",
]

#: gloo tag of the validator's point-to-point messages, apart from the pipeline's own transfers.
_TAG = 24_010


class Verdict(enum.Enum):
    """What a state says about the step."""

    SKIP = "skip"  # a gradient somewhere is non-finite: no step
    CLIP = "clip"  # the step uses clipped gradients
    PLAIN = "plain"  # the step uses the gradients as they are


def verdict_of(
    state: torch.Tensor, norm_type: float, max_norm: float | None, dtype: torch.dtype
) -> tuple[Verdict, float, float]:
    """``(verdict, total norm, clip coefficient)`` of a state (coefficient nan when skipped)."""
    part, nonfinite = (float(x) for x in state.cpu())
    norm = part if math.isinf(norm_type) else part ** (1.0 / norm_type)
    if nonfinite > 0.0 or not math.isfinite(norm):
        return Verdict.SKIP, norm, float("nan")
    coef = clip_coefficient(norm, max_norm, dtype)
    return (Verdict.PLAIN if coef == 1.0 else Verdict.CLIP), norm, coef


def partial_decision(verdict: Verdict, reversible: bool) -> tuple[bool, bool]:
    """``(step now, defer)`` for a rank that knows the state of a prefix of the chain only.

    Every term of the sum is non-negative, so the prefix's norm is a lower bound of the total:
    SKIP and CLIP are already certain, PLAIN is only a guess.  A certain skip needs nothing; a
    certain clip waits for the full norm (its factor is unknown); a guess is taken now when it can
    be undone, and deferred otherwise.
    """
    step_now = verdict is Verdict.PLAIN and reversible
    return step_now, verdict is not Verdict.SKIP and not step_now


def validation_chain(finish_times: Sequence[float]) -> list[int]:
    """Pipeline ranks in chain order: the rank whose program ends first is the head.

    ``finish_times[r]`` is when rank ``r``'s program ends (the simulator's prediction).  Ordering
    the chain by it means a rank waits for its predecessor's partial state only briefly (that rank
    finished earlier), and the tail — the last to finish, the first to start the next warm-up in
    1F1B-like and V-shape schedules — holds the full state at once.  Ties put the higher rank first.
    """
    return sorted(range(len(finish_times)), key=lambda rank: (finish_times[rank], -rank))


def chain_neighbours(chain: Sequence[int], rank: int) -> tuple[int | None, int | None]:
    """``(prev_rank, next_rank)`` of ``rank`` in ``chain`` (None at the ends)."""
    position = list(chain).index(rank)
    prev_rank = chain[position - 1] if position > 0 else None
    next_rank = chain[position + 1] if position + 1 < len(chain) else None
    return prev_rank, next_rank


# --------------------------------------------------------------------------------------------
# Outcomes and counters


@dataclass(frozen=True)
class StepOutcome:
    """How one optimizer step ended, once the full state was known.

    ``total_norm`` is the gradient norm over all ranks (inf or nan when a gradient was not
    finite), ``clip_coef`` the factor applied to the gradients (1.0: no clipping, nan: skipped);
    ``rolled_back``: an optimistic step was undone; ``deferred``: the step was taken only now.
    """

    total_norm: float
    clip_coef: float
    skipped: bool
    rolled_back: bool
    deferred: bool


@dataclass(frozen=True)
class OptimizerStats:
    """Counters of the optimizer steps settled so far on this rank.

    ``steps`` counts settled steps (a step still waiting for validation is ``pending`` and not
    counted yet); ``clipped`` and ``skipped`` (non-finite gradients) are the same on every rank,
    ``rolled_back`` (optimistic steps undone and redone or dropped) and ``deferred`` (steps taken
    only once the full state arrived) depend on the rank's place in the chain.
    """

    steps: int = 0
    clipped: int = 0
    skipped: int = 0
    rolled_back: int = 0
    deferred: int = 0
    pending: bool = False

    def counted(self, outcome: StepOutcome) -> OptimizerStats:
        """These counters with one more settled step."""
        return OptimizerStats(
            steps=self.steps + 1,
            clipped=self.clipped + ((not outcome.skipped) and outcome.clip_coef < 1.0),
            skipped=self.skipped + outcome.skipped,
            rolled_back=self.rolled_back + outcome.rolled_back,
            deferred=self.deferred + outcome.deferred,
            pending=self.pending,
        )

    def plus(self, other: OptimizerStats) -> OptimizerStats:
        """Counters summed (``pending`` from ``other``)."""
        return OptimizerStats(
            self.steps + other.steps,
            self.clipped + other.clipped,
            self.skipped + other.skipped,
            self.rolled_back + other.rolled_back,
            self.deferred + other.deferred,
            other.pending,
        )


# --------------------------------------------------------------------------------------------
# The protocol on one rank


@dataclass
class _Pending:
    """A step whose full state is still travelling back down the chain."""

    stepped: bool  # an optimistic (unclipped) step was taken
    deferred: bool  # the step waits for the full state
    full: torch.Tensor  # receive buffer of the full state
    work: Any  # the irecv filling it


def _check_settings(max_norm, norm_type, prev_rank, next_rank) -> None:
    check_max_norm(max_norm)
    if not (float(norm_type) > 0.0):
        raise OptimizerValidationError(f"norm_type must be positive (or inf), got {norm_type!r}")
    if prev_rank is not None and prev_rank == next_rank:
        raise OptimizerValidationError(
            f"prev_rank and next_rank are both {prev_rank}; the chain must visit each rank once"
        )


class PostValidator:
    """The optimizer step of one rank, with gradient clipping and a non-finite check.

    Call :meth:`step` where ``optimizer.step()`` would be and :meth:`finish` before the parameters
    are read again (the next forward); the step may be provisional in between.  ``optimizer``
    holds this rank's parameters (the norm is over their gradients); ``prev_rank`` / ``next_rank``
    are its neighbours in the chain (global ranks, None at the ends), ``group`` the process group
    to send on (a dedicated one, so these tiny messages never interleave with other transfers).
    ``post_validation=False`` gives the synchronous step with the same API: one all-reduce of the
    state over ``group`` (exactly the chain's ranks), then the exact step.  ``shard_group``: the
    gradients are shards (FSDP2 DTensors) whose full tensors are spread over that group; the local
    state is summed over it before anything else (a collective over the group at every step).
    ``norm_excludes``
    are parameters whose gradients another rank counts (a copy of a tied parameter);
    ``wait(work, what)`` waits for one transfer (default ``work.wait()``).  The gradients of a
    pending step may be dropped but not modified in place before :meth:`finish`.
    Counters: :attr:`stats`.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float | None = None,
        *,
        prev_rank: int | None = None,
        next_rank: int | None = None,
        group: dist.ProcessGroup | None = None,
        post_validation: bool = True,
        norm_type: float = 2.0,
        device: torch.device | str | None = None,
        wait: Callable[[Any, str], None] | None = None,
        norm_excludes: Sequence[torch.Tensor] = (),
        shard_group: Any = None,
    ) -> None:
        _check_settings(max_norm, norm_type, prev_rank, next_rank)
        self.shard_group = shard_group
        self._excluded = frozenset(id(p) for p in norm_excludes)
        self._wait: Callable[[Any, str], None] = wait or (lambda work, what: work.wait())
        self.optimizer = optimizer
        self.max_norm = None if max_norm is None else float(max_norm)
        self.norm_type = float(norm_type)
        self.prev_rank, self.next_rank, self.group = prev_rank, next_rank, group
        self.post_validation = post_validation
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.device = (
            torch.device(device)
            if device is not None
            else (params[0].device if params else torch.device("cpu"))
        )
        self._norm_dtype = params[0].dtype if params and params[0].is_floating_point() else torch.float32
        self._step = ReversibleStep(optimizer)
        self._pending: _Pending | None = None
        self._sends: list[tuple[Any, torch.Tensor]] = []
        self._stats = OptimizerStats()
        self.last_outcome: StepOutcome | None = None
        self._warn_if_not_reversible()

    # -- public protocol ------------------------------------------------------------------------

    @property
    def pending(self) -> bool:
        """Whether a step still waits for its validation (call :meth:`finish`)."""
        return self._pending is not None

    @property
    def stats(self) -> OptimizerStats:
        """Counters of the steps settled so far."""
        return dataclasses.replace(self._stats, pending=self.pending)

    def step(self) -> None:
        """Take this rank's part of the optimizer step (finishing the previous one first).

        Blocks only to receive the partial state from ``prev_rank``.  In post-validation mode the
        result may be provisional until :meth:`finish`; in synchronous mode it is final.
        """
        self.finish()
        self._wait_sends()
        self._step.record()
        local = local_state(
            self._step.grads(self._excluded), self.norm_type, self.device, shards=self.shard_group is not None
        )
        if self.shard_group is not None:  # sharded gradients: the full tensors' state first
            work = dist.all_reduce(local, op=reduce_op(self.norm_type), group=self.shard_group, async_op=True)
            self._wait(work, "the gradient norm's sum over the shards")
        if not self.post_validation:
            work = dist.all_reduce(local, op=reduce_op(self.norm_type), group=self.group, async_op=True)
            self._wait(work, "the gradient norm's all-reduce")
            self._settle(local, stepped=False, deferred=False)
            return
        partial = self._combine_with_previous(local)
        if self.next_rank is None:  # the tail holds the full state: exact step, start the way back
            if self.prev_rank is not None:
                self._send(partial, self.prev_rank)
            self._settle(partial, stepped=False, deferred=False)
            return
        self._send(partial, self.next_rank)
        self._pending = self._act_on_partial(partial)

    def finish(self) -> StepOutcome | None:
        """Wait for the full state of the pending step, then confirm, roll back and redo, or skip.

        Returns the outcome of the latest step (None before the first).  Cheap when nothing is
        pending.
        """
        pending = self._pending
        if pending is None:
            return self.last_outcome
        self._pending = None
        self._wait(pending.work, f"the validated gradient norm from rank {self.next_rank}")
        if self.prev_rank is not None:  # pass the full state on down the chain first
            self._send(pending.full, self.prev_rank)
        return self._settle(pending.full, stepped=pending.stepped, deferred=pending.deferred)

    def close(self) -> StepOutcome | None:
        """Finish the pending step and wait for every message this rank sent."""
        outcome = self.finish()
        self._wait_sends()
        return outcome

    # -- internals ------------------------------------------------------------------------------

    def _warn_if_not_reversible(self) -> None:
        problem = rollback_support(self.optimizer)
        if problem is not None and self.post_validation and self.next_rank is not None:
            warnings.warn(
                f"optimizer post-validation: {problem}; this rank will step only once the full "
                "gradient state is known (synchronously)",
                stacklevel=3,
            )

    def _verdict(self, state: torch.Tensor) -> tuple[Verdict, float, float]:
        return verdict_of(state, self.norm_type, self.max_norm, self._norm_dtype)

    def _combine_with_previous(self, local: torch.Tensor) -> torch.Tensor:
        if self.prev_rank is None:
            return local
        received = torch.empty_like(local)
        work = dist.irecv(received, self.prev_rank, group=self.group, tag=_TAG)
        if work is None:  # torch returns None when this rank is not in the group
            raise PipelineError(f"rank {self.prev_rank} is not in this pipeline's process group")
        self._wait(work, f"the partial gradient norm from rank {self.prev_rank}")
        return combine_states(received, local, self.norm_type)

    def _act_on_partial(self, partial: torch.Tensor) -> _Pending:
        """Decide what the partial state allows, post the receive of the full state."""
        full = torch.empty_like(partial)
        work = dist.irecv(full, self.next_rank, group=self.group, tag=_TAG)
        verdict, _, _ = self._verdict(partial)
        step_now, deferred = partial_decision(verdict, self._step.reversible)
        if step_now:
            self._step.apply()
        return _Pending(stepped=step_now, deferred=deferred, full=full, work=work)

    def _settle(self, full: torch.Tensor, *, stepped: bool, deferred: bool) -> StepOutcome:
        """Make the step what the full state says it must be; update counters."""
        verdict, norm, coef = self._verdict(full)
        rolled_back = stepped and verdict is not Verdict.PLAIN
        if rolled_back:  # a clipped step taken again at once re-syncs a ZeRO shard itself
            self._step.rollback(sync=verdict is not Verdict.CLIP)
        if verdict is Verdict.CLIP:
            self._step.apply(torch.tensor(coef, dtype=self._norm_dtype))
        elif verdict is Verdict.PLAIN and not stepped:
            self._step.apply()
        self._step.release()
        outcome = StepOutcome(
            total_norm=norm,
            clip_coef=coef,
            skipped=verdict is Verdict.SKIP,
            rolled_back=rolled_back,
            deferred=deferred,
        )
        self._stats = self._stats.counted(outcome)
        self.last_outcome = outcome
        return outcome

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        payload = tensor.clone()  # the caller may reuse its tensor while the send is in flight
        self._sends.append((dist.isend(payload, dst, group=self.group, tag=_TAG), payload))

    def _wait_sends(self) -> None:
        for work, _ in self._sends:
            self._wait(work, "a gradient-norm message to be sent")
        self._sends.clear()


# --------------------------------------------------------------------------------------------
# The Pipeline's optimizer step


class PipelineOptimizer:
    """The optimizer step of one pipeline rank: a :class:`PostValidator` per optimizer, one chain.

    ``chain`` lists the global ranks of this rank's pipeline in chain order (see
    :func:`validation_chain`), ``rank`` is this rank's global rank and ``group`` a group of exactly
    the chain's ranks used only for the validator's messages.  Passing another optimizer to
    :meth:`step` finishes the previous one's pending step first (every rank does so at the same
    call) and keeps counting.
    """

    def __init__(
        self,
        chain: Sequence[int],
        rank: int,
        group: Any,
        post_validation: bool,
        device: torch.device,
        wait: Callable[[Any, str], None] | None = None,
        norm_excludes: Sequence[torch.Tensor] = (),
        shard_group: Any = None,
    ):
        self.wait = wait
        self.norm_excludes = tuple(norm_excludes)
        self.shard_group = shard_group
        self.prev_rank, self.next_rank = chain_neighbours(chain, rank)
        self.group = group
        self.post_validation = post_validation
        self.device = device
        self.validator: PostValidator | None = None
        self._retired = OptimizerStats()

    def step(self, optimizer: torch.optim.Optimizer, max_norm: float | None) -> None:
        """Clip to ``max_norm`` (None: no clipping) and step, or skip on non-finite gradients."""
        max_norm = check_max_norm(max_norm)
        validator = self.validator
        if validator is None or validator.optimizer is not optimizer:
            self._retire()
            validator = self.validator = PostValidator(
                optimizer,
                max_norm,
                prev_rank=self.prev_rank,
                next_rank=self.next_rank,
                group=self.group,
                post_validation=self.post_validation,
                device=self.device,
                wait=self.wait,
                norm_excludes=self.norm_excludes,
                shard_group=self.shard_group,
            )
        else:
            validator.finish()  # the previous step settles under its own max_norm
            validator.max_norm = max_norm
        validator.step()

    def finish(self) -> None:
        """Settle the pending step, if any (the chain's later ranks must finish theirs too)."""
        if self.validator is not None:
            self.validator.finish()

    def close(self) -> None:
        """Settle the pending step and wait for every message this rank sent."""
        if self.validator is not None:
            self.validator.close()

    @property
    def stats(self) -> OptimizerStats:
        """Counters of every settled step so far."""
        if self.validator is None:
            return self._retired
        return self._retired.plus(self.validator.stats)

    def _retire(self) -> None:
        if self.validator is not None:
            self.validator.close()
            self._retired = self.stats
            self.validator = None


def check_sharded_optimizer(optimizer: torch.optim.Optimizer, dp_ranks: Sequence[int]) -> None:
    """Refuse a ``ZeroRedundancyOptimizer`` that does not shard over the data-parallel group.

    ``dp_ranks`` are the global ranks holding this rank's chunks (this rank alone without data
    parallelism).  Sharding over other ranks would pair parameters that are not the same, and its
    broadcasts would wait on ranks that never step this optimizer.
    """
    if zero_local_optimizer(optimizer) is None:
        return
    group = getattr(optimizer, "process_group", None)
    ranks = sorted(dist.get_process_group_ranks(group)) if group is not None else []
    if ranks != sorted(dp_ranks):
        fix = (
            "build it with process_group=pipe.layout.dp_group"
            if len(dp_ranks) > 1
            else "with data_parallel=1 there is nothing to shard: pass the plain optimizer"
        )
        raise OptimizerValidationError(
            f"this ZeroRedundancyOptimizer shards over ranks {ranks}, but the ranks holding the same "
            f"parameters are {sorted(dp_ranks)}; {fix}"
        )


@torch.no_grad()
def unscale_gradients(parameters: Iterable[nn.Parameter], scale: float) -> None:
    """Divide the gradients of ``parameters`` by the loss scale ``scale`` (``GradScaler.unscale_``)."""
    if not scale > 0.0:
        raise PipelineError(f"unscale must be a positive loss scale, got {scale!r}")
    for param in parameters:
        if param.grad is not None:
            param.grad.div_(scale)
