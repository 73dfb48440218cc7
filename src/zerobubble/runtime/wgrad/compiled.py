"""The split inside a compiled layer: its linear layers' weight gradients deferred to W.

AOTAutograd compiles a layer's backward into one graph that computes every gradient at once, so
the split cannot reach into it from outside (``docs/wgrad.md``, "torch.compile").  It can from
inside: every ``nn.Linear`` (and transformers' ``Conv1D``) of a compiled layer gets a forward that
dynamo traces into the layer's graph — an ``autograd.Function`` whose backward computes the input
gradient with ordinary ops (which inductor compiles and fuses like any other) and hands the
weight's factors to W through one opaque operator, ``zerobubble::defer_linear_grads``:

* the operator is *effectful* (``EffectType.ORDERED``): without that the compiler drops it from a
  first stage's backward, where no input gradient depends on it, and W would get nothing;
* it copies the layer input and output gradient it keeps (the compiled code may reuse their memory
  once the operator returns) and queues ``grad_W = grad_outᵀ · x`` (and the bias's sum) in the
  stage's :class:`~.store.WeightGradStore` — W runs it, as it runs a fast path's;
* it finds that store through the weight itself (an attribute set at installation): a Python
  integer in the graph would be a constant dynamo guards on, one graph per layer.

The rest of a compiled layer (norms, embeddings, raw parameters) keeps the compiled fused backward
in B.  Only schedules with W ops install it (a fused BW gains nothing from the split).
"""

from __future__ import annotations

import types
import weakref
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .rules import FastPaths, MatmulRule
from .store import WeightGradStore

_STORE_ATTRIBUTE = "_zerobubble_weight_grad_store"
"""Attribute of a split weight: a weak reference to the store its W work goes to."""


@torch.library.custom_op("zerobubble::defer_linear_grads", mutates_args=())
def defer_linear_grads(
    x: torch.Tensor,
    grad_output: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_by_in: bool,
) -> None:
    """Queue (or, in a fused backward, run) W's work of one linear call of a compiled layer."""
    reference = weight.__dict__.get(_STORE_ATTRIBUTE)
    store = reference() if reference is not None else None
    if store is None:
        raise RuntimeError(
            "zerobubble: a compiled linear layer's backward ran, but its weight "
            f"(shape {tuple(weight.shape)}) belongs to no pipeline stage any more; the split was "
            "removed while its compiled graph was still in use (call torch._dynamo.reset())"
        )
    needed = (weight.requires_grad, bias is not None and bias.requires_grad)
    # copies: the compiled code owns these buffers and may reuse them once this call returns
    saved, grad = (x.detach().clone(), weight), grad_output.detach().clone()
    work = partial(_RULES[out_by_in].accumulate_into, weight, bias, saved, grad, needed)
    if store.deferring:
        store.put(work)
    else:
        with torch.no_grad():
            work()


@defer_linear_grads.register_fake
def _(x, grad_output, weight, bias, out_by_in) -> None:
    return None


def _register_effect() -> None:
    from torch._library.effects import EffectType

    defer_linear_grads.register_effect(EffectType.ORDERED)


_register_effect()

_RULES = {True: MatmulRule(weight_is_out_by_in=True), False: MatmulRule(weight_is_out_by_in=False)}


class _DeferredLinear(torch.autograd.Function):
    """``x @ Wᵀ + b`` (``out_by_in``) or ``x @ W + b`` whose backward defers the weight's gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, out_by_in):
        ctx.save_for_backward(x, weight, bias)
        ctx.out_by_in = out_by_in
        w = weight.to(x.dtype)
        b = None if bias is None else bias.to(x.dtype)
        if out_by_in:
            return F.linear(x, w, b)
        flat = x.reshape(-1, x.shape[-1])
        product = flat.mm(w) if b is None else torch.addmm(b, flat, w)
        return product.view(*x.shape[:-1], w.shape[1])

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, bias = ctx.saved_tensors
        torch.ops.zerobubble.defer_linear_grads(x, grad_output, weight, bias, ctx.out_by_in)
        grad_x = None
        if ctx.needs_input_grad[0]:
            w = weight.to(grad_output.dtype)
            grad_x = grad_output.matmul(w if ctx.out_by_in else w.t())
        return grad_x, None, None, None


def _deferred_forward(
    out_by_in: bool, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The forward of a linear layer inside a compiled one (traced by dynamo into its graph)."""
    if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor) or not torch.is_grad_enabled():
        return type(module).forward(module, *args, **kwargs)
    x = args[0]
    weight, bias = module.weight, module.bias
    device = x.device.type
    if torch.is_autocast_enabled(device):
        # as autocast runs a linear: in its dtype; B and W then compute in it, W adds in the weight's
        x = x.to(torch.get_autocast_dtype(device))
        with torch.autocast(device, enabled=False):
            return _DeferredLinear.apply(x, weight, bias, out_by_in)
    return _DeferredLinear.apply(x, weight, bias, out_by_in)


# One function object per kind, shared by every layer: dynamo guards on the identity of a module's
# forward, so a function made per layer (a partial, a closure) would compile one graph per layer.
def _deferred_linear_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return _deferred_forward(True, module, args, kwargs)


def _deferred_conv1d_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return _deferred_forward(False, module, args, kwargs)


def split_linears(layer: nn.Module, store: WeightGradStore, fast_paths: FastPaths) -> list[nn.Module]:
    """Give every linear layer under the compiled ``layer`` the deferring forward; returns them.

    A linear is one whose rule in ``fast_paths`` is :class:`~.rules.MatmulRule` (``nn.Linear``,
    ``Conv1D``), whose weight (and bias) are its own and whose weight requires grad; one with an
    instance ``forward`` already is left alone.  Must run before the layer's first compiled call
    (dynamo traces the forwards then; a later change recompiles).
    """
    split = []
    for module in layer.modules():
        rule = fast_paths.rule_for(module)
        weight = module._parameters.get("weight")
        if (
            not isinstance(rule, MatmulRule)
            or "forward" in module.__dict__
            or weight is None
            or not weight.requires_grad
            or "bias" not in module._parameters
        ):
            continue
        forward = _deferred_linear_forward if rule.out_by_in else _deferred_conv1d_forward
        module.forward = types.MethodType(forward, module)
        setattr(weight, _STORE_ATTRIBUTE, weakref.ref(store))
        split.append(module)
    return split


def unsplit_linear(module: nn.Module) -> None:
    """Undo :func:`split_linears` for one module: its own forward, no store on its weight."""
    module.__dict__.pop("forward", None)
    weight = module._parameters.get("weight")
    if weight is not None:
        weight.__dict__.pop(_STORE_ATTRIBUTE, None)
