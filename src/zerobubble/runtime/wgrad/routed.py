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
from .store import WeightGradStore

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
    defers the rest.

    Inputs: ``x``, the local graph's *anchor* (a tensor B asks autograd for, so that B runs this
    node even when ``x`` needs no gradient), the (possibly autocast-cast) weight and bias, and
    ``(store, weight leaf, bias leaf or None, rule)`` — the rule of ``F.linear`` (weight out × in)
    or of ``x @ weight`` (in × out).  A deferring backward (``store.queue``) queues the
    weight work for W and returns no weight gradient; a fused backward returns it.  If W's engine
    run over the local graph passes this node again (``x`` depends on other leaves), only ``x``'s
    gradient is computed: the weight work is already queued.
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
        needs = ctx.needs_input_grad
        store, weight, bias, rule = ctx.targets
        grad_x = rule.input_grad(None, saved, grad_output) if needs[0] and _wanted(ctx) else None
        if ctx.queued:
            return grad_x, None, None, None, None
        needed = needs[2:4] if bias is not None else needs[2:3]
        queue = store.queue
        if queue is not None:
            ctx.queued = True
            queue.append(partial(rule.accumulate_into, weight, bias, saved, grad_output, needed))
            return grad_x, None, None, None, None
        grads = rule.weight_grads(None, saved, grad_output, needed)
        return grad_x, None, grads[0], grads[1] if len(grads) > 1 else None, None


def _wanted(ctx: Any) -> bool:
    """Whether this engine run needs ``x``'s gradient (not when ``x`` only leads to W's leaves in B)."""
    node = ctx.next_functions[0][0]
    if node is None:
        return False
    # the engine cannot say for a leaf's node while it runs with ``inputs``: assume it is wanted
    return type(node) is _ACCUMULATE_GRAD or torch._C._will_engine_execute_node(node)


class LinearRouter(TorchFunctionMode):
    """Routes ``F.linear`` on leaf weights to :class:`LinearSplit` while a local graph is built.

    One router per installation (it holds the copies of ``torch.nn.functional`` functions);
    :meth:`begin` and :meth:`end` bracket one module's local forward (the outermost generic module:
    nested ones run inside it).  Every torch call of that forward passes through
    :meth:`__torch_function__` (about 1.2 µs more per call on CPU; ``docs/wgrad.md``).
    """

    def __init__(self, store: WeightGradStore):
        super().__init__()
        self.store = store
        self.local_ids: set[int] = set()
        self.anchor: torch.Tensor | None = None
        self.copies = _functional_with_linear(self.linear)

    def begin(self, local_inputs: list[torch.Tensor]) -> None:
        """Start a local forward whose inputs are ``local_inputs`` (never routed as weights)."""
        self.local_ids = {id(local) for local in local_inputs}
        self.anchor = None

    def end(self) -> torch.Tensor | None:
        """Finish the local forward: its anchor, or None if no call was routed."""
        anchor, self.anchor, self.local_ids = self.anchor, None, set()
        return anchor

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
        """The routed call: :class:`LinearSplit` on the local graph's anchor, under autocast on cast
        tensors; ``added`` (a bias that is no leaf) is added after the product."""
        anchor = self.anchor
        if anchor is None:
            anchor = self.anchor = torch.empty(0, device=input.device, requires_grad=True)
        device = input.device.type
        if torch._C._is_any_autocast_enabled() and torch.is_autocast_enabled(device):
            # as fast_forward does for MatmulRule: cast as autocast would, then run without it;
            # B and W compute in the cast dtype and W adds into .grad in the parameter's dtype
            dtype = torch.get_autocast_dtype(device)
            input = input.to(dtype) if input.is_floating_point() else input
            weight = weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
            added = None if added is None else added.to(dtype)
            with torch.autocast(device, enabled=False):
                out = LinearSplit.apply(input, anchor, weight, bias, targets)
        else:
            out = LinearSplit.apply(input, anchor, weight, bias, targets)
        return out if added is None else out + added

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
