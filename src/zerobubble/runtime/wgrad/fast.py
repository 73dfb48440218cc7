"""The autograd function that runs a :class:`~.rules.SplitRule` and the forward installed for it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from .rules import SplitRule
from .store import WeightGradStore, accumulate

_ARGS = 2  # x, plan: the parameters follow


class FastPlan:
    """What every call of one fast-path module shares, worked out once when the split is installed.

    The backward of each layer runs once per microbatch, so the per-call Python is kept to a few
    attribute reads: the rule's parameter names, where the parameters live, the tuple a deferring
    backward returns and which of the rule's methods W calls are all fixed here.
    """

    __slots__ = (
        "deferred_tail", "module", "names", "parameters", "rule", "store", "weight_work", "weights_in_b",
    )  # fmt: skip

    def __init__(self, rule: SplitRule, module: nn.Module, store: WeightGradStore):
        self.rule, self.module, self.store = rule, module, store
        self.names = rule.param_names(module)
        self.parameters = module._parameters  # one dict lookup a name, not nn.Module.__getattr__
        self.deferred_tail = (None,) * (_ARGS - 1 + len(self.names))
        self.weights_in_b = rule.weights_in_b
        # W: the rule's own accumulate (e.g. one GEMM into .grad), or its weight_grads added here
        overridden = type(rule).accumulate is not SplitRule.accumulate
        self.weight_work: Callable[..., None] = (
            partial(rule.accumulate, module) if overridden else self._accumulate_weight_grads
        )

    @staticmethod
    def covers(rule: SplitRule, module: nn.Module) -> bool:
        """Whether the rule's parameter names are all parameters of the module itself.

        Not so for a parametrized weight (``torch.nn.utils.parametrize``: a tensor computed from
        other parameters); such a module takes the generic split, which finds the real leaves.
        """
        own = module._parameters
        return all(own.get(name) is not None for name in rule.param_names(module))

    def params(self) -> list[torch.Tensor]:
        """The module's current parameters, in :attr:`names` order."""
        own = self.parameters
        return [own[name] for name in self.names]  # type: ignore[misc]  # covers(): none is None

    def backward(self, saved: Any, needs: Sequence[bool], grad_output: torch.Tensor) -> tuple[Any, ...]:
        """B (deferring: parameter work queued for W) or a fused BW (parameter gradients returned)."""
        rule, module, queue = self.rule, self.module, self.store.queue
        needed = needs[_ARGS:]
        if self.weights_in_b:
            grad_x, grads = rule.all_grads(module, saved, grad_output, needs[0], needed)
            if queue is not None:
                queue.append(partial(self._add_grads, grads))
                return (grad_x, *self.deferred_tail)
            return (grad_x, None, *grads)
        grad_x = rule.input_grad(module, saved, grad_output) if needs[0] else None
        if queue is not None:
            queue.append(partial(self.weight_work, saved, grad_output, needed))
            return (grad_x, *self.deferred_tail)
        return (grad_x, None, *rule.weight_grads(module, saved, grad_output, needed))

    def _accumulate_weight_grads(self, saved: Any, grad_output: torch.Tensor, needed: Sequence[bool]) -> None:
        self._add_grads(self.rule.weight_grads(self.module, saved, grad_output, needed))

    def _add_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        for param, grad in zip(self.params(), grads):
            if grad is not None:
                accumulate(param, grad)


class SplitFunction(torch.autograd.Function):
    """A module's forward whose backward computes the input gradient and defers the parameters'.

    The (possibly autocast-cast) parameters are inputs of the function, so its output requires grad
    even when ``x`` does not (a first stage); in a deferring backward their gradients are None here
    and the W op later adds them into the module's own parameters.
    """

    @staticmethod
    def forward(ctx, x, plan, *params):
        out, saved = plan.rule.forward(plan.module, x, params)
        ctx.save_for_backward(*saved)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, grad_output):
        # attributes of ctx are C++ properties building new tuples: each is read once
        return ctx.plan.backward(ctx.saved_tensors, ctx.needs_input_grad, grad_output)


def fast_forward(plan: FastPlan, generic: Callable[..., Any]) -> Callable[..., Any]:
    """The forward installed on the module of ``plan``.

    Calls the rule with one positional tensor; any other call (keywords, extra arguments) and, if
    the rule says so, calls under autocast take ``generic``.
    """
    rule = plan.rule
    apply = SplitFunction.apply

    def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
            return generic(module, *args, **kwargs)
        x = args[0]
        params = plan.params()
        if not torch.is_grad_enabled() or not any(p.requires_grad for p in params):
            return type(module).forward(module, x)
        device = x.device.type
        if torch.is_autocast_enabled(device) and rule.autocast != "keep":
            if rule.autocast == "generic":
                return generic(module, x)
            # an op autocast runs in lower precision: cast as autocast would, then run without it;
            # B and W then compute in the saved tensors' dtype and W casts into the parameter's dtype
            dtype = torch.get_autocast_dtype(device)
            x = x.to(dtype) if x.is_floating_point() else x
            params = [p.to(dtype) for p in params]
            with torch.autocast(device, enabled=False):
                return apply(x, plan, *params)
        return apply(x, plan, *params)

    return forward
