"""Weight-gradient deferral: the B/W split of every ``nn.Linear`` of a stage.

A zero-bubble schedule runs the backward of a stage in two ops.  **B** computes the gradient of the
stage input, which the previous stage waits for; **W** computes the weight gradients, which nobody
waits for, so the schedule may postpone it into a bubble.

For ``nn.Linear`` the split is exact and costs nothing extra: :class:`DeferredLinear` is an autograd
function whose backward computes only ``grad_input = grad_output @ weight`` and hands
``(input, grad_output)`` to the stage's :class:`WeightGradStore`; the W op later computes
``grad_output^T @ input`` (and the bias sum) and accumulates it into ``.grad`` — the same numbers a
plain backward gives.  Parameters of every other module type (LayerNorm, Embedding, a custom module
calling ``torch.addmm``) keep their ordinary autograd path and get their gradients in B.

The store belongs to one stage object (never a global), and its entries are keyed by
``(stage, microbatch)`` so W ops may run in whatever order the schedule says.
"""

from __future__ import annotations

import types
from collections.abc import Iterable

import torch
from torch import nn


class WeightGradStore:
    """Deferred weight-gradient work of one stage, keyed by ``(stage, microbatch)``.

    Between :meth:`begin` and :meth:`end` (one B op), every :class:`DeferredLinear` backward either
    appends ``(linear, input, grad_output)`` under the current key (``defer=True``) or returns its
    weight gradients to autograd at once (``defer=False``, a fused BW op).
    """

    def __init__(self) -> None:
        self._pending: dict[tuple[int, int], list[tuple[nn.Linear, torch.Tensor, torch.Tensor]]] = {}
        self._key: tuple[int, int] | None = None
        self.deferring = False

    def begin(self, key: tuple[int, int], defer: bool) -> None:
        """Start the backward of ``key``; ``defer`` says whether Linear weight gradients wait for W."""
        self._key = key
        self.deferring = defer

    def end(self) -> None:
        """Finish the backward started by :meth:`begin`."""
        self._key = None
        self.deferring = False

    def put(self, linear: nn.Linear, inputs: torch.Tensor, grad_output: torch.Tensor) -> None:
        """Keep what the W op of the current key needs for ``linear``."""
        self._pending.setdefault(self._key, []).append((linear, inputs, grad_output))  # type: ignore[arg-type]

    def flush(self, key: tuple[int, int]) -> None:
        """Run the W op of ``key``: accumulate every deferred weight gradient into ``.grad``.

        A key without deferred work (a stage without Linear layers) is a no-op.
        """
        # no_grad: the saved input may require grad; a W op must not build a graph into .grad
        with torch.no_grad():
            for linear, inputs, grad_output in self._pending.pop(key, ()):
                grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
                # under autocast the forward ran in grad_output's dtype: compute W in it too
                inputs_2d = inputs.reshape(-1, inputs.shape[-1]).to(grad_2d.dtype)
                _accumulate_product(linear.weight, grad_2d, inputs_2d)
                if linear.bias is not None:
                    _accumulate(linear.bias, grad_2d.sum(0))

    def pending_keys(self) -> list[tuple[int, int]]:
        """Keys whose W has not run yet (empty after a complete step)."""
        return list(self._pending)

    def clear(self) -> None:
        """Drop every deferred entry (after a failed step)."""
        self._pending.clear()
        self.end()


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``param.grad += grad``, the gradient kept in the parameter's dtype (as autograd does)."""
    if param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad.add_(grad)


def _accumulate_product(param: torch.Tensor, grad_2d: torch.Tensor, inputs_2d: torch.Tensor) -> None:
    """``param.grad += grad_2d^T @ inputs_2d`` as one GEMM (no temporary weight-sized gradient).

    Under autocast the product is computed in the activations' dtype (bf16, say) and converted to
    the parameter's dtype, like autograd's backward of autocast's cast.
    """
    if param.grad is None:
        param.grad = grad_2d.t().mm(inputs_2d).to(param.dtype)
    elif param.grad.dtype == grad_2d.dtype:
        param.grad.addmm_(grad_2d.t(), inputs_2d)
    else:
        param.grad.add_(grad_2d.t().mm(inputs_2d))


class DeferredLinear(torch.autograd.Function):
    """``F.linear`` whose backward defers the weight gradient to the stage's store."""

    @staticmethod
    def forward(ctx, inputs, weight, bias, linear, store):
        ctx.save_for_backward(inputs, weight)
        ctx.linear = linear
        ctx.store = store
        ctx.has_bias = bias is not None
        return torch.nn.functional.linear(inputs, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        inputs, weight = ctx.saved_tensors
        # under autocast the forward computed in grad_output's dtype (bf16/fp16): so does the backward
        grad_input = grad_output.matmul(weight.to(grad_output.dtype)) if ctx.needs_input_grad[0] else None
        if ctx.store.deferring:
            ctx.store.put(ctx.linear, inputs, grad_output)
            return grad_input, None, None, None, None
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        inputs_2d = inputs.reshape(-1, inputs.shape[-1]).to(grad_2d.dtype)
        grad_weight = grad_2d.t().mm(inputs_2d) if ctx.needs_input_grad[1] else None
        grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias, None, None


def install_deferral(modules: Iterable[nn.Module], store: WeightGradStore) -> list[nn.Linear]:
    """Route the forward of every ``nn.Linear`` under ``modules`` through :class:`DeferredLinear`.

    Only the instance's ``forward`` attribute changes: the module keeps its type, parameters and
    state_dict names.  Returns the Linear modules changed, for :func:`remove_deferral`.
    """
    linears = [m for module in modules for m in module.modules() if isinstance(m, nn.Linear)]
    for linear in linears:
        # an instance attribute shadows the class's forward: type and state_dict names stay the same
        linear.forward = types.MethodType(_deferred_forward(store), linear)  # type: ignore[method-assign]
    return linears


def remove_deferral(linears: Iterable[nn.Linear]) -> None:
    """Undo :func:`install_deferral`: the modules use their class's forward again."""
    for linear in linears:
        linear.__dict__.pop("forward", None)


def _deferred_forward(store: WeightGradStore):
    def forward(linear: nn.Linear, inputs: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or not linear.weight.requires_grad:
            return torch.nn.functional.linear(inputs, linear.weight, linear.bias)
        return DeferredLinear.apply(inputs, linear.weight, linear.bias, linear, store)

    return forward
