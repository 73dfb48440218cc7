"""Fast paths: closed-form B/W splits for common layer types, and the registry that picks them.

A :class:`SplitRule` says how one module type computes its forward, the gradient of its input (the
B op) and the gradients of its own parameters (the W op), using the same aten kernels plain autograd
would call — each backward kernel once, with an output mask for the part it computes.  Rules take
one input tensor and return one output tensor; everything else goes through the generic split
(:mod:`.generic`).  See ``docs/wgrad.md`` for how to write and register one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .store import accumulate, accumulate_product

Tensors = tuple[torch.Tensor | None, ...]
_CONVOLUTION_BACKWARD = torch.ops.aten.convolution_backward.default


def autocast_cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` as autocast casts an argument of a lower-precision op: floating point tensors to
    ``dtype``, except float64 ones (autocast leaves those, and integer tensors, as they are)."""
    if tensor.is_floating_point() and tensor.dtype != torch.float64:
        return tensor.to(dtype)
    return tensor


class SplitRule:
    """How one module type splits its backward into B (input gradient) and W (parameter gradients).

    Subclasses implement :meth:`forward`, :meth:`input_grad` and :meth:`weight_grads`; they may
    override :meth:`applies` (configurations the rule does not cover go to the generic split),
    :meth:`param_names` and :meth:`accumulate` (e.g. one GEMM into an existing ``.grad``; add through
    :func:`~.store.accumulate` or :func:`~.store.accumulate_product`, which run the parameter's hooks).

    ``autocast`` says what happens under :func:`torch.autocast`: ``"cast"`` — the op is one autocast
    runs in lower precision (matmul, convolution), so its input and parameters are cast to the
    autocast dtype first; ``"keep"`` — autocast does not touch the op; ``"generic"`` — the module
    uses the generic split while autocast is on (it then follows autocast's own policy exactly).
    """

    autocast = "generic"
    weights_in_b = False
    """True when the parameter gradients are by-products of the input gradient's kernel (batch and
    group norm reduce the same sums for both): B then computes them in the same call and W only
    adds them into ``.grad`` — splitting the kernel would run its reductions twice."""
    native_backward = False
    """True when :meth:`forward` on parameters that do not require grad builds autograd's own nodes
    whose backward is exactly :meth:`input_grad` (with :attr:`weights_in_b`: on alias parameters
    that do, exactly :meth:`all_grads`, in the output's node, whose inputs are ``(x, *params)``).
    B then runs in C++ and a hook on the output's node queues W; without it (the default, e.g.
    for a rule with its own closed forms) B calls :meth:`input_grad` from an autograd function."""

    def applies(self, module: nn.Module) -> bool:
        """Whether this module's configuration is covered (else the generic split handles it)."""
        return True

    def param_names(self, module: nn.Module) -> tuple[str, ...]:
        """Names of the module's own parameters the rule computes gradients for (present ones only)."""
        return tuple(name for name in ("weight", "bias") if getattr(module, name, None) is not None)

    def forward(
        self, module: nn.Module, x: torch.Tensor, params: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, Tensors]:
        """The output, and the tensors B and W need (saved with ``save_for_backward``)."""
        raise NotImplementedError

    def input_grad(self, module: nn.Module, saved: Tensors, grad_output: torch.Tensor) -> torch.Tensor:
        """The gradient of the input (the B op's work)."""
        raise NotImplementedError

    def weight_grads(
        self, module: nn.Module, saved: Tensors, grad_output: torch.Tensor, needed: Sequence[bool]
    ) -> list[torch.Tensor | None]:
        """One gradient per :meth:`param_names` entry (None where not ``needed``): the W op's work."""
        raise NotImplementedError

    def all_grads(
        self,
        module: nn.Module,
        saved: Tensors,
        grad_output: torch.Tensor,
        input_needed: bool,
        needed: Sequence[bool],
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """Input and parameter gradients in one go (used when :attr:`weights_in_b`)."""
        grad_x = self.input_grad(module, saved, grad_output) if input_needed else None
        return grad_x, self.weight_grads(module, saved, grad_output, needed)

    def accumulate(
        self, module: nn.Module, saved: Tensors, grad_output: torch.Tensor, needed: Sequence[bool]
    ) -> None:
        """The deferred W op: add the parameter gradients into ``.grad`` (in the parameter's dtype)."""
        names = self.param_names(module)
        for name, grad in zip(names, self.weight_grads(module, saved, grad_output, needed)):
            if grad is not None:
                accumulate(getattr(module, name), grad)


class MatmulRule(SplitRule):
    """``nn.Linear`` (``x @ W^T + b``) or transformers' ``Conv1D`` (``x @ W + b``, ``transposed=False``)."""

    autocast = "cast"
    native_backward = True

    def __init__(self, weight_is_out_by_in: bool):
        self.out_by_in = weight_is_out_by_in

    def forward(self, module, x, params):
        weight, bias = params[0], params[1] if len(params) > 1 else None
        if self.out_by_in:
            if x.dim() > 2 and not x.is_contiguous():
                # matmul folds such an input into one GEMM (with a copy) only when the weight
                # requires grad; on the detached weight of a native node it would take its batched
                # path, one small GEMM per leading index (4.8 ms against 0.2 for a transposed
                # (64, 2, 256) input of nn.MultiheadAttention): fold it here
                flat = x.reshape(-1, x.shape[-1])
                out = F.linear(flat, weight, bias)
                return out.view(*x.shape[:-1], weight.shape[0]), (flat, weight)
            out = F.linear(x, weight, bias)
        else:  # the computation of transformers.pytorch_utils.Conv1D
            flat = x.reshape(-1, x.shape[-1])
            product = flat.mm(weight) if bias is None else torch.addmm(bias, flat, weight)
            out = product.view(*x.shape[:-1], weight.shape[1])
        return out, (x, weight)

    def input_grad(self, module, saved, grad_output):
        weight = saved[1]
        assert weight is not None
        return grad_output.matmul(weight if self.out_by_in else weight.t())

    def _factors(self, saved: Tensors, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(left, right)`` with ``weight gradient = left @ right``."""
        x = saved[0]
        assert x is not None
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        x_2d = x.reshape(-1, x.shape[-1])
        return (grad_2d.t(), x_2d) if self.out_by_in else (x_2d.t(), grad_2d)

    def weight_grads(self, module, saved, grad_output, needed):
        left, right = self._factors(saved, grad_output)
        grads: list[torch.Tensor | None] = [left.mm(right) if needed[0] else None]
        if len(needed) > 1:
            grads.append(grad_output.reshape(-1, grad_output.shape[-1]).sum(0) if needed[1] else None)
        return grads

    def accumulate(self, module, saved, grad_output, needed):
        own = module._parameters  # fast paths cover modules whose weight and bias are their own
        self.accumulate_into(own["weight"], own.get("bias"), saved, grad_output, needed)

    def accumulate_into(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        saved: Tensors,
        grad_output: torch.Tensor,
        needed: Sequence[bool],
    ) -> None:
        """W: add the gradients into ``weight.grad`` (one GEMM) and ``bias.grad`` where ``needed``.

        Also the W of ``F.linear`` calls routed inside generically split modules (:mod:`.routed`),
        whose weight may belong to any module.
        """
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        if needed[0]:
            x = saved[0]
            assert x is not None
            x_2d = x.reshape(-1, x.shape[-1])
            if self.out_by_in:
                accumulate_product(weight, grad_2d.t(), x_2d)
            else:
                accumulate_product(weight, x_2d.t(), grad_2d)
        if len(needed) > 1 and needed[1]:
            assert bias is not None
            accumulate(bias, grad_2d.sum(0))


class _MaskedRule(SplitRule):
    """A rule whose backward is one aten kernel taking an ``[input, weight, bias]`` output mask."""

    def _backward(self, module, saved, grad_output, mask) -> Sequence[torch.Tensor | None]:
        raise NotImplementedError

    def input_grad(self, module, saved, grad_output):
        return self._backward(module, saved, grad_output, [True, False, False])[0]

    def weight_grads(self, module, saved, grad_output, needed):
        mask = [False, needed[0], len(needed) > 1 and needed[1]]
        return list(self._backward(module, saved, grad_output, mask)[1 : 1 + len(needed)])

    def all_grads(self, module, saved, grad_output, input_needed, needed):
        mask = [input_needed, needed[0], len(needed) > 1 and needed[1]]
        grads = self._backward(module, saved, grad_output, mask)
        return grads[0], list(grads[1 : 1 + len(needed)])


class ConvRule(_MaskedRule):
    """``nn.Conv1d/2d/3d`` with numeric padding and ``padding_mode='zeros'``: ``convolution_backward``."""

    autocast = "cast"
    native_backward = True

    def __init__(self, dims: int):
        self.dims = dims
        self.conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[dims]
        self.output_padding = [0] * dims

    def applies(self, module):
        return module.padding_mode == "zeros" and not isinstance(module.padding, str)

    def forward(self, module, x, params):
        weight, bias = params[0], params[1] if len(params) > 1 else None
        out = self.conv(x, weight, bias, module.stride, module.padding, module.dilation, module.groups)
        return out, (x, weight)

    def _backward(self, module, saved, grad_output, mask):
        x, weight = saved
        unbatched = x.dim() == self.dims + 1
        if unbatched:  # F.conv*d takes one sample without a batch dimension; the kernel does not
            x, grad_output = x.unsqueeze(0), grad_output.unsqueeze(0)
        bias_sizes = [weight.shape[0]] if module._parameters.get("bias") is not None else None
        grads = _CONVOLUTION_BACKWARD(
            grad_output, x, weight, bias_sizes, module.stride, module.padding, module.dilation,
            False, self.output_padding, module.groups, mask,
        )  # fmt: skip
        if unbatched and grads[0] is not None:
            return (grads[0].squeeze(0), *grads[1:])
        return grads


class EmbeddingRule(SplitRule):
    """``nn.Embedding`` (dense, no ``max_norm``): no input gradient; W is ``embedding_dense_backward``."""

    autocast = "keep"

    def applies(self, module):
        return module.max_norm is None and not module.sparse

    def forward(self, module, x, params):
        out = F.embedding(x, params[0], module.padding_idx, None, 2.0, module.scale_grad_by_freq, False)
        return out, (x,)

    def input_grad(self, module, saved, grad_output):
        raise AssertionError("an embedding's input is an index tensor: it has no gradient")

    def weight_grads(self, module, saved, grad_output, needed):
        padding = -1 if module.padding_idx is None else module.padding_idx
        grad = torch.ops.aten.embedding_dense_backward(
            grad_output, saved[0], module.num_embeddings, padding, module.scale_grad_by_freq
        )
        return [grad if needed[0] else None]


class LayerNormRule(_MaskedRule):
    """``nn.LayerNorm`` with an affine part: ``native_layer_norm``; parameter gradients from B's kernel.

    The two masked CPU kernels together cost about 1.2 times the full one (each recomputes the
    normalised input; ``benchmarks/wgrad_overhead.py``) and the parameter gradients are two small
    reductions, so B computes everything (:attr:`SplitRule.weights_in_b`) and W adds them.
    """

    weights_in_b = True
    native_backward = True

    def forward(self, module, x, params):
        weight, bias = params[0], params[1] if len(params) > 1 else None
        out, mean, rstd = torch.native_layer_norm(x, module.normalized_shape, weight, bias, module.eps)
        return out, (x, weight, bias, mean, rstd)

    def _backward(self, module, saved, grad_output, mask):
        x, weight, bias, mean, rstd = saved
        return torch.ops.aten.native_layer_norm_backward(
            grad_output, x, module.normalized_shape, mean, rstd, weight, bias, mask
        )


class GroupNormRule(_MaskedRule):
    """``nn.GroupNorm`` with an affine part: ``native_group_norm``; parameter gradients from B's kernel."""

    weights_in_b = True
    native_backward = True

    def forward(self, module, x, params):
        weight, bias = params[0], params[1] if len(params) > 1 else None
        x = x.contiguous()
        n, c, hxw = x.shape[0], x.shape[1], math.prod(x.shape[2:])
        out, mean, rstd = torch.ops.aten.native_group_norm(
            x, weight, bias, n, c, hxw, module.num_groups, module.eps
        )
        return out, (x, weight, mean, rstd)

    def _backward(self, module, saved, grad_output, mask):
        x, weight, mean, rstd = saved
        assert x is not None
        n, c, hxw = x.shape[0], x.shape[1], math.prod(x.shape[2:])
        return torch.ops.aten.native_group_norm_backward(
            grad_output.contiguous(), x, mean, rstd, weight, n, c, hxw, module.num_groups, mask
        )


class BatchNormRule(_MaskedRule):
    """``nn.BatchNorm1d/2d/3d`` with an affine part: ``native_batch_norm`` and its backward.

    The parameter gradients come out of the input gradient's reductions, so B computes them
    (see :attr:`SplitRule.weights_in_b`) and W adds them.  The forward follows ``nn.BatchNorm``'s
    (running statistics, ``num_batches_tracked``, cumulative average when ``momentum is None``),
    so the running statistics are those the module itself would keep.
    """

    weights_in_b = True
    native_backward = True

    def forward(self, module, x, params):
        weight, bias = params[0], params[1] if len(params) > 1 else None
        module._check_input_dim(x)
        factor = 0.0 if module.momentum is None else module.momentum
        if module.training and module.track_running_stats and module.num_batches_tracked is not None:
            module.num_batches_tracked.add_(1)
            factor = 1.0 / float(module.num_batches_tracked) if module.momentum is None else module.momentum
        train = module.training or (module.running_mean is None and module.running_var is None)
        use_running = not module.training or module.track_running_stats
        running_mean = module.running_mean if use_running else None
        running_var = module.running_var if use_running else None
        out, save_mean, save_invstd = torch.ops.aten.native_batch_norm(
            x, weight, bias, running_mean, running_var, train, factor, module.eps
        )
        # eval mode normalises with the running statistics (unchanged until B and W); training does not
        stats = (None, None) if train else (running_mean, running_var)
        return out, (x, weight, *stats, save_mean, save_invstd)

    def _backward(self, module, saved, grad_output, mask):
        x, weight, running_mean, running_var, save_mean, save_invstd = saved
        train = running_mean is None
        return torch.ops.aten.native_batch_norm_backward(
            grad_output, x, weight, running_mean, running_var, save_mean, save_invstd, train, module.eps, mask
        )


RULE_KINDS: dict[tuple[bool, bool], tuple[str, tuple[tuple[str, ...], ...]]] = {
    # (weights_in_b, native_backward): (how B and W run, the methods one of whose groups it needs)
    (False, False): (
        "B: an autograd function calls input_grad; W: accumulate (default: weight_grads, added)",
        (("forward", "input_grad", "weight_grads"), ("forward", "input_grad", "accumulate")),
    ),
    (False, True): (
        "B: autograd's own node of forward on detached parameters (input gradient only), "
        "input_grad where that cannot run (a first stage, checkpointing); W: as above",
        (("forward", "input_grad", "weight_grads"), ("forward", "input_grad", "accumulate")),
    ),
    (True, False): (
        "B: an autograd function calls all_grads (default: input_grad and weight_grads); W adds",
        (("forward", "all_grads"), ("forward", "input_grad", "weight_grads")),
    ),
    (True, True): (
        "B: autograd's own node of forward on per-call alias parameters computes every gradient, "
        "all_grads where that cannot run (inside a local graph, checkpointing); W adds",
        (("forward", "all_grads"), ("forward", "input_grad", "weight_grads")),
    ),
}
"""The valid :class:`SplitRule` flag combinations: every one of the four is, given its methods
(``docs/wgrad.md``, "Registering a fast path for your own layer")."""

AUTOCAST_POLICIES = ("cast", "keep", "generic")


def check_rule(rule: SplitRule) -> None:
    """Raise ``TypeError`` unless ``rule``'s flags are valid and it implements the methods its
    combination in :data:`RULE_KINDS` runs."""
    name = type(rule).__name__
    if rule.autocast not in AUTOCAST_POLICIES:
        raise TypeError(f"{name}.autocast = {rule.autocast!r}: use one of {', '.join(AUTOCAST_POLICIES)}")
    flags = (rule.weights_in_b, rule.native_backward)
    if not all(isinstance(flag, bool) for flag in flags):
        raise TypeError(f"{name}: weights_in_b and native_backward must be True or False, not {flags}")
    how, groups = RULE_KINDS[flags]
    implemented = {
        method for method in _METHODS if getattr(type(rule), method) is not getattr(SplitRule, method)
    }
    if not any(implemented.issuperset(group) for group in groups):
        wanted = " or ".join("+".join(group) for group in groups)
        raise TypeError(
            f"{name} (weights_in_b={flags[0]}, native_backward={flags[1]}) must implement {wanted}: {how}"
        )


_METHODS = ("forward", "input_grad", "weight_grads", "all_grads", "accumulate")


class FastPaths:
    """Which :class:`SplitRule` each module type uses; :func:`default_fast_paths` holds the built-ins.

    A rule registered for a class applies to its subclasses too, unless a subclass overrides
    ``forward`` (then the generic split handles it).  Classes of optional libraries are registered
    by qualified name (``"transformers.pytorch_utils.Conv1D"``) so nothing is imported for them.
    ``route_linear``: whether ``F.linear`` calls and ``x @ w`` products on leaf weights inside
    generically split modules take the closed form of ``nn.Linear`` and ``Conv1D``, and biases,
    scales and norms on leaf weights theirs (:mod:`.routed`); on in :func:`default_fast_paths`, off
    in an empty registry (the generic split alone).
    """

    def __init__(self, route_linear: bool = False) -> None:
        self._by_type: dict[type, SplitRule] = {}
        self._by_name: dict[str, SplitRule] = {}
        self.route_linear = route_linear

    def register(self, module_type: type[nn.Module] | str, rule: SplitRule) -> None:
        """Use ``rule`` for ``module_type`` (a class, or its ``"module.QualName"``); replaces any rule.

        The rule's flags and methods are checked against :data:`RULE_KINDS` first: a combination
        that cannot run raises ``TypeError`` saying what to implement or change.
        """
        check_rule(rule)
        if isinstance(module_type, str):
            self._by_name[module_type] = rule
        else:
            self._by_type[module_type] = rule

    def rule_for(self, module: nn.Module) -> SplitRule | None:
        """The rule for ``module``, or None (then the generic split or plain autograd handles it)."""
        for cls in type(module).__mro__:
            rule = self._by_type.get(cls) or self._by_name.get(f"{cls.__module__}.{cls.__qualname__}")
            if rule is not None:
                same_forward = type(module).forward is cls.forward  # type: ignore[attr-defined]
                return rule if same_forward and rule.applies(module) else None
        return None

    def copy(self) -> FastPaths:
        """An independent registry with the same rules (to extend without changing this one)."""
        paths = FastPaths(self.route_linear)
        paths._by_type.update(self._by_type)
        paths._by_name.update(self._by_name)
        return paths


_TRANSFORMERS_RMS_NORMS = {
    "llama": [
        ("llama", "Llama"),
        ("mistral", "Mistral"),
        ("qwen2", "Qwen2"),
        ("qwen3", "Qwen3"),
        ("phi3", "Phi3"),
        ("mixtral", "Mixtral"),
        ("qwen2_moe", "Qwen2Moe"),
        ("qwen3_moe", "Qwen3Moe"),
    ],
    "gemma": [("gemma", "Gemma"), ("gemma2", "Gemma2")],
}
"""transformers models by how their ``*RMSNorm`` rounds (:data:`.rms.VARIANTS`): ``"llama"`` computes
``weight * (x·rsqrt(mean(x²)+eps)).to(dtype)`` in float32, ``"gemma"`` ``(x̂ · (1 + weight)).to(dtype)``."""


def default_fast_paths() -> FastPaths:
    """A new registry with the built-in rules (Linear, Conv1D, Conv1d/2d/3d, Embedding, norms, RMS
    norms) and ``F.linear`` calls on leaf weights routed to Linear's closed form."""
    from .rms import RMSNormRule  # it builds on SplitRule, defined here

    paths = FastPaths(route_linear=True)
    builtin: Mapping[type[nn.Module] | str, SplitRule] = {
        nn.Linear: MatmulRule(weight_is_out_by_in=True),
        "transformers.pytorch_utils.Conv1D": MatmulRule(weight_is_out_by_in=False),
        nn.Conv1d: ConvRule(1),
        nn.Conv2d: ConvRule(2),
        nn.Conv3d: ConvRule(3),
        nn.Embedding: EmbeddingRule(),
        nn.LayerNorm: LayerNormRule(),
        nn.GroupNorm: GroupNormRule(),
        nn.BatchNorm1d: BatchNormRule(),
        nn.BatchNorm2d: BatchNormRule(),
        nn.BatchNorm3d: BatchNormRule(),
        nn.RMSNorm: RMSNormRule(),
        **{
            f"transformers.models.{family}.modeling_{family}.{name}RMSNorm": RMSNormRule(
                "variance_epsilon" if variant == "llama" else "eps", 1, variant
            )
            for variant, families in _TRANSFORMERS_RMS_NORMS.items()
            for family, name in families
        },
    }
    for module_type, rule in builtin.items():
        paths.register(module_type, rule)
    return paths
