"""The autograd function that runs a :class:`~.rules.SplitRule` and the forward installed for it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .rules import SplitRule
from .store import WeightGradStore, accumulate

_ARGS = 4  # x, rule, module, store: the parameters follow


class SplitFunction(torch.autograd.Function):
    """A module's forward whose backward computes the input gradient and defers the parameters'.

    The (possibly autocast-cast) parameters are inputs of the function, so its output requires grad
    even when ``x`` does not (a first stage); in a deferring backward their gradients are None here
    and the W op later adds them into the module's own parameters.
    """

    @staticmethod
    def forward(ctx, x, rule, module, store, *params):
        out, saved = rule.forward(module, x, params)
        ctx.save_for_backward(*saved)
        ctx.rule, ctx.module, ctx.store = rule, module, store
        ctx.no_grads = (None,) * (_ARGS - 1 + len(params))  # the deferring backward's tail
        return out

    @staticmethod
    def backward(ctx, grad_output):
        # attributes of ctx are C++ properties building new tuples: read each once (per-layer cost)
        saved, needs, rule, module, store = (
            ctx.saved_tensors,
            ctx.needs_input_grad,
            ctx.rule,
            ctx.module,
            ctx.store,
        )
        needed = needs[_ARGS:]
        if rule.weights_in_b:
            grad_x, grads = rule.all_grads(module, saved, grad_output, needs[0], needed)
            if store.deferring:
                store.put(functools.partial(_add_grads, module, rule.param_names(module), grads))
                return (grad_x, *ctx.no_grads)
            return (grad_x, None, None, None, *grads)
        grad_x = rule.input_grad(module, saved, grad_output) if needs[0] else None
        if store.deferring:
            store.put(functools.partial(rule.accumulate, module, saved, grad_output, needed))
            return (grad_x, *ctx.no_grads)
        return (grad_x, None, None, None, *rule.weight_grads(module, saved, grad_output, needed))


def _add_grads(module: nn.Module, names: tuple[str, ...], grads: list[torch.Tensor | None]) -> None:
    for name, grad in zip(names, grads):
        if grad is not None:
            accumulate(getattr(module, name), grad)


def fast_forward(rule: SplitRule, store: WeightGradStore, generic: Callable[..., Any]) -> Callable[..., Any]:
    """The forward installed on a module ``rule`` covers.

    Calls the rule with one positional tensor; any other call (keywords, extra arguments) and, if
    the rule says so, calls under autocast take ``generic``.
    """
    names_of = rule.param_names

    def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
            return generic(module, *args, **kwargs)
        x = args[0]
        params = [getattr(module, name) for name in names_of(module)]
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
                return SplitFunction.apply(x, rule, module, store, *params)
        return SplitFunction.apply(x, rule, module, store, *params)

    return forward
