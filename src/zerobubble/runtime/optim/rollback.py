"""Undo one step of a torch optimizer in place.

Optimizer post-validation (:mod:`.post_validation`) steps before it knows whether the step must be clipped
or skipped; when it guessed wrong it undoes the step here and takes it again.  A
:class:`ReversibleStep` records a step (the hyper-parameters of each param group and references to
the gradients it uses, no parameter-sized copies), takes it with the optimizer's own ``step()``,
and rolls it back by inverting torch's update of ``torch.optim.SGD``, ``Adam`` and ``AdamW`` (any
of their for-loop, foreach and fused implementations).  :func:`rollback_support` says which
optimizers cannot be inverted; those are stepped only once the step is final.

``torch.distributed.optim.ZeroRedundancyOptimizer`` over one of those is reversible too: its step
updates this rank's shard with the local optimizer (``optimizer.optim``) and broadcasts every shard
over the data-parallel group.  The rollback inverts the local optimizer on the shard, then
broadcasts the shards again, so every data-parallel rank holds the owners' restored values (a step
taken again at once broadcasts them itself, so that broadcast can be left out:
``rollback(sync=False)``).  The broadcast is a collective: the data-parallel ranks must roll back
together, which they do when they validate identical gradients along identical chains.

The formulas, their exactness and measured errors: ``docs/optimizer-post-validation.md``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import OptimizerValidationError

__all__ = ["OptimizerValidationError", "ReversibleStep", "rollback_support", "zero_local_optimizer"]


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


def _is_zero(optimizer: torch.optim.Optimizer) -> bool:
    # an instance exists only once torch's module is imported: no import (and its cost) here
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


def zero_local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """The local optimizer of a ``ZeroRedundancyOptimizer`` (this rank's shard), None for any other."""
    return getattr(optimizer, "optim", None) if _is_zero(optimizer) else None


def _zero_problem(optimizer: torch.optim.Optimizer) -> str | None:
    """Why a ``ZeroRedundancyOptimizer``'s step cannot be rolled back, or None when it can."""
    local = zero_local_optimizer(optimizer)
    if getattr(optimizer, "_overlap_with_ddp", False):
        return "ZeroRedundancyOptimizer(overlap_with_ddp=True) steps inside DDP's hook, not in step()"
    if local is None or not callable(getattr(optimizer, "_sync_params", None)):
        return "this torch's ZeroRedundancyOptimizer has no local optimizer or shard broadcast to reuse"
    if type(local) not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        return (
            f"ZeroRedundancyOptimizer over {type(local).__name__} has no in-place rollback "
            "(only over torch.optim.SGD, Adam and AdamW)"
        )
    # the exposed groups' settings are what the local optimizer steps with (ZeRO copies them over)
    for group in optimizer.param_groups:
        problem = _group_problem(local, group)
        if problem is not None:
            return problem
    return None


def rollback_support(optimizer: torch.optim.Optimizer) -> str | None:
    """Say why ``optimizer``'s step cannot be rolled back in place, or None when it can.

    Supported: ``torch.optim.SGD``, ``Adam`` and ``AdamW`` themselves (not subclasses, whose
    ``step`` may do anything), in any of their implementations (for-loop, foreach, fused), and a
    ``ZeroRedundancyOptimizer`` over one of them (``overlap_with_ddp=False``, the default).
    """
    if _is_zero(optimizer):
        return _zero_problem(optimizer)
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
    """Invert torch's SGD update of ``param``: θ first, then the momentum buffer b.

    γ lr, λ weight decay, μ momentum, d dampening, ĝ = ±g:  θ ← θ + γ·b (Nesterov:
    θ ← (θ + γ(ĝ + μb))/(1−γλ)), then b ← (b − (1−d)(ĝ + λθ))/μ; without momentum
    θ ← (θ + γĝ)/(1−γλ).
    """
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
    if created_buffer:  # the step set b = ĝ + λθ: deleting it is exact
        del state["momentum_buffer"]
        return
    # θ is restored first because the buffer's update used the decay term of the *old* θ
    used = _signed(grad, hyper["maximize"])
    if decay != 0.0:
        used = used.add(param, alpha=decay)
    buffer.sub_(used, alpha=1.0 - dampening).div_(momentum)


def _undo_adam(param, grad, state, hyper, created_state: bool) -> None:
    """Invert torch's Adam/AdamW update of ``param``: θ, then m, v and the step count t.

    AdamW: θ ← (θ + γ·m̂/(√v̂+ε)) / (1−γλ);  m ← (m − (1−β₁)ĝ)/β₁;  v ← (v − (1−β₂)ĝ²)/β₂;
    t ← t−1.  Adam (coupled decay): θ as above without the division, then ĝ ← ĝ + λθ.
    """
    lr, decay, eps = float(hyper["lr"]), float(hyper["weight_decay"]), float(hyper["eps"])
    beta1, beta2 = (float(beta) for beta in hyper["betas"])
    exp_avg, exp_avg_sq, step = state["exp_avg"], state["exp_avg_sq"], state["step"]
    t = float(step)
    # The same step size and denominator expressions as torch's update, so the update subtracted
    # here is bit-for-bit the one torch added and only the final rounding of θ is lost.
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
    # (v − (1−β₂)ĝ²) cancels two nearly equal terms; rounding must not leave v negative
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
    learning rate (the record keeps the old one).  With a ``ZeroRedundancyOptimizer``, ``apply``
    and ``rollback`` are collectives over its process group (see the module's docstring).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        # a ZeroRedundancyOptimizer's local optimizer holds the state of this rank's shard
        self._local = zero_local_optimizer(optimizer)
        self._stateful = optimizer if self._local is None else self._local
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
        # Version counters tell which gradients the step itself wrote into (foreach Nesterov SGD
        # does), so the rollback can restore them; no gradient is copied.
        before = _versions(record.grads)
        record.created_state = [
            [g is not None and _state_is_new(self._stateful, p) for p, g in zip(group["params"], grads)]
            for group, grads in zip(self.optimizer.param_groups, record.grads)
        ]
        with self._installed(record):
            self.optimizer.step()
        record.versions = _versions(record.grads)
        record.mutated = [[a != b for a, b in zip(x, y)] for x, y in zip(before, record.versions)]
        record.applied = True

    def rollback(self, sync: bool = True) -> None:
        """Undo the applied recorded step in place (parameters, optimizer state, step counters).

        With a ``ZeroRedundancyOptimizer`` this rank undoes the step of its own shard and then
        broadcasts the shards over the data-parallel group (a collective).  ``sync=False`` leaves
        that broadcast out — the other ranks' shards then stay stepped here — for a rollback that
        :meth:`apply` follows at once (its step broadcasts every shard).
        """
        record = self._require_record()
        if not record.applied:
            raise OptimizerValidationError("no applied step to roll back")
        if not record.reversible:
            problem = rollback_support(self.optimizer) or "sparse gradients"
            raise OptimizerValidationError(f"this step cannot be rolled back: {problem}")
        self._check_grads_untouched(record)
        stateful = self._stateful
        # ZeRO: only this rank's shard has optimizer state to invert; the rest is broadcast
        owned = (
            None if self._local is None else {id(p) for g in self._local.param_groups for p in g["params"]}
        )
        is_sgd = isinstance(stateful, torch.optim.SGD)
        with torch.no_grad():
            for group, hyper, grads, created, mutated in zip(
                self.optimizer.param_groups,
                record.hypers,
                record.grads,
                record.created_state,
                record.mutated,
            ):
                for param, grad, new, wrote in zip(group["params"], grads, created, mutated):
                    if grad is None or (owned is not None and id(param) not in owned):
                        continue
                    state = stateful.state[param]
                    if is_sgd:
                        _undo_sgd(param, grad, state, hyper, new, wrote)
                    else:
                        _undo_adam(param, grad, state, hyper, new)
                    if not state:
                        del stateful.state[param]
            if self._local is not None and sync:
                self.optimizer._sync_params()  # type: ignore[attr-defined]
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
                "validated; settle it first (Pipeline.synchronize(), PostValidator.finish()) before "
                "zero_grad(set_to_none=False) or the next backward, or zero them with set_to_none=True"
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
