"""Optimizer post-validation: step before the global gradient state is known, fix it up later.

Why
---
Gradient clipping and the NaN/Inf check need *global* facts (the gradient norm over the whole
model, "is any gradient non-finite anywhere"), which a pipeline rank only learns through a
collective.  A collective right before the optimizer step is a synchronisation point: every rank
waits for the slowest, and the next iteration's warm-up cannot overlap this one's tail.  The
zero-bubble paper (§4) replaces it with *post-validation*:

1. **Partial reduction along a chain.**  Each rank computes its local partial state
   ``[sum of |g|^p over its gradients, non-finite flag]``, receives the partial state of the ranks
   before it in the chain (point-to-point, two float64 numbers), adds its own and sends the sum on.
2. **Optimistic step.**  With only a prefix of the sum a rank can already decide a lot, because
   every term is non-negative, so the partial norm is a lower bound of the full norm:

   * a non-finite value seen so far  -> the step *will* be skipped: do nothing;
   * partial norm already above ``max_norm`` -> clipping is certain but its factor is not known:
     *defer* the step until the full state arrives (no work wasted, nothing to undo);
   * otherwise step now with the unclipped gradients.  This is the common case (finite, no
     clipping) and it never rolls back.

   The last rank of the chain holds the full state and always steps exactly.
3. **Validation.**  The full state travels back down the chain (the last rank sends it to its
   predecessor, which forwards it, ...), overlapping the next iteration's warm-up.  On arrival a
   rank *confirms* its optimistic step, or *rolls it back in place* and redoes it with the clipped
   gradients, or rolls it back and skips (non-finite).  A deferred step is now taken.

Exactness
---------
The final parameters and optimizer state equal those of
``torch.nn.utils.clip_grad_norm_(all_params, max_norm)`` followed by ``optimizer.step()`` on the
whole model, and of no step at all when any gradient anywhere is non-finite:

* the clip coefficient is torch's, ``clamp(max_norm / (total_norm + 1e-6), max=1)``, computed in
  the gradients' dtype and applied in place to ``.grad`` exactly as torch does; the total norm is
  the same p-norm of the per-tensor norms, accumulated in float64, so it can differ from torch's
  float32 reduction order by at most an ulp of the norm (a relative 6e-8 on the clipped gradients);
* a redo is the user's own ``optimizer.step()`` (with the hyper-parameters, e.g. learning rate,
  recorded when the step was first requested, so an LR scheduler that already moved on does not
  matter), so it follows torch's arithmetic whatever implementation (for-loop, foreach, fused) the
  optimizer uses;
* the rollback is the algebraic inverse of torch's update, evaluated with the *same* intermediate
  expressions torch evaluates (same denominators, same step size), so the update it subtracts is
  bit-for-bit the update torch added and only the final rounding of each element is lost: the
  restored tensors differ from the originals by a few ulps of the *stepped* values.  Where the
  optimizer created its state in the step (first step of Adam, first momentum buffer of SGD) the
  rollback deletes that state, which is exact.

How exact, measured (float32, max-norm relative error of parameters and every state tensor):

* ``tests/test_optim_rollback.py``: 30 rounds, each taken unclipped, rolled back and redone with a
  clip factor down to 0.05 or skipped, for SGD (momentum, dampening, Nesterov, weight decay,
  maximize; for-loop, foreach and fused), Adam and AdamW (for-loop, foreach, fused): at most
  5.8e-7 against a twin that took the clipped steps directly;
* ``tests/test_post_validation.py`` (2 and 4 gloo ranks, 30 steps with clipping and NaN/Inf):
  at most 5.0e-7 against ``clip_grad_norm_`` + ``step`` on the whole model; the synchronous
  path, which never rolls back, is at 2.9e-7 (the float64 norm accumulation alone).

The one ill-conditioned case is a rank whose *own* gradients are much larger than the history in
its state and which is then clipped hard by the others: restoring ``v`` (and SGD's ``θ``) cancels
``(1−β₂)g²`` against ``β₂v``, losing about ``ulp · max|v_new| / max|v_old|``.  A rank only steps
optimistically when its own gradients are within ``max_norm``, which keeps that ratio modest; a
15x spike clipped by a factor 0.03 measured 3.5e-5.  No snapshot is taken (none was needed at the
1e-6 target in the regime above); a targeted one (the state of the tensors whose gradient
infinity-norm jumped) would be the remedy if that case matters.

Rollback formulas (γ learning rate, λ weight decay, t the step after the update, ĝ = ±g):

* AdamW: θ ← (θ + γ·m̂/(√v̂+ε)) / (1−γλ);  m ← (m − (1−β₁)ĝ)/β₁;  v ← (v − (1−β₂)ĝ²)/β₂;  t ← t−1.
  Adam (coupled decay): θ first as above without the division, then ĝ ← ĝ + λθ before m and v.
* SGD with momentum μ, dampening d: θ ← θ + γ·b (Nesterov: θ ← (θ + γ(ĝ + μb))/(1−γλ)), then
  b ← (b − (1−d)(ĝ + λθ))/μ; plain SGD: θ ← (θ + γĝ)/(1−γλ).

torch's foreach SGD with Nesterov momentum (no weight decay, no maximize) adds μ·b to ``.grad``
in place; this is detected through the gradient's version counter and undone too.

Nothing here copies a parameter-sized tensor: a step record holds the hyper-parameters of each
param group, *references* to the gradient tensors used and one flag per parameter.  Optimizers
that cannot be inverted (other classes, Adam with ``amsgrad`` — its running maximum forgets —,
``differentiable=True``, complex parameters, sparse gradients, γλ = 1) get a warning and are
stepped synchronously: every rank but the last defers its step until the full state is known.

Using it in a pipeline
----------------------
:meth:`zerobubble.Pipeline.optimizer_step` does all of this (through :class:`PipelineOptimizer`):
it orders the chain by the simulated end of each rank's program (:func:`validation_chain`) and
settles the pending step just before the next step's first forward op, after that step's first
receives are posted.  The rest of this section is for using :class:`PostValidator` directly.

Call :meth:`PostValidator.step` where ``optimizer.step()`` would be, and
:meth:`PostValidator.finish` before the parameters are read again (before the first forward of
the next iteration on that rank).  Order the chain so it follows the end of the backward pass: the
rank that finishes its gradients first is the head (for 1F1B-like schedules the last pipeline
rank), rank 0 the tail; the full state then travels back downstream with the next warm-up.  The
gradients of step k may be dropped (``zero_grad(set_to_none=True)``) before ``finish``: the
validator keeps references to them.  They must not be modified in place before ``finish``
(``zero_grad(set_to_none=False)``, accumulation by a new backward); that is detected and reported.
"""

from __future__ import annotations

import enum
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import PipelineError

__all__ = [
    "OptimizerStats",
    "OptimizerValidationError",
    "PipelineOptimizer",
    "PostValidator",
    "ReversibleStep",
    "StepOutcome",
    "check_max_norm",
    "clip_coefficient",
    "rollback_support",
    "validation_chain",
]

#: gloo tag of the validator's point-to-point messages, apart from the pipeline's own transfers.
DEFAULT_TAG = 24_010

ExtraReduce = Callable[[torch.Tensor, dist.ReduceOp], None]


class OptimizerValidationError(PipelineError):
    """The optimizer step cannot be validated as asked; the message says why and what to do."""


# --------------------------------------------------------------------------------------------
# Which optimizers can be rolled back


def _group_problem(optimizer: torch.optim.Optimizer, group: dict) -> str | None:
    """Why one param group's step cannot be inverted, or None when it can."""
    if group.get("differentiable", False):
        return "differentiable=True is not supported by the rollback"
    if any(torch.is_complex(p) for p in group["params"]):
        return "complex parameters are not supported by the rollback"
    lr_times_decay = float(group["lr"]) * float(group["weight_decay"])
    if isinstance(optimizer, torch.optim.Adam):
        if group["amsgrad"]:
            return "Adam(amsgrad=True) keeps a running maximum whose previous value a step forgets"
        if min(float(beta) for beta in group["betas"]) <= 0.0:
            return "Adam with a zero beta keeps no history to invert"
        if group["decoupled_weight_decay"] and lr_times_decay == 1.0:
            return "lr * weight_decay == 1 zeroes the parameters (decoupled decay)"
        return None
    momentum = float(group["momentum"])
    if momentum < 0.0:
        return "negative momentum is not supported by the rollback"
    if (momentum == 0.0 or group["nesterov"]) and lr_times_decay == 1.0:
        return "lr * weight_decay == 1 zeroes the parameters"
    return None


def rollback_support(optimizer: torch.optim.Optimizer) -> str | None:
    """Say why ``optimizer``'s step cannot be rolled back in place, or None when it can.

    Supported: ``torch.optim.SGD``, ``Adam`` and ``AdamW`` themselves (not subclasses, whose
    ``step`` may do anything), in any of their implementations (for-loop, foreach, fused).
    """
    if type(optimizer) not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        return (
            f"{type(optimizer).__name__} has no in-place rollback (only torch.optim.SGD, Adam and AdamW do)"
        )
    for group in optimizer.param_groups:
        problem = _group_problem(optimizer, group)
        if problem is not None:
            return problem
    return None


# --------------------------------------------------------------------------------------------
# Rollback arithmetic, one parameter at a time


def _frozen(value: Any) -> Any:
    """A copy of a hyper-parameter that later in-place edits (a scheduler's) cannot change."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        return tuple(_frozen(item) for item in value)
    return value


def _signed(grad: torch.Tensor, maximize: bool) -> torch.Tensor:
    return -grad if maximize else grad


def _undo_sgd(param, grad, state, hyper, created_buffer: bool, grad_was_mutated: bool) -> None:
    """Invert torch's SGD update of ``param`` (see the module docstring for the formulas)."""
    lr, decay = float(hyper["lr"]), float(hyper["weight_decay"])
    momentum, dampening = float(hyper["momentum"]), float(hyper["dampening"])
    if momentum == 0.0:
        param.add_(_signed(grad, hyper["maximize"]), alpha=lr)
        if decay != 0.0:
            param.div_(1.0 - lr * decay)
        return
    buffer = state["momentum_buffer"]
    if hyper["nesterov"]:
        if grad_was_mutated:
            # foreach Nesterov stored its direction ĝ + μ·b in .grad: step back along it, then
            # give the gradient its own value back.
            param.add_(grad, alpha=lr)
            grad.sub_(buffer, alpha=momentum)
        else:
            direction = _signed(grad, hyper["maximize"]).add(buffer, alpha=momentum)
            param.add_(direction, alpha=lr)
            if decay != 0.0:
                param.div_(1.0 - lr * decay)
    else:
        param.add_(buffer, alpha=lr)
    if created_buffer:
        del state["momentum_buffer"]
        return
    used = _signed(grad, hyper["maximize"])
    if decay != 0.0:
        used = used.add(param, alpha=decay)
    buffer.sub_(used, alpha=1.0 - dampening).div_(momentum)


def _undo_adam(param, grad, state, hyper, created_state: bool) -> None:
    """Invert torch's Adam/AdamW update of ``param`` (see the module docstring)."""
    lr, decay, eps = float(hyper["lr"]), float(hyper["weight_decay"]), float(hyper["eps"])
    beta1, beta2 = (float(beta) for beta in hyper["betas"])
    exp_avg, exp_avg_sq, step = state["exp_avg"], state["exp_avg_sq"], state["step"]
    t = float(step)
    step_size = lr / (1.0 - beta1**t)
    denom = (exp_avg_sq.sqrt() / (1.0 - beta2**t) ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=step_size)
    decoupled = hyper["decoupled_weight_decay"]
    if decay != 0.0 and decoupled:
        param.div_(1.0 - lr * decay)
    if created_state:
        state.clear()
        return
    used = _signed(grad, hyper["maximize"])
    if decay != 0.0 and not decoupled:
        used = used.add(param, alpha=decay)
    exp_avg.sub_(used, alpha=1.0 - beta1).div_(beta1)
    exp_avg_sq.addcmul_(used, used, value=-(1.0 - beta2)).div_(beta2).clamp_(min=0.0)
    step.sub_(1)


def _state_is_new(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> bool:
    """Whether the coming step creates ``param``'s optimizer state (so undoing it deletes it)."""
    state = optimizer.state.get(param)
    if not state:
        return True
    if isinstance(optimizer, torch.optim.SGD):
        return state.get("momentum_buffer") is None
    return False


# --------------------------------------------------------------------------------------------
# One recorded, reversible optimizer step


@dataclass
class _StepRecord:
    """What one step needs to be taken later or undone: no parameter-sized copies."""

    hypers: list[dict]  # per group: every setting but "params", frozen
    grads: list[list[torch.Tensor | None]]  # per group, per param: the gradient tensor used
    versions: list[list[int]]  # version counters of those gradients, to detect foreign edits
    created_state: list[list[bool]]  # per group, per param: the applied step created the state
    mutated: list[list[bool]]  # per group, per param: the applied step wrote into the gradient
    reversible: bool
    applied: bool = False


@torch.no_grad()
def _scale_in_place(grads: list[torch.Tensor], factor: torch.Tensor | float) -> None:
    """Multiply the gradients by ``factor`` in place, as clip_grad_norm_ does."""
    for grad in grads:
        grad.mul_(factor.to(grad.device) if isinstance(factor, torch.Tensor) else factor)


def _versions(grads: list[list[torch.Tensor | None]]) -> list[list[int]]:
    return [[-1 if g is None else g._version for g in group] for group in grads]


class ReversibleStep:
    """One optimizer step that can be recorded, taken, undone in place and taken again.

    ``record()`` captures the step as it would be taken now (hyper-parameters and references to
    the current gradients), ``apply(grad_scale)`` takes it (scaling the recorded gradients in
    place first, as clipping does), ``rollback()`` undoes it in place.  Between these calls the
    caller may drop the parameters' ``.grad`` (the record keeps the tensors) and change the
    learning rate (the record keeps the old one).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._record: _StepRecord | None = None

    @property
    def recorded(self) -> bool:
        """Whether a step is recorded (and neither released nor finished)."""
        return self._record is not None

    @property
    def applied(self) -> bool:
        """Whether the recorded step has been taken and not undone."""
        return self._record is not None and self._record.applied

    @property
    def reversible(self) -> bool:
        """Whether the recorded step can be rolled back (False: take it only once it is final)."""
        return self._record is not None and self._record.reversible

    def grads(self, exclude: frozenset[int] = frozenset()) -> list[torch.Tensor]:
        """The recorded gradient tensors (those that exist), in param-group order.

        ``exclude`` holds the ``id`` of parameters whose gradients to leave out.
        """
        record = self._require_record()
        return [
            g
            for grads, group in zip(record.grads, self.optimizer.param_groups)
            for g, p in zip(grads, group["params"])
            if g is not None and id(p) not in exclude
        ]

    def record(self) -> None:
        """Capture the step the optimizer would take now; replaces any earlier record."""
        groups = self.optimizer.param_groups
        grads = [[p.grad for p in group["params"]] for group in groups]
        sparse = any(g is not None and g.is_sparse for group in grads for g in group)
        self._record = _StepRecord(
            hypers=[{k: _frozen(v) for k, v in group.items() if k != "params"} for group in groups],
            grads=grads,
            versions=_versions(grads),
            created_state=[[False] * len(group) for group in grads],
            mutated=[[False] * len(group) for group in grads],
            reversible=rollback_support(self.optimizer) is None and not sparse,
        )

    def apply(self, grad_scale: torch.Tensor | float | None = None) -> None:
        """Take the recorded step, first multiplying the recorded gradients by ``grad_scale``."""
        record = self._require_record()
        if record.applied:
            raise OptimizerValidationError("the recorded step is already applied; roll it back first")
        self._check_grads_untouched(record)
        if grad_scale is not None:
            _scale_in_place(self.grads(), grad_scale)
        before = _versions(record.grads)
        record.created_state = [
            [g is not None and _state_is_new(self.optimizer, p) for p, g in zip(group["params"], grads)]
            for group, grads in zip(self.optimizer.param_groups, record.grads)
        ]
        with self._installed(record):
            self.optimizer.step()
        record.versions = _versions(record.grads)
        record.mutated = [[a != b for a, b in zip(x, y)] for x, y in zip(before, record.versions)]
        record.applied = True

    def rollback(self) -> None:
        """Undo the applied recorded step in place (parameters, optimizer state, step counters)."""
        record = self._require_record()
        if not record.applied:
            raise OptimizerValidationError("no applied step to roll back")
        if not record.reversible:
            problem = rollback_support(self.optimizer) or "sparse gradients"
            raise OptimizerValidationError(f"this step cannot be rolled back: {problem}")
        self._check_grads_untouched(record)
        is_sgd = isinstance(self.optimizer, torch.optim.SGD)
        with torch.no_grad():
            for group, hyper, grads, created, mutated in zip(
                self.optimizer.param_groups,
                record.hypers,
                record.grads,
                record.created_state,
                record.mutated,
            ):
                for param, grad, new, wrote in zip(group["params"], grads, created, mutated):
                    if grad is None:
                        continue
                    state = self.optimizer.state[param]
                    if is_sgd:
                        _undo_sgd(param, grad, state, hyper, new, wrote)
                    else:
                        _undo_adam(param, grad, state, hyper, new)
                    if not state:
                        del self.optimizer.state[param]
        record.versions = _versions(record.grads)
        record.applied = False

    def release(self) -> None:
        """Forget the record (drops the references to the gradients of that step)."""
        self._record = None

    def _require_record(self) -> _StepRecord:
        if self._record is None:
            raise OptimizerValidationError("no optimizer step recorded; call record() first")
        return self._record

    @staticmethod
    def _check_grads_untouched(record: _StepRecord) -> None:
        if _versions(record.grads) != record.versions:
            raise OptimizerValidationError(
                "the gradients of the pending optimizer step were modified in place before it was "
                "validated; call finish() before zero_grad(set_to_none=False) or the next backward"
            )

    @contextmanager
    def _installed(self, record: _StepRecord) -> Iterator[None]:
        """Temporarily give the params the recorded gradients and the groups the recorded settings."""
        groups = self.optimizer.param_groups
        if len(groups) != len(record.hypers):
            raise OptimizerValidationError(
                "param groups were added between recording and applying a step; finish() first"
            )
        current_grads = [[p.grad for p in group["params"]] for group in groups]
        current_hypers = [{k: group[k] for k in hyper} for group, hyper in zip(groups, record.hypers)]
        try:
            for group, hyper, grads in zip(groups, record.hypers, record.grads):
                group.update(hyper)
                for param, grad in zip(group["params"], grads):
                    param.grad = grad
            yield
        finally:
            for group, hyper, grads in zip(groups, current_hypers, current_grads):
                group.update(hyper)
                for param, grad in zip(group["params"], grads):
                    param.grad = grad


# --------------------------------------------------------------------------------------------
# The global state: norm and non-finite flag


def check_max_norm(max_norm: float | None) -> float | None:
    """``max_norm`` as a float (None: no clipping); raise when it is not positive."""
    if max_norm is None:
        return None
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not float(max_norm) > 0.0:
        raise OptimizerValidationError(f"max_norm must be a positive number or None, got {max_norm!r}")
    return float(max_norm)


def clip_coefficient(total_norm: float, max_norm: float | None, dtype: torch.dtype) -> float:
    """torch's clip factor ``clamp(max_norm / (total_norm + 1e-6), max=1)``, in ``dtype``.

    1.0 means no clipping (also when ``max_norm`` is None).
    """
    if max_norm is None:
        return 1.0
    norm = torch.tensor(total_norm, dtype=dtype)
    return float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))


class _Verdict(enum.Enum):
    SKIP = "skip"  # a gradient somewhere is non-finite: no step
    CLIP = "clip"  # the step uses clipped gradients
    PLAIN = "plain"  # the step uses the gradients as they are


@dataclass(frozen=True)
class StepOutcome:
    """How one optimizer step ended, once the full state was known.

    ``total_norm`` is the gradient norm over all ranks (inf or nan when a gradient was not
    finite), ``clip_coef`` the factor applied to the gradients (1.0: no clipping, nan: skipped).
    ``params_changed`` says whether the parameters differ from what they were right after
    :meth:`PostValidator.step` returned (a rollback or a deferred step happened): anything
    computed from them in between must be recomputed.
    """

    total_norm: float
    clip_coef: float
    skipped: bool
    rolled_back: bool
    deferred: bool

    @property
    def params_changed(self) -> bool:
        return self.rolled_back or self.deferred


@dataclass
class _Pending:
    """A step whose full state is still travelling back down the chain."""

    stepped: bool  # an optimistic (unclipped) step was taken
    deferred: bool  # the step waits for the full state
    full: torch.Tensor  # receive buffer of the full state
    work: Any  # the irecv filling it


class PostValidator:
    """The optimizer step of one pipeline rank, with gradient clipping and a non-finite check.

    ``optimizer`` holds this rank's parameters (the norm is over their gradients).  The chain of
    ranks is given by ``prev_rank`` / ``next_rank`` (global ranks, None at the ends); ``group``
    is the process group to send on (use a dedicated one with NCCL so these tiny messages never
    interleave with the pipeline's transfers).  ``post_validation=False`` gives the plain
    synchronous version with the same API: one all-reduce of the state over ``group`` (which must
    then contain exactly the chain's ranks), then the exact step.

    ``extra_reduce(state, op)`` — optional — reduces this rank's local state (a float64 tensor
    ``[sum |g|^p or max |g|, non-finite flag]``) in place over another group before it joins the
    chain, e.g. ``lambda t, op: dist.all_reduce(t, op=op, group=tp_or_sharded_dp_group)`` when the
    rank's gradients are sharded.

    ``norm_excludes`` — optional — are parameters whose gradients another rank counts in the norm
    (a copy of a parameter tied across ranks: its gradient is the same on every holder).

    ``wait(work, what)`` — optional — waits for one of its transfers (the Pipeline passes one that
    honours its timeout and stops when a peer reports an error); plain ``work.wait()`` otherwise.

    Counters: ``steps``, ``steps_rolled_back``, ``steps_skipped``, ``steps_deferred``,
    ``steps_clipped``.
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
        extra_reduce: ExtraReduce | None = None,
        device: torch.device | str | None = None,
        tag: int = DEFAULT_TAG,
        wait: Callable[[Any, str], None] | None = None,
        norm_excludes: Sequence[torch.Tensor] = (),
    ) -> None:
        self._check_settings(max_norm, norm_type, prev_rank, next_rank)
        self._excluded = frozenset(id(p) for p in norm_excludes)
        self._wait: Callable[[Any, str], None] = wait or (lambda work, what: work.wait())
        self.optimizer = optimizer
        self.max_norm = None if max_norm is None else float(max_norm)
        self.norm_type = float(norm_type)
        self.prev_rank, self.next_rank, self.group = prev_rank, next_rank, group
        self.post_validation = post_validation
        self.extra_reduce = extra_reduce
        self.tag = tag
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
        self.last_outcome: StepOutcome | None = None
        self.steps = self.steps_rolled_back = self.steps_skipped = 0
        self.steps_deferred = self.steps_clipped = 0
        self._warn_if_not_reversible()

    # -- public protocol ------------------------------------------------------------------------

    @property
    def pending(self) -> bool:
        """Whether a step still waits for its validation (call :meth:`finish`)."""
        return self._pending is not None

    def step(self) -> None:
        """Take this rank's part of the optimizer step (finishing the previous one first).

        Blocks only to receive the partial state from ``prev_rank``.  In post-validation mode the
        result may be provisional until :meth:`finish`; in synchronous mode it is final.
        """
        self.finish()
        self._wait_sends()
        self._step.record()
        local = self._local_state()
        if self.extra_reduce is not None:
            self.extra_reduce(local, self._reduce_op)
        if not self.post_validation:
            work = dist.all_reduce(local, op=self._reduce_op, group=self.group, async_op=True)
            self._wait(work, "the gradient norm's all-reduce")
            self._settle(local, stepped=False, deferred=False)
            return
        partial = self._combine_with_previous(local)
        if self.next_rank is None:
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
        if self.prev_rank is not None:
            self._send(pending.full, self.prev_rank)
        return self._settle(pending.full, stepped=pending.stepped, deferred=pending.deferred)

    synchronize = finish

    def close(self) -> StepOutcome | None:
        """Finish the pending step and wait for every message this rank sent."""
        outcome = self.finish()
        self._wait_sends()
        return outcome

    # -- internals ------------------------------------------------------------------------------

    @staticmethod
    def _check_settings(max_norm, norm_type, prev_rank, next_rank) -> None:
        check_max_norm(max_norm)
        if not (float(norm_type) > 0.0):
            raise OptimizerValidationError(f"norm_type must be positive (or inf), got {norm_type!r}")
        if prev_rank is not None and prev_rank == next_rank:
            raise OptimizerValidationError(
                f"prev_rank and next_rank are both {prev_rank}; the chain must visit each rank once"
            )

    def _warn_if_not_reversible(self) -> None:
        problem = rollback_support(self.optimizer)
        if problem is not None and self.post_validation and self.next_rank is not None:
            warnings.warn(
                f"optimizer post-validation: {problem}; this rank will step only once the full "
                "gradient state is known (synchronously)",
                stacklevel=3,
            )

    @property
    def _reduce_op(self) -> dist.ReduceOp:
        # torch's stubs type the members as RedOpType while the collectives take ReduceOp
        return dist.ReduceOp.MAX if math.isinf(self.norm_type) else dist.ReduceOp.SUM  # type: ignore[return-value]

    @torch.no_grad()
    def _local_state(self) -> torch.Tensor:
        """``[sum of |g|_p^p (max for p = inf), non-finite flag]`` of this rank, float64."""
        grads = self._step.grads(self._excluded)
        if not grads:
            return torch.zeros(2, dtype=torch.float64, device=self.device)
        norms = torch.stack(
            [torch.linalg.vector_norm(g, self.norm_type).to(self.device, torch.float64) for g in grads]
        )
        nonfinite = (~torch.isfinite(norms)).any().to(torch.float64)
        part = norms.max() if math.isinf(self.norm_type) else norms.pow(self.norm_type).sum()
        return torch.stack([part, nonfinite])

    def _combine_with_previous(self, local: torch.Tensor) -> torch.Tensor:
        if self.prev_rank is None:
            return local
        received = torch.empty_like(local)
        work = dist.irecv(received, self.prev_rank, group=self.group, tag=self.tag)
        if work is None:  # torch returns None when this rank is not in the group
            raise PipelineError(f"rank {self.prev_rank} is not in this pipeline's process group")
        self._wait(work, f"the partial gradient norm from rank {self.prev_rank}")
        if math.isinf(self.norm_type):
            return torch.maximum(received, local)
        return received + local

    def _verdict(self, state: torch.Tensor) -> tuple[_Verdict, float, float]:
        part, nonfinite = (float(x) for x in state.cpu())
        norm = part if math.isinf(self.norm_type) else part ** (1.0 / self.norm_type)
        if nonfinite > 0.0 or not math.isfinite(norm):
            return _Verdict.SKIP, norm, float("nan")
        coef = clip_coefficient(norm, self.max_norm, self._norm_dtype)
        return (_Verdict.PLAIN if coef == 1.0 else _Verdict.CLIP), norm, coef

    def _act_on_partial(self, partial: torch.Tensor) -> _Pending:
        """Decide what the partial state allows, post the receive of the full state."""
        full = torch.empty_like(partial)
        work = dist.irecv(full, self.next_rank, group=self.group, tag=self.tag)
        verdict, _, _ = self._verdict(partial)
        optimistic = verdict is _Verdict.PLAIN and self._step.reversible
        if optimistic:
            self._step.apply()
        return _Pending(
            stepped=optimistic, deferred=verdict is not _Verdict.SKIP and not optimistic, full=full, work=work
        )

    def _settle(self, full: torch.Tensor, *, stepped: bool, deferred: bool) -> StepOutcome:
        """Make the step what the full state says it must be; update counters."""
        verdict, norm, coef = self._verdict(full)
        rolled_back = stepped and verdict is not _Verdict.PLAIN
        if rolled_back:
            self._step.rollback()
        if verdict is _Verdict.CLIP:
            self._step.apply(torch.tensor(coef, dtype=self._norm_dtype))
        elif verdict is _Verdict.PLAIN and not stepped:
            self._step.apply()
        self._step.release()
        outcome = StepOutcome(
            total_norm=norm,
            clip_coef=coef,
            skipped=verdict is _Verdict.SKIP,
            rolled_back=rolled_back,
            deferred=deferred,
        )
        self._count(outcome)
        return outcome

    def _count(self, outcome: StepOutcome) -> None:
        self.steps += 1
        self.steps_rolled_back += outcome.rolled_back
        self.steps_skipped += outcome.skipped
        self.steps_deferred += outcome.deferred
        self.steps_clipped += (not outcome.skipped) and outcome.clip_coef < 1.0
        self.last_outcome = outcome

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        payload = tensor.clone()
        self._sends.append((dist.isend(payload, dst, group=self.group, tag=self.tag), payload))

    def _wait_sends(self) -> None:
        for work, _ in self._sends:
            self._wait(work, "a gradient-norm message to be sent")
        self._sends.clear()


# --------------------------------------------------------------------------------------------
# The Pipeline's optimizer step


def validation_chain(finish_times: Sequence[float]) -> list[int]:
    """Pipeline ranks in chain order: the rank whose program ends first is the head.

    ``finish_times[r]`` is when rank ``r``'s program ends (the simulator's prediction).  Ordering
    the chain by it means a rank waits for its predecessor's partial state only briefly (that rank
    finished earlier), and the tail — the last to finish, the first to start the next warm-up in
    1F1B-like and V-shape schedules — holds the full state at once.  Ties put the higher rank first.
    """
    return sorted(range(len(finish_times)), key=lambda rank: (finish_times[rank], -rank))


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
    ):
        self.wait = wait
        self.norm_excludes = tuple(norm_excludes)
        position = list(chain).index(rank)
        self.prev_rank = chain[position - 1] if position > 0 else None
        self.next_rank = chain[position + 1] if position + 1 < len(chain) else None
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
        validator = self.validator
        if validator is None:
            return self._retired
        return self._retired.plus(
            OptimizerStats(
                validator.steps,
                validator.steps_clipped,
                validator.steps_skipped,
                validator.steps_rolled_back,
                validator.steps_deferred,
                validator.pending,
            )
        )

    def _retire(self) -> None:
        if self.validator is not None:
            self.validator.close()
            self._retired = self.stats
            self.validator = None
