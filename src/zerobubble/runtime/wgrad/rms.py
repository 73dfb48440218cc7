"""The RMS norm fast path: ``nn.RMSNorm`` and transformers' ``*RMSNorm`` classes, each in its own precision.

The three differ in where they round.  torch (``torch.rms_norm``'s composite) normalises in the
input's opmath dtype (float32 for 16-bit inputs, else the input's own), multiplies by the weight and
casts the product back; transformers' Llama, Mistral, Qwen2, Qwen3 and Phi-3 normalise in float32
whatever the input (a float64 model too), cast the normalised input back, then multiply by the
weight; Gemma and Gemma 2 normalise in float32, multiply by ``1 + weight`` in float32 and cast the
product back.  :class:`RMSNormRule` computes each forward as its module does, and B and W as plain
autograd differentiates it: the same ops, in the same dtypes, in the same order, so the split's
gradients are bit for bit autograd's (``docs/wgrad.md``, "Fast paths").
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .rules import SplitRule

VARIANTS = ("torch", "llama", "gemma")
"""How an RMS norm rounds: ``"torch"`` — ``(x̂ · w).to(dtype)``, x̂ in the opmath dtype;
``"llama"`` — ``w · x̂.to(dtype)``, x̂ in float32; ``"gemma"`` — ``(x̂ · (1 + w.float())).to(dtype)``,
x̂ in float32."""


class RMSNormRule(SplitRule):
    """RMS norm with a weight: ``nn.RMSNorm``, and the ``*RMSNorm`` classes of transformers models.

    ``variant`` (one of :data:`VARIANTS`) says in which dtypes the module computes; B and W follow
    plain autograd's graph of that forward op for op (the normalised input's two paths to the input,
    ``rsqrt``'s, ``mean``'s and ``pow``'s backward formulas, each cast where the forward casts), so
    they are exact in float32, float64 and bfloat16 alike.  ``eps_attribute`` names the module's
    epsilon (``"eps"`` for torch and Gemma, ``"variance_epsilon"`` for the others), ``last_dims`` how
    many trailing dimensions are normalised (None: ``module.normalized_shape``'s length).
    """

    def __init__(self, eps_attribute: str = "eps", last_dims: int | None = None, variant: str = "torch"):
        if variant not in VARIANTS:
            raise ValueError(f"variant {variant!r}: use one of {', '.join(VARIANTS)}")
        self.eps_attribute = eps_attribute
        self.last_dims = last_dims
        self.variant = variant

    def param_names(self, module):
        return ("weight",)

    def _dims(self, module: nn.Module) -> tuple[int, ...]:
        count = self.last_dims if self.last_dims is not None else len(module.normalized_shape)  # type: ignore[arg-type]
        return tuple(range(-count, 0))

    def _compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        """torch's opmath dtype (float32 for 16-bit inputs, else the input's); float32 for transformers."""
        if self.variant == "torch" and x.dtype in (torch.float32, torch.float64):
            return x.dtype
        return torch.float32

    def _scale(self, weight: torch.Tensor) -> torch.Tensor:
        """What the normalised input is multiplied by before the cast (torch, Gemma)."""
        return weight.float() + 1.0 if self.variant == "gemma" else weight

    def forward(self, module, x, params):
        compute = self._compute_dtype(x)
        eps = getattr(module, self.eps_attribute)
        if eps is None:  # torch's default: the machine epsilon of the dtype it computes in
            eps = torch.finfo(compute).eps
        h = x.to(compute)
        rstd = torch.rsqrt(h.pow(2).mean(self._dims(module), keepdim=True) + eps)
        normalized = h * rstd
        if self.variant == "llama":
            normalized = normalized.to(x.dtype)
            return params[0] * normalized, (x, rstd, normalized, params[0])
        return (normalized * self._scale(params[0])).to(x.dtype), (x, rstd, normalized, params[0])

    def input_grad(self, module, saved, grad_output):
        x, rstd, normalized, weight = saved
        assert x is not None and rstd is not None and normalized is not None and weight is not None
        h = x.to(rstd.dtype)
        if self.variant == "llama":  # w · x̂.to(dtype): mul's gradient, cast to x̂'s dtype, then to float32
            grad_normalized = (grad_output * weight).to(normalized.dtype).to(h.dtype)
        else:  # (x̂ · s).to(dtype): the cast's gradient, mul's, cast to x̂'s dtype
            scale = self._scale(weight)
            product = torch.promote_types(normalized.dtype, scale.dtype)
            grad_normalized = (grad_output.to(product) * scale).to(h.dtype)
        return _rms_input_grad(h, rstd, grad_normalized, self._dims(module)).to(x.dtype)

    def weight_grads(self, module, saved, grad_output, needed):
        if not needed[0]:
            return [None]
        normalized, weight = saved[2], saved[3]
        assert normalized is not None and weight is not None
        if self.variant == "llama":
            product = grad_output * normalized
        else:
            scale = self._scale(weight)
            grad_product = grad_output.to(torch.promote_types(normalized.dtype, scale.dtype))
            product = grad_product * normalized
        leading = tuple(range(product.dim() - weight.dim()))
        grad = product.sum(leading) if leading else product
        if self.variant != "llama":
            grad = grad.to(self._scale(weight).dtype)  # the gradient of s; Gemma's ``1 +`` passes it on
        return [grad.to(weight.dtype)]


def _rms_input_grad(
    h: torch.Tensor, rstd: torch.Tensor, grad_normalized: torch.Tensor, dims: tuple[int, ...]
) -> torch.Tensor:
    """The gradient of ``h`` through ``h * rsqrt(h.pow(2).mean(dims, keepdim=True) + eps)``, computed
    as autograd's nodes do: ``mul``'s two paths, ``rsqrt``'s ``-0.5 · grad · result³``, ``mean``'s
    ``grad / n`` and ``pow``'s ``grad · (2 · h)``, the two contributions to ``h`` added last."""
    size = math.prod(h.shape[d] for d in dims)
    grad_rstd = (grad_normalized * h).sum(dims, keepdim=True)
    grad_variance = grad_rstd * -0.5 * rstd.pow(3)
    grad_square = grad_variance / size
    return grad_normalized * rstd + grad_square * (2.0 * h)
