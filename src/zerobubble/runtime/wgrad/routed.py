"""The closed-form split of calls on leaf weights inside generically split modules.

A module that owns a parameter and calls ``F.linear(x, self.weight, bias)`` in its own forward
(``nn.MultiheadAttention``, a tied LM head ``F.linear(h, embed.weight)``, a fused QKV layer) takes
the generic split, which costs a second autograd-engine run in W.  While such a module's forward
runs, a :class:`LinearRouter` (a ``TorchFunctionMode``) sends every ``F.linear`` call whose weight
is a leaf tensor requiring grad — a parameter of this module or of any other — to a closed form:
B computes the input gradient, and the weight (and bias) gradient is queued for W with
:class:`~.rules.MatmulRule`'s math, one GEMM into ``.grad``.  Products ``x @ w`` (``torch.matmul``,
``x.matmul(w)``) with a 2-D leaf weight on the right — a projection written on raw weights — go the
same way with transformers' ``Conv1D`` math (the weight stored in × out); so do ``x + b`` and
``x * s`` with a leaf ``b`` or ``s`` and an activation ``x`` (a bias added to a product, a scale),
and — in forwards on the stage's graph (below) — ``F.layer_norm`` and ``F.group_norm`` on leaf
weights, whose kernel computes every gradient in B as ``nn.LayerNorm``'s fast path does.
``F.rms_norm`` / ``torch.rms_norm`` with a leaf weight runs as torch's composite computes it, the
normalised input times the weight, and that product is routed as a scale; ``F.linear(x, w[e])`` on
one matrix of a 3-D leaf (an expert's) too (:class:`_ExpertSliceRule`).  A module whose parameters
all go through routed calls has no leaves for the generic split's walk: after its first forward it
runs on the stage's graph, with no local graph (:class:`.generic.ModuleSplit`).

``torch.nn.functional``'s own Python functions that call ``linear`` (``multi_head_attention_forward``
and its helpers) check for torch-function modes first and would hide their ``linear`` calls from
the mode; the router runs private copies of them whose ``linear`` is the router's
(:func:`_functional_with_linear`), outside the mode, so their other ops pay nothing for it.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .rules import MatmulRule, autocast_cast
from .store import (
    WeightCapture,
    WeightGradStore,
    accumulate,
    accumulate_aliases,
    accumulate_each,
    computing_node,
    top_saved_tensor_hooks,
)

_LINEAR = torch._C._nn.linear  # what F.linear is, and what a mode sees for it
# ``x @ w`` and ``x.matmul(w)`` reach a mode as the method, ``torch.matmul(x, w)`` as the function
_MATMULS = frozenset((torch.matmul, torch._C.TensorBase.matmul))
_ADDS = frozenset((torch.add, torch._C.TensorBase.add))  # also ``a + b``, as the method
_MULS = frozenset((torch.mul, torch._C.TensorBase.mul))  # also ``a * b``
_RMS_NORMS = frozenset((F.rms_norm, torch.rms_norm))
_WIDE_FLOATS = frozenset((torch.float32, torch.float64))  # where rms_norm's composite is norm × weight
_NORMS = frozenset((F.layer_norm, F.group_norm))
"""Functions whose one kernel computes every parameter gradient with the input's (their weight and
bias: the arguments after the first two); routed in forwards on the stage's graph only."""
_GETITEM = torch._C.TensorBase.__getitem__  # ``w[e]``, as a mode sees it
_TRANSPOSE = torch._C.TensorBase.transpose  # ``w.transpose(-2, -1)``
_GROUPED_MM = getattr(torch, "_grouped_mm", None)  # what F.grouped_mm calls (a mode sees this)
_PLAIN_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))  # not a DTensor or another subclass
_LINEAR_RULE = MatmulRule(weight_is_out_by_in=True)  # stateless: the math of nn.Linear's fast path
_PROJECTION_RULE = MatmulRule(weight_is_out_by_in=False)  # ``x @ w``: the math of transformers' Conv1D


class _ExpertSliceRule(MatmulRule):
    """``F.linear(x, leaf[e])`` for one expert's [out, in] matrix of a 3-D leaf: the weight target is
    ``(leaf, e)``, and W adds ``grad_output^T @ x`` into ``leaf.grad[e]`` — a gradient of zeros first,
    as autograd's select backward scatters into one (the experts no token reached keep zeros)."""

    def __init__(self) -> None:
        super().__init__(weight_is_out_by_in=True)

    def accumulate_into(self, weight: Any, bias: Any, saved: Any, grad_output: Any, needed: Any) -> None:
        leaf, index = weight
        x = saved[0]
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        x_2d = x.reshape(-1, x.shape[-1])
        if leaf.grad is None:
            leaf.grad = torch.zeros_like(leaf, memory_format=torch.contiguous_format)
        rows = leaf.grad[index]
        if rows.dtype == grad_2d.dtype == x_2d.dtype:
            rows.addmm_(grad_2d.t(), x_2d)
        else:
            rows.add_(grad_2d.t().mm(x_2d).to(rows.dtype))


_EXPERT_SLICE_RULE = _ExpertSliceRule()


def _grouped_weight_grad(
    leaf: torch.Tensor, transposed: bool, offs: torch.Tensor, saved: Any, grad_output: Any, needed: Any
) -> None:
    """W of ``torch._grouped_mm(x, w, offs)`` with ``w`` a 3-D leaf (``transposed``: ``leaf``'s
    ``transpose(-2, -1)``): each group's ``x^T @ grad`` as one grouped product, in the leaf's layout;
    bit for bit what autograd's backward of the product gives (float32 and bfloat16 on CPU)."""
    x = saved[0].detach()
    assert _GROUPED_MM is not None
    if transposed:  # leaf (E, out, in): grad_output^T (out, S) by x (S, in), grouped along S
        grad = _GROUPED_MM(grad_output.t(), x, offs=offs)
    else:  # leaf (E, in, out): x^T (in, S) by grad_output (S, out)
        grad = _GROUPED_MM(x.t(), grad_output, offs=offs)
    accumulate(leaf, grad)


def _one_index(index: Any) -> bool:
    """An index selecting one matrix of a 3-D tensor: an int or a 0-d integer tensor."""
    if isinstance(index, int) and not isinstance(index, bool):
        return True
    return isinstance(index, torch.Tensor) and index.dim() == 0 and not index.is_floating_point()


def _accumulate_grad_type() -> type:
    """The class of autograd's leaf nodes (``AccumulateGrad``), which torch does not export."""
    view = torch.empty(0, requires_grad=True).view(0)
    assert view.grad_fn is not None
    return type(view.grad_fn.next_functions[0][0])


_ACCUMULATE_GRAD = _accumulate_grad_type()


class LinearSplit(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` or ``x @ weight`` whose backward computes ``x``'s gradient and
    defers the rest: a routed call whose input needs no gradient (the anchor makes B reach it) or
    whose tensors are saved through saved-tensor hooks (checkpointing, offloading).  Other routed
    calls take autograd's own node (:class:`LinearRouter`).

    Inputs: ``x``, the *anchor* (a tensor B reaches, so that B runs this node even when ``x``
    needs no gradient), the (possibly autocast-cast) weight and bias, detached — no parameter is an
    input of the node, so B runs no parameter hook — and ``(store, weight leaf, bias leaf or None,
    rule)``, the rule of ``F.linear`` (weight out × in) or of ``x @ weight`` (in × out).  A
    deferring backward (``store.deferring``) queues the weight work for W; a fused backward adds the
    gradients into ``.grad`` at once.  If W's engine run over a local graph passes this node again
    (``x`` depends on other leaves), only ``x``'s gradient is computed: the weight work is queued.
    """

    @staticmethod
    def forward(ctx, x, anchor, weight, bias, targets):
        ctx.save_for_backward(x, weight)
        ctx.targets = targets
        ctx.queued = False
        out = targets[3].forward(None, x, (weight,) if bias is None else (weight, bias))[0]
        return out.detach() if out._is_view() else out  # no view: an in-place op on it stays allowed

    @staticmethod
    def backward(ctx, grad_output):
        saved = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0] and _wanted(ctx):
            grad_x = ctx.targets[3].input_grad(None, saved, grad_output)
        if not ctx.queued:
            store, weight, bias, rule = ctx.targets
            needed = _NEEDED[bias is not None]
            if store.deferring:
                ctx.queued = True
                store.put(partial(rule.accumulate_into, weight, bias, saved, grad_output, needed))
            else:
                rule.accumulate_into(weight, bias, saved, grad_output, needed)
        return grad_x, None, None, None, None


_NEEDED = ((True,), (True, True))  # the parameters a routed call adds into: (weight,) or (weight, bias)


def _shift_grad(leaf: torch.Tensor, saved: Any, grad_output: torch.Tensor, needed: Any) -> None:
    """W of ``other + leaf``: the output gradient summed to the leaf's shape."""
    grad = grad_output.sum_to_size(leaf.shape)
    # no reduction returns the engine's own tensor, which other nodes were handed as well
    accumulate(leaf, grad.clone() if grad is grad_output else grad)


def _scale_grad(leaf: torch.Tensor, saved: Any, grad_output: torch.Tensor, needed: Any) -> None:
    """W of ``other * leaf``: ``grad_output * other`` summed to the leaf's shape."""
    accumulate(leaf, (grad_output * saved[0]).sum_to_size(leaf.shape))


def _alias_positions(
    node: Any, aliases: dict[int, torch.Tensor], params: list[torch.Tensor]
) -> list[tuple[int, torch.Tensor]] | None:
    """``(edge index, parameter)`` for each edge of ``node`` into an alias, or None if some alias
    is not an input of ``node`` itself."""
    by_alias = {id(aliases[id(p)]): p for p in params}
    positions = []
    for index, (next_node, _) in enumerate(() if node is None else node.next_functions):
        variable = getattr(next_node, "variable", None)
        if variable is not None and id(variable) in by_alias:
            positions.append((index, by_alias[id(variable)]))
    found = {id(p) for _, p in positions}
    return positions if len(found) == len(params) else None


class _NormGrads:
    """Post-hook of a routed norm's node: its parameter gradients to W (at once in a fused backward);
    the aliases receive none."""

    __slots__ = ("positions", "store")

    def __init__(self, store: WeightGradStore, positions: list[tuple[int, torch.Tensor]]):
        self.store, self.positions = store, positions

    def __call__(self, grad_inputs: Sequence[torch.Tensor | None], grad_outputs: Any) -> tuple[Any, ...]:
        params = [param for _, param in self.positions]
        grads = [grad_inputs[index] for index, _ in self.positions]
        store = self.store
        if store.deferring:
            store.put(partial(accumulate_each, params, grads))
        else:
            accumulate_each(params, grads)
        kept = list(grad_inputs)
        for index, _ in self.positions:
            kept[index] = None
        return tuple(kept)


def _wanted(ctx: Any) -> bool:
    """Whether this engine run needs ``x``'s gradient (not when ``x`` only leads to W's leaves in B)."""
    node = ctx.next_functions[0][0]
    if node is None:
        return False
    # the engine cannot say for a leaf's node while it runs with ``inputs``: assume it is wanted
    return type(node) is _ACCUMULATE_GRAD or torch._C._will_engine_execute_node(node)


class LinearRouter(TorchFunctionMode):
    """Routes ``F.linear`` on leaf weights to their closed-form split while a module's forward runs.

    One router per installation (it holds the copies of ``torch.nn.functional`` functions);
    :meth:`begin` and :meth:`end` bracket one module's forward (the outermost generic module:
    nested ones run inside it).  Every torch call of that forward passes through
    :meth:`__torch_function__` (about 1.2 µs more per call on CPU; ``docs/wgrad.md``).

    A routed call whose input requires grad, outside saved-tensor hooks, runs as autograd's own
    node on the detached weight (it computes the input gradient only) with a pre-hook that hands W
    its work, as ``nn.Linear``'s fast path does; other routed calls run as :class:`LinearSplit`.
    """

    def __init__(self, store: WeightGradStore):
        super().__init__()
        self.store = store
        self.local_ids: set[int] = set()
        self.anchor: torch.Tensor | None = None
        self.direct = False
        self.routed = False
        self.aliases: list[torch.Tensor] = []  # the routed norms' per-call aliases: leaves of no module
        # id(view) -> (view, leaf, index) for ``leaf[index]`` of a 3-D leaf taken in this forward (the
        # view is held, so its id is not reused while the forward runs)
        self.slices: dict[int, tuple[torch.Tensor, torch.Tensor, Any]] = {}
        # id(view) -> (view, leaf) for ``leaf.transpose(-2, -1)`` of a 3-D leaf (a grouped product's weight)
        self.transposes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.copies = _functional_with_linear(self.linear)

    def begin(self, inputs: list[torch.Tensor], direct: bool = False) -> None:
        """Start a module's forward whose inputs requiring grad are ``inputs`` (never routed as
        weights).  ``direct``: the forward builds on the stage's graph, not a local graph (the
        anchor is then the store's keeper, which the stage's B reaches)."""
        self.local_ids = {id(each) for each in inputs}
        self.anchor = None
        self.direct = direct
        self.routed = False
        self.aliases = []
        self.slices, self.transposes = {}, {}

    def end(self) -> tuple[torch.Tensor | None, bool]:
        """Finish the forward: its anchor (None if no :class:`LinearSplit` needed one) and whether
        any call was routed."""
        anchor, routed = self.anchor, self.routed
        self.anchor, self.local_ids, self.routed, self.aliases = None, set(), False, []
        self.slices, self.transposes = {}, {}
        return anchor, routed

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        # every torch call of the forward passes here: kept to a few comparisons
        if func is _LINEAR:
            return self.linear(*args, **kwargs) if kwargs else self.linear(*args)
        if func in _MATMULS and not kwargs:
            return self.matmul(*args)
        if (func in _ADDS or func in _MULS) and len(args) == 2 and not kwargs:
            return self.elementwise(func, *args)
        if func in _NORMS and self.direct:
            return self.norm(func, args, kwargs or {})
        if func in _RMS_NORMS:
            return self.rms_norm(*args, **kwargs) if kwargs else self.rms_norm(*args)
        if func is _GETITEM and len(args) == 2:
            return self.getitem(*args)
        if func is _TRANSPOSE and len(args) == 3 and not kwargs:
            return self.transpose(*args)
        if func is _GROUPED_MM:
            return self.grouped_mm(args, kwargs or {})
        if type(func) is types.FunctionType:  # a Python function: one of F's calling linear?
            func = self.copies.get(func, func)
        # the mode is off while this runs (torch pops it for the handler): its ops cost nothing extra
        return func(*args, **kwargs) if kwargs else func(*args)

    def getitem(self, tensor: Any, index: Any) -> Any:
        """``tensor[index]``; one matrix of a 3-D leaf is remembered, for :meth:`linear` to route.

        Only a plain tensor or Parameter without gradient hooks: W adds into rows of its gradient,
        where autograd would hand the hooks the whole gradient at once."""
        out = tensor[index]
        if (
            type(tensor) in _PLAIN_TENSORS
            and tensor.dim() == 3
            and _one_index(index)
            and self._plain_leaf(tensor)
        ):
            self.slices[id(out)] = (out, tensor, index)
        return out

    def transpose(self, tensor: Any, first: Any, second: Any) -> Any:
        """``tensor.transpose(first, second)``; the last two dimensions of a 3-D leaf are remembered,
        for :meth:`grouped_mm` to route (only a plain tensor without gradient hooks, as :meth:`getitem`)."""
        out = tensor.transpose(first, second)
        if (
            type(tensor) in _PLAIN_TENSORS
            and tensor.dim() == 3
            and isinstance(first, int)
            and isinstance(second, int)
            and {first % 3, second % 3} == {1, 2}
            and self._plain_leaf(tensor)
        ):
            self.transposes[id(out)] = (out, tensor)
        return out

    def grouped_mm(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """``torch._grouped_mm(x, w, offs=...)`` (``F.grouped_mm``, transformers' grouped experts) with
        ``w`` a 3-D leaf or its :meth:`transpose`: autograd's own node on the detached weight computes
        ``x``'s gradient in B, and W the weight's (:func:`_grouped_weight_grad`).  Anything else — a
        bias, an output dtype, an input needing no gradient, saved-tensor hooks, autocast — runs as
        it is (the generic split's local graph then defers its weight)."""
        assert _GROUPED_MM is not None
        target = self._grouped_target(args[1] if len(args) > 1 else kwargs.get("mat_b"))
        x = args[0] if args else kwargs.get("mat_a")
        offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
        # F.grouped_mm passes bias=None and out_dtype=None: only those are plain
        plain = len(args) <= 3 and all(value is None for key, value in kwargs.items() if key != "offs")
        if not (
            target is not None
            and plain
            and isinstance(offs, torch.Tensor)
            and isinstance(x, torch.Tensor)
            and x.dim() == 2
            and x.requires_grad
            and torch.is_grad_enabled()
            and top_saved_tensor_hooks(False) is None
            and not torch._C._is_any_autocast_enabled()
        ):
            return _GROUPED_MM(*args, **kwargs)
        self.routed = True
        weight, leaf, transposed = target
        out = _GROUPED_MM(x, weight.detach(), offs=offs)
        work = partial(_grouped_weight_grad, leaf, transposed, offs)
        computing_node(out).register_prehook(WeightCapture(self.store, work, (x,), _NEEDED[0]))
        return out

    def _grouped_target(self, weight: Any) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
        """``(weight, its leaf, transposed)`` when a grouped product's weight is a 3-D leaf or its
        remembered transpose; else None."""
        if not isinstance(weight, torch.Tensor):
            return None
        remembered = self.transposes.get(id(weight))
        if remembered is not None and remembered[0] is weight:
            return weight, remembered[1], True
        if type(weight) in _PLAIN_TENSORS and weight.dim() == 3 and self._plain_leaf(weight):
            return weight, weight, False
        return None

    def _plain_leaf(self, tensor: torch.Tensor) -> bool:
        """An owned leaf (:meth:`_owned_leaf`) without gradient hooks: W may add into its gradient
        in parts, where autograd would hand the hooks the whole gradient at once."""
        return (
            self._owned_leaf(tensor) and not tensor._backward_hooks and not tensor._post_accumulate_grad_hooks
        )

    def linear(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Any:
        """``F.linear``, through :class:`LinearSplit` when ``weight`` is a leaf requiring grad or one
        expert's matrix of a 3-D leaf (:meth:`getitem`)."""
        sliced = self.slices.get(id(weight))
        if sliced is not None and sliced[0] is weight and torch.is_grad_enabled():
            # a bias (none in transformers' experts) stays on autograd's graph, added after
            target = (sliced[1], sliced[2])
            return self._split(input, weight, None, bias, (self.store, target, None, _EXPERT_SLICE_RULE))
        if not (self._owned_leaf(weight) and torch.is_grad_enabled()):
            return _LINEAR(input, weight, bias)
        added = None
        if bias is not None and bias.requires_grad and not self._owned_leaf(bias):
            # computed from other tensors (or the caller's): added after the routed product, its
            # gradient flows through the local graph as usual
            bias, added = None, bias
        kept_bias = bias if bias is not None and bias.requires_grad else None
        return self._split(input, weight, bias, added, (self.store, weight, kept_bias, _LINEAR_RULE))

    def matmul(self, input: Any, other: Any) -> Any:
        """``input @ other``, through :class:`LinearSplit` when ``other`` is a 2-D leaf requiring
        grad and ``input`` has two dimensions or more (a projection written as ``x @ weight``)."""
        if not (
            isinstance(input, torch.Tensor)
            and isinstance(other, torch.Tensor)
            and other.dim() == 2
            and input.dim() >= 2
            and input.shape[-1] == other.shape[0]  # else torch.matmul says what is wrong
            and self._owned_leaf(other)
            and torch.is_grad_enabled()
        ):
            return torch.matmul(input, other)
        return self._split(input, other, None, None, (self.store, other, None, _PROJECTION_RULE))

    def elementwise(self, func: Callable[..., Any], a: Any, b: Any) -> Any:
        """``a + b`` or ``a * b`` with one side a leaf requiring grad and the other a tensor requiring
        grad that is not such a leaf (a bias, a scale on an activation): autograd's own node on the
        detached leaf and a pre-hook queueing the leaf's gradient (the output gradient, times the
        other side for a product, summed over the broadcast dimensions).  Anything else runs as it is."""
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return func(a, b)
        if not (a.is_floating_point() and b.is_floating_point()):
            return func(a, b)  # a complex side: autograd takes a real leaf's part of the gradient
        if self._owned_leaf(b) and a.requires_grad and not self._owned_leaf(a):
            leaf, other = b, a
            out = func(a, b.detach())
        elif self._owned_leaf(a) and b.requires_grad and not self._owned_leaf(b):
            leaf, other = a, b
            out = func(a.detach(), b)
        else:
            return func(a, b)
        if out.grad_fn is None:  # grad mode off
            return out
        self.routed = True
        product = func in _MULS
        work = partial(_scale_grad if product else _shift_grad, leaf)
        out.grad_fn.register_prehook(WeightCapture(self.store, work, (other,) if product else (), _NEEDED[0]))
        return out

    def rms_norm(self, input: Any, normalized_shape: Any, weight: Any = None, eps: Any = None) -> Any:
        """``F.rms_norm`` (or ``torch.rms_norm``) on a float32/64 input with a leaf weight of its
        dtype requiring grad, as torch's own composite computes it (bit for bit):
        the normalised input (in its dtype) times the weight, that product routed as a scale
        (:meth:`elementwise`), so W computes the weight's gradient in local graphs and on the
        stage's graph alike (``nn.RMSNorm``'s fast path computes the same way)."""
        if not (
            isinstance(input, torch.Tensor)
            and isinstance(weight, torch.Tensor)
            # lower precision: torch computes in float32, times the weight, then casts back
            and input.dtype == weight.dtype in _WIDE_FLOATS
            and self._owned_leaf(weight)
            and torch.is_grad_enabled()
        ):
            return torch.rms_norm(input, normalized_shape, weight, eps)
        return self.elementwise(torch.mul, torch.rms_norm(input, normalized_shape, None, eps), weight)

    def norm(self, func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        """``F.layer_norm`` or ``F.group_norm`` whose weight or bias is a leaf requiring grad, on
        per-call aliases of them (as ``nn.LayerNorm``'s fast path): the kernel computes every
        gradient in B, a post-hook takes the parameters' out of its results and queues them."""
        given = (*args[2:4], None, None)  # weight and bias, when passed by position
        weight, bias = kwargs.get("weight", given[0]), kwargs.get("bias", given[1])
        params = [t for t in (weight, bias) if isinstance(t, torch.Tensor) and self._owned_leaf(t)]
        if not params or not torch.is_grad_enabled():
            return func(*args, **kwargs)
        aliases = {id(t): t.detach().requires_grad_() for t in params}

        def swap(item: Any) -> Any:  # a routed parameter's alias, anything else as it is
            return aliases.get(id(item), item) if isinstance(item, torch.Tensor) else item

        out = func(*map(swap, args), **{key: swap(item) for key, item in kwargs.items()})
        positions = _alias_positions(out.grad_fn, aliases, params)
        if positions is None:  # not one node taking the aliases (autocast cast them): as it is
            return func(*args, **kwargs)
        self.routed = True
        self.aliases.extend(aliases.values())
        # in an executor's forward autograd accumulates the aliases' gradients, W adds them (as the
        # norms' fast paths); a direct call takes them out of the node's results with a post-hook
        own = [param for _, param in positions]
        if not self.store.after_backward(partial(accumulate_aliases, own, [aliases[id(p)] for p in own])):
            out.grad_fn.register_hook(_NormGrads(self.store, positions))
        return out

    def _split(
        self,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        added: torch.Tensor | None,
        targets: tuple[Any, ...],
    ) -> torch.Tensor:
        """The routed call (autocast: on tensors cast as autocast would, then without it; B and W
        compute in the cast dtype, W adds into ``.grad`` in the parameter's dtype); ``added`` (a
        bias that is no leaf) is added after the product."""
        self.routed = True
        weight = weight.detach()  # the parameters' gradients reach .grad by W's own code
        bias = None if bias is None else bias.detach()
        device = input.device.type
        if torch._C._is_any_autocast_enabled() and torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            input, weight = autocast_cast(input, dtype), autocast_cast(weight, dtype)
            bias = None if bias is None else autocast_cast(bias, dtype)
            added = None if added is None else autocast_cast(added, dtype)
            with torch.autocast(device, enabled=False):
                out = self._product(input, weight, bias, targets)
        else:
            out = self._product(input, weight, bias, targets)
        return out if added is None else out + added

    def _product(
        self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: tuple[Any, ...]
    ) -> torch.Tensor:
        store, weight_leaf, bias_leaf, rule = targets
        params = (weight,) if bias is None else (weight, bias)
        if input.requires_grad and top_saved_tensor_hooks(False) is None:
            # autograd's own node: no Python in B but the pre-hook (the reference W keeps to the
            # input would bypass saved-tensor hooks, hence LinearSplit under them)
            out, saved = rule.forward(None, input, params)
            work = partial(rule.accumulate_into, weight_leaf, bias_leaf)
            computing_node(out).register_prehook(
                WeightCapture(store, work, saved, _NEEDED[bias_leaf is not None])
            )
            return out
        anchor = self.anchor
        if anchor is None:
            # the stage's B reaches the store's keeper; a local graph's B asks for its own anchor
            if self.direct:
                anchor = self.store.keeper(input.device)
            else:
                anchor = torch.empty(0, device=input.device, requires_grad=True)
            self.anchor = anchor
        return LinearSplit.apply(input, anchor, weight, bias, targets)

    def _owned_leaf(self, tensor: torch.Tensor) -> bool:
        """A leaf requiring grad that is not one of the module's arguments (their copies are leaves
        too, but their gradients belong to B)."""
        return tensor.requires_grad and tensor.grad_fn is None and id(tensor) not in self.local_ids


def _functional_with_linear(linear: Callable[..., Any]) -> dict[Callable[..., Any], Callable[..., Any]]:
    """``{F function: its copy}`` for every Python function of ``torch.nn.functional`` that reaches
    ``linear``; the copies share a private namespace where ``linear`` is ``linear`` and each other
    copied function is its copy (so ``multi_head_attention_forward``'s helpers route too)."""
    namespace = F.__dict__
    functions = {
        name: value
        for name, value in namespace.items()
        if type(value) is types.FunctionType and value.__globals__ is namespace
    }
    reaching = {"linear"}
    changed = True
    while changed:  # names reaching linear through other F functions, to a fixed point
        changed = False
        for name, function in functions.items():
            if name not in reaching and not reaching.isdisjoint(_names(function.__code__)):
                reaching.add(name)
                changed = True
    private = dict(namespace)
    private["linear"] = linear
    copies: dict[Callable[..., Any], Callable[..., Any]] = {}
    for name in reaching - {"linear"}:
        original = functions[name]
        copy = types.FunctionType(
            original.__code__, private, original.__name__, original.__defaults__, original.__closure__
        )
        copy.__kwdefaults__ = original.__kwdefaults__
        private[name] = copies[original] = copy
    return copies


def _names(code: types.CodeType) -> Iterable[str]:
    """Global names ``code`` and the functions nested in it refer to."""
    yield from code.co_names
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _names(constant)
