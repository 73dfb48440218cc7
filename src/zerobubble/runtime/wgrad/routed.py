"""The closed-form split of ``F.linear`` calls and ``x @ w`` products on leaf weights inside
generically split modules.

A module that owns a parameter and calls ``F.linear(x, self.weight, bias)`` in its own forward
(``nn.MultiheadAttention``, a tied LM head ``F.linear(h, embed.weight)``, a fused QKV layer) takes
the generic split, which costs a second autograd-engine run in W.  While such a module's forward
builds its local graph, a :class:`LinearRouter` (a ``TorchFunctionMode``) sends every
``F.linear`` call whose weight is a leaf tensor requiring grad — a parameter of this module or of
any other — through :class:`LinearSplit`: B computes the input gradient, and the weight (and
bias) gradient is queued for W with :class:`~.rules.MatmulRule`'s math, one GEMM into ``.grad``.
Products ``x @ w`` (``torch.matmul``, ``x.matmul(w)``) with a 2-D leaf weight on the right — a
projection written on raw weights — go the same way with transformers' ``Conv1D`` math (the
weight stored in × out).  The leaf walk of the generic split does not follow these nodes' weight
edges, so a module whose every parameter goes through routed calls has no leaves, and its W runs no
engine at all.

``torch.nn.functional``'s own Python functions that call ``linear`` (``multi_head_attention_forward``
and its helpers) check for torch-function modes first and would hide their ``linear`` calls from
the mode; the router runs private copies of them whose ``linear`` is the router's
(:func:`_functional_with_linear`), outside the mode, so their other ops pay nothing for it.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .rules import MatmulRule
from .store import WeightCapture, WeightGradStore, top_saved_tensor_hooks

_LINEAR = torch._C._nn.linear  # what F.linear is, and what a mode sees for it
# ``x @ w`` and ``x.matmul(w)`` reach a mode as the method, ``torch.matmul(x, w)`` as the function
_MATMULS = frozenset((torch.matmul, torch._C.TensorBase.matmul))
_LINEAR_RULE = MatmulRule(weight_is_out_by_in=True)  # stateless: the math of nn.Linear's fast path
_PROJECTION_RULE = MatmulRule(weight_is_out_by_in=False)  # ``x @ w``: the math of transformers' Conv1D


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
    deferring backward (``store.queue``) queues the weight work for W; a fused backward adds the
    gradients into ``.grad`` at once.  If W's engine run over a local graph passes this node again
    (``x`` depends on other leaves), only ``x``'s gradient is computed: the weight work is queued.
    """

    @staticmethod
    def forward(ctx, x, anchor, weight, bias, targets):
        ctx.save_for_backward(x, weight)
        ctx.targets = targets
        ctx.queued = False
        return targets[3].forward(None, x, (weight,) if bias is None else (weight, bias))[0]

    @staticmethod
    def backward(ctx, grad_output):
        saved = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0] and _wanted(ctx):
            grad_x = ctx.targets[3].input_grad(None, saved, grad_output)
        if not ctx.queued:
            store, weight, bias, rule = ctx.targets
            needed = _NEEDED[bias is not None]
            queue = store.queue
            if queue is not None:
                ctx.queued = True
                queue.append(partial(rule.accumulate_into, weight, bias, saved, grad_output, needed))
            else:
                rule.accumulate_into(weight, bias, saved, grad_output, needed)
        return grad_x, None, None, None, None


_NEEDED = ((True,), (True, True))  # the parameters a routed call adds into: (weight,) or (weight, bias)


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
        self.copies = _functional_with_linear(self.linear)

    def begin(self, inputs: list[torch.Tensor], direct: bool = False) -> None:
        """Start a module's forward whose inputs requiring grad are ``inputs`` (never routed as
        weights).  ``direct``: the forward builds on the stage's graph, not a local graph (the
        anchor is then the store's keeper, which the stage's B reaches)."""
        self.local_ids = {id(each) for each in inputs}
        self.anchor = None
        self.direct = direct
        self.routed = False

    def end(self) -> tuple[torch.Tensor | None, bool]:
        """Finish the forward: its anchor (None if no :class:`LinearSplit` needed one) and whether
        any call was routed."""
        anchor, routed = self.anchor, self.routed
        self.anchor, self.local_ids, self.routed = None, set(), False
        return anchor, routed

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        # every torch call of the forward passes here: kept to a few comparisons
        if func is _LINEAR:
            return self.linear(*args, **kwargs) if kwargs else self.linear(*args)
        if func in _MATMULS and not kwargs:
            return self.matmul(*args)
        if type(func) is types.FunctionType:  # a Python function: one of F's calling linear?
            func = self.copies.get(func, func)
        # the mode is off while this runs (torch pops it for the handler): its ops cost nothing extra
        return func(*args, **kwargs) if kwargs else func(*args)

    def linear(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Any:
        """``F.linear``, through :class:`LinearSplit` when ``weight`` is a leaf requiring grad."""
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
            input = input.to(dtype) if input.is_floating_point() else input
            weight = weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
            added = None if added is None else added.to(dtype)
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
            out.grad_fn.register_prehook(WeightCapture(store, work, saved, _NEEDED[bias_leaf is not None]))
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
