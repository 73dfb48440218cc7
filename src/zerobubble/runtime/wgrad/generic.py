"""The generic split: any module whose parameters have no fast path.

In F the module runs on detached copies of its tensor arguments, so its autograd graph is its own
(the *local graph*), joined to the stage's graph by one :class:`Bridge` node.  In B the bridge asks
autograd for the gradients of the local inputs only: the engine runs only the nodes on paths to the
inputs, and each node computes only the outputs those paths need (the output masks of the aten
backward kernels), so no parameter gradient is computed.  The local graph is kept (retained) and
the W op runs autograd again from the same outputs with the parameters as its only inputs — now
only the nodes on paths to parameters run, each computing only the parameter side.  A kernel both
paths pass through (an ``addmm``, a convolution) thus runs once per side with complementary masks,
which usually costs about what the fused kernel does (not always: see ``docs/wgrad.md``).  Two
exceptions, found by the walk at forward time: parameters that only normalisation kernels use get
their gradients from B's call of the kernel (:class:`Leaves`), and where parameters sit behind
expensive nodes W starts at the *frontier* nodes instead of the outputs (:mod:`.frontier`).

The parameters are found by walking the local graph from the outputs to its leaves (every leaf
that requires grad and is not a local input), so shared parameters, parameters used through
custom autograd functions or owned by child modules all get their gradient; a fast-path child
(:class:`~.fast.SplitFunction` node) defers its own parameters, and the weights the forward routed
to their closed form (:mod:`.routed`) are not collected either.  A module left without such leaves
(norm-only parameters aside) runs its later forwards on the stage's graph (:func:`_direct_forward`).
Under saved-tensor hooks the local graph saves through the outer hooks, once per B (:class:`SavedOnce`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Sequence
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .fast import SplitFunction
from .frontier import VIEWS, find_frontier, run_backward
from .routed import LinearRouter, LinearSplit
from .store import WeightGradStore, accumulate_each, top_saved_tensor_hooks

_DEFERRING_NODES = (SplitFunction._backward_cls, LinearSplit._backward_cls)
_NOT_ROUTING = contextlib.nullcontext()  # stateless and reentrant: one for every call


class LocalGraph:
    """One call's local graph: differentiable outputs, local inputs, leaves that get W gradients."""

    __slots__ = (
        "anchors", "frontier", "hooked", "in_b", "inputs", "keeper", "leaves", "no_grads", "outputs", "store",
        "untouched", "wanted",
    )  # fmt: skip

    def __init__(
        self,
        store: WeightGradStore,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        leaves: Leaves,
        hooked: list[SavedOnce],
        anchor: torch.Tensor | None = None,
    ):
        self.store = store
        self.outputs = outputs
        self.inputs = inputs
        self.leaves = leaves.deferred
        self.in_b = leaves.in_b
        self.hooked = hooked  # what the local graph saved through outer saved-tensor hooks
        self.anchors = () if anchor is None else (anchor,)  # an input of every routed F.linear node
        # the bridge's one extra input when no argument requires grad (a first stage), so that its
        # outputs require grad and B reaches it.  No parameters: an edge to one would run its hooks
        # in B with no gradient, and each edge costs the stage's engine a node task (2 us)
        self.keeper = () if inputs else (anchor if anchor is not None else store.keeper(outputs[0].device),)
        self.untouched = (None,) * len(self.keeper)  # the keeper's gradient
        self.no_grads = (None,) * len(self.inputs) + self.untouched  # B's result when no output has one
        # B asks for the anchor's and the store's keepers' gradients (always None) too: that makes
        # it run every routed node and every fast-path child whose input needs no gradient (an
        # embedding's on integer ids), each of which queues its weight work in B.  Without the
        # keepers B would never reach such a child (no local input is behind it) and W's walk to the
        # leaves would not either: its parameters would silently get no gradient
        self.wanted = (*inputs, *self.in_b, *self.anchors, *store.keepers())
        # where W starts when not at the outputs (.frontier): found once, here, at forward time
        self.frontier = None
        if self.leaves and leaves.graph is not None:
            self.frontier = find_frontier(outputs, inputs, self.leaves, leaves.graph)

    def backward(self, grads: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
        """B (deferring) or BW: gradients of the local inputs, then of the keeper (always None)."""
        # runs once per module and microbatch: what does not change was worked out in __init__
        if self.hooked:
            # unpack in the stage's backward, before the local engine runs (each its own graph
            # task, for which checkpointing would recompute the region again)
            for saved in self.hooked:
                saved.get()
            self.hooked = []
        outputs = self.outputs
        self.outputs = []  # the W closure holds what it needs; the bridge node keeps nothing
        first = grads[0]
        if len(outputs) == 1 and first is not None:
            out_grads = [first]
        else:
            pairs = [(out, grad) for out, grad in zip(outputs, grads) if grad is not None]
            if not pairs:
                return self.no_grads
            outputs, out_grads = [p[0] for p in pairs], [p[1] for p in pairs]
        store = self.store
        if not store.deferring:
            # every leaf at once, fast-path children's parameters included (they are not in leaves)
            run_backward(tuple(outputs), tuple(out_grads), False, False, (), True, True)
            return (*(x.grad for x in self.inputs), *self.untouched)
        input_grads: Sequence[torch.Tensor | None] = ()
        if self.frontier is not None:
            self.frontier.arm()
        if self.wanted:  # keep the graph if the W op walks it again
            keep = bool(self.leaves)
            found = run_backward(tuple(outputs), tuple(out_grads), keep, False, self.wanted, True, False)
            count = len(self.inputs)
            input_grads = found[:count]
            if self.in_b:  # the norm kernels' parameter gradients, computed with the input's
                # the engine ran the parameters' register_hook hooks when it returned them
                store.put(partial(accumulate_each, self.in_b, found[count : count + len(self.in_b)], True))
        if self.frontier is not None:
            store.put(self.frontier.weight_pass)
        elif self.leaves:
            self.store.shared(WeightPass).add(outputs, out_grads, self.leaves, self.in_b)
        return (*input_grads, *self.untouched)

    def bridge(self, outer: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The outputs joined to the stage's graph, through a :class:`Bridge` whose inputs are the
        module's arguments ``outer`` (those requiring grad) or, when there are none, the keeper."""
        return Bridge.apply(self, *outer, *self.keeper)


class SavedOnce:
    """A tensor the local graph saved through outer saved-tensor hooks: unpacked once, then kept.

    The local graph's nodes hold these (via the wrapping hooks :func:`_local_hooks` installs); the
    tensor lives until the graph is freed, by W.
    """

    __slots__ = ("packed", "tensor", "unpack")

    def __init__(self, packed: Any, unpack: Callable[[Any], torch.Tensor]):
        self.packed: Any = packed
        self.unpack: Callable[[Any], torch.Tensor] | None = unpack
        self.tensor: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        """The tensor: the outer unpack hook runs on the first call only."""
        if self.unpack is not None:
            self.tensor = self.unpack(self.packed)
            self.packed = self.unpack = None
        assert self.tensor is not None
        return self.tensor


def _local_hooks(outer: tuple[Callable[..., Any], Callable[..., Any]], saved: list[SavedOnce]):
    """Saved-tensor hooks for a local graph built under the ``outer`` (pack, unpack) hooks."""
    outer_pack, outer_unpack = outer

    def pack(tensor: torch.Tensor) -> SavedOnce:
        item = SavedOnce(outer_pack(tensor), outer_unpack)
        saved.append(item)
        return item

    return torch.autograd.graph.saved_tensors_hooks(pack, SavedOnce.get)


class WeightPass:
    """The generic part of one W op: every local graph of the microbatch in one autograd call.

    Accumulates into the leaves' ``.grad`` and frees the graphs.  One call instead of one per
    layer saves the engine's fixed cost per call, which dominates for small microbatches.
    """

    def __init__(self) -> None:
        self.outputs: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.leaves: dict[int, torch.Tensor] = {}
        self.graphs: list[tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]] = []
        self.in_b: set[int] = set()  # ids of leaves some graph's B computed (norm-only there)

    def add(
        self,
        outputs: list[torch.Tensor],
        grads: list[torch.Tensor],
        leaves: list[torch.Tensor],
        in_b: Sequence[torch.Tensor] = (),
    ) -> None:
        """Queue one local graph's outputs, their gradients, the leaves W computes and those its B
        computed (``in_b``: W must not reach them through this graph again)."""
        self.outputs += outputs
        self.grads += grads
        self.graphs.append((outputs, grads, leaves))
        for leaf in leaves:
            self.leaves.setdefault(id(leaf), leaf)
        self.in_b.update(id(leaf) for leaf in in_b)

    def __call__(self) -> None:
        outputs, grads, leaves, graphs = self.outputs, self.grads, list(self.leaves.values()), self.graphs
        conflict = not self.in_b.isdisjoint(self.leaves)
        self.outputs, self.grads, self.leaves, self.graphs, self.in_b = [], [], {}, [], set()
        if not conflict:
            run_engine(outputs, grads, leaves, keep_graph=False, accumulate=True)
            return
        # a weight one graph's B computed (a norm's) that another graph defers (tied to a bias):
        # one run over every graph would add the first graph's part a second time
        for graph_outputs, graph_grads, graph_leaves in graphs:
            run_engine(graph_outputs, graph_grads, graph_leaves, keep_graph=False, accumulate=True)


def run_engine(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    keep_graph: bool,
    accumulate: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """One autograd engine run: ``torch.autograd.grad`` (or ``backward`` if ``accumulate``) minus
    its Python argument handling, which costs more than a small layer's backward.  The gradients
    come from autograd itself, so they already match their outputs.
    ``inputs`` empty with ``accumulate``: every leaf, as ``backward()`` without ``inputs``.
    """
    return run_backward(tuple(outputs), tuple(grads), keep_graph, False, tuple(inputs), True, accumulate)


class Bridge(torch.autograd.Function):
    """Joins a local graph to the stage's graph; its backward is :meth:`LocalGraph.backward`."""

    @staticmethod
    def forward(ctx, local, *inputs):
        ctx.local = local
        ctx.set_materialize_grads(False)
        return tuple(out.detach() for out in local.outputs)

    @staticmethod
    def backward(ctx, *grads):
        local, ctx.local = ctx.local, None
        return (None, *local.backward(grads))


class PathChanges:
    """Counts the path changes of a stage's generic modules (:class:`ModuleSplit`): the split
    guard checks each count once (:meth:`~.install.Deferral.version`)."""

    __slots__ = ("changes",)

    def __init__(self) -> None:
        self.changes = 0


class ModuleSplit:
    """The generic split of one module: the forward installed on it and the path it takes now.

    Also the fallback of a fast path (keyword calls, autocast for some rules).  With a ``router``,
    ``F.linear`` calls, products, biases, scales and norms on leaf weights in the module's forward
    take a closed-form split (:mod:`.routed`); without, every parameter is a leaf of the local graph
    (the generic split alone).  The path moves at most twice, each time counted in ``paths``:

    * a first routed forward that routed no call: not routed again (:attr:`unrouted`) — the mode
      costs every torch call of the forward a Python call (``docs/wgrad.md``), and a later
      ``F.linear`` on a leaf weight is still split exactly, generically;
    * a routed forward that left its local graph without leaves (every parameter behind a routed
      call or a fast-path child: ``nn.MultiheadAttention``): later forwards run on the stage's graph
      (:attr:`direct`, :meth:`_direct_forward`), until one finds a parameter used as it is
      (:attr:`not_direct`; local graphs from then on).
    """

    __slots__ = ("direct", "module", "not_direct", "paths", "routed", "router", "store", "unrouted")

    def __init__(
        self, module: nn.Module, store: WeightGradStore, router: LinearRouter | None, paths: PathChanges
    ) -> None:
        self.module, self.store, self.router, self.paths = module, store, router, paths
        self.routed = False  # a forward routed a call
        self.unrouted = False  # a routed forward routed nothing: routing is off for this module
        self.direct = False  # forwards run on the stage's graph
        self.not_direct = False  # a forward on the stage's graph used a parameter as it is

    @property
    def path(self) -> str:
        """The path in words (:meth:`~.install.Deferral.path_of`)."""
        if self.direct:
            return "generic, routed, on the stage's graph"
        return "generic, routed calls" if self.routed else "generic"

    def _moved(self) -> None:
        self.paths.changes += 1

    def forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """The installed forward (bound to ``module`` as an instance attribute)."""
        original = type(module).forward
        # inside another module's local graph (a fast path falling back under autocast) that
        # graph's walk already collects this module's parameters
        if self.store.in_local_scope or not torch.is_grad_enabled():
            return original(module, *args, **kwargs)
        if self.direct and self.router is not None:
            result, leaf_used = _direct_forward(self.store, self.router, original, module, args, kwargs)
            if leaf_used:  # exact, but computed in B this once: the next calls build local graphs
                self.direct, self.not_direct = False, True
                self._moved()
            return result
        return self._local_forward(module, original, args, kwargs)

    def _local_forward(
        self, module: nn.Module, original: Callable[..., Any], args: tuple, kwargs: dict
    ) -> Any:
        """The module on detached copies of its arguments, joined to the stage's graph by a bridge."""
        flat, spec = _flatten(args, kwargs)
        outer, local_inputs = _local_copies(flat)
        local_args, local_kwargs = _unflatten(flat, spec)
        routing = self.router if not self.unrouted else None
        result, hooked, anchor, routed_any = _run_locally(
            self.store, routing, module, original, local_inputs, local_args, local_kwargs
        )
        if routed_any and not self.routed:
            self.routed = True
            self._moved()
        elif routing is not None and not routed_any:
            self.unrouted = True
            self._moved()
        if isinstance(result, torch.Tensor):  # the common case, without a tree walk
            if not result.requires_grad:
                return result
            positions, outputs = None, [result]
        else:
            out_flat, out_spec = tree_flatten(result)
            positions = [i for i, o in enumerate(out_flat) if isinstance(o, torch.Tensor) and o.requires_grad]
            if not positions:
                return result
            outputs = [out_flat[i] for i in positions]
        leaves = reachable_leaves(outputs, local_inputs)
        # parameters only norm kernels use (in_b) are routed in direct forwards (F.layer_norm, ...)
        if routed_any and not leaves.deferred and not self.not_direct and not self.direct:
            self.direct = True
            self._moved()
        bridged = LocalGraph(self.store, outputs, local_inputs, leaves, hooked, anchor).bridge(outer)
        if positions is None:
            return bridged[0]
        for position, tensor in zip(positions, bridged):
            out_flat[position] = tensor
        return tree_unflatten(out_flat, out_spec)


def _local_copies(flat: list[Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Replace each tensor requiring grad in ``flat`` by a detached leaf copy (one per tensor:
    ``mha(x, x, x)`` still sees ``query is key``); returns the originals and their copies."""
    outer, local_inputs = [], []
    copies: dict[int, torch.Tensor] = {}
    for index, item in enumerate(flat):
        if isinstance(item, torch.Tensor) and item.requires_grad:
            copy = copies.get(id(item))
            if copy is None:
                copy = copies[id(item)] = item.detach().requires_grad_()
                outer.append(item)
                local_inputs.append(copy)
            flat[index] = copy
    return outer, local_inputs


def _run_locally(
    store: WeightGradStore,
    routing: LinearRouter | None,
    module: nn.Module,
    original: Callable[..., Any],
    local_inputs: list[torch.Tensor],
    args: tuple,
    kwargs: dict,
) -> tuple[Any, list[SavedOnce], torch.Tensor | None, bool]:
    """The module's own forward on its local inputs, routed if ``routing``, under the outer
    saved-tensor hooks (wrapped, see :class:`LocalGraph`): the result, what was saved through the
    hooks, the routed calls' anchor and whether any call was routed."""
    hooks = top_saved_tensor_hooks(False)
    hooked: list[SavedOnce] = []
    if routing is not None:
        routing.begin(local_inputs)
    anchor, routed_any = None, False
    try:
        with store.local_scope(), routing or _NOT_ROUTING:
            if hooks is None:
                result = original(module, *args, **kwargs)
            else:  # checkpointing, offloading: save through them, unpack once (see LocalGraph)
                with _local_hooks(hooks, hooked):
                    result = original(module, *args, **kwargs)
    except RuntimeError as error:
        if local_inputs and _IN_PLACE_ON_LEAF in str(error):
            raise _argument_changed_in_place(module, error) from error
        raise
    finally:
        if routing is not None:
            anchor, routed_any = routing.end()
    return result, hooked, anchor, routed_any


_IN_PLACE_ON_LEAF = "leaf Variable that requires grad is being used in an in-place operation"
"""The start of autograd's error for an in-place op on a leaf requiring grad (or a view of one)."""


def _argument_changed_in_place(module: nn.Module, error: RuntimeError) -> RuntimeError:
    """What to say when a generically split module changes a tensor argument in place."""
    return RuntimeError(
        f"{type(module).__name__}.forward changed a leaf tensor requiring grad in place. Split "
        "generically (docs/wgrad.md), a module runs on detached copies of its tensor arguments, "
        "which are such leaves, so an in-place op on an argument (x.mul_(...), x += ..., "
        "F.relu(x, inplace=True)) fails here although a plain backward allows it: use the "
        "out-of-place op (x = x * y), or register a fast path for the module (FastPaths.register). "
        f"(A parameter changed in place fails in a plain backward too.) Autograd said: {error}"
    )


def _direct_forward(
    store: WeightGradStore,
    router: LinearRouter,
    original: Callable[..., Any],
    module: nn.Module,
    args: tuple,
    kwargs: dict,
) -> tuple[Any, bool]:
    """A routed forward on the stage's own graph, for a module no local graph is needed for.

    Its routed calls defer their weights themselves and its fast-path children theirs, so the local
    graph would only make B pay a bridge node and a nested engine run (``docs/wgrad.md``).  Returns
    the result and whether it uses a parameter other than through those (a data-dependent branch):
    the stage's B then computes that gradient (exact, not deferred).
    """
    flat, _ = _flatten(args, kwargs)
    inputs = [item for item in flat if isinstance(item, torch.Tensor) and item.requires_grad]
    router.begin(inputs, direct=True)
    try:
        # as in a local graph: nested generic modules and norms run plainly
        with store.local_scope(), router:
            result = original(module, *args, **kwargs)
    finally:
        aliases = router.aliases
        router.end()
    outputs = [result] if isinstance(result, torch.Tensor) else tree_flatten(result)[0]
    outputs = [out for out in outputs if isinstance(out, torch.Tensor) and out.requires_grad]
    # the walk down to the module's inputs, not beyond: the rest of the stage's graph is not its own
    stops = {t.grad_fn for t in inputs if t.grad_fn is not None}
    leaves = reachable_leaves(outputs, [*inputs, *aliases, *store.keepers()], stops)
    return result, bool(leaves.deferred or leaves.in_b)


def _flatten(args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
    """The call's arguments as a flat list; plain positional calls skip the (slower) tree walk."""
    if not kwargs and not any(isinstance(a, (tuple, list, dict)) for a in args):
        return list(args), None
    return tree_flatten((args, kwargs))


def _unflatten(flat: list[Any], spec: Any) -> tuple[tuple, dict]:
    return (tuple(flat), {}) if spec is None else tree_unflatten(flat, spec)


_NORM_NODES = frozenset(
    ("NativeBatchNormBackward0", "CudnnBatchNormBackward0", "MiopenBatchNormBackward0",
     "NativeLayerNormBackward0", "NativeGroupNormBackward0")
)  # fmt: skip
"""Autograd nodes of normalisation kernels: their parameter gradients are reductions the input
gradient computes anyway (batch norm) or shares most work with (layer and group norm), so one
kernel call computing every gradient costs less than two masked calls (``docs/wgrad.md``)."""


class Leaves(NamedTuple):
    """The leaves of a local graph, by the pass that computes their gradients."""

    deferred: list[torch.Tensor]
    """W computes these, from the local graph's outputs or its frontier (:mod:`.frontier`)."""
    in_b: list[torch.Tensor]
    """Parameters only normalisation kernels use: B's call of the kernel computes their gradients."""
    graph: dict[Any, list[Any]] | None
    """The children of every node the walk passed (a leaf child as its tensor's ``id``), kept when
    the graph has two nodes or more that are no views: only then may W start somewhere other than
    at the outputs (:mod:`.frontier`); one ``addmm``, one norm or one convolution is the frontier
    itself."""


def reachable_leaves(
    outputs: list[torch.Tensor], exclude: list[torch.Tensor], stops: Collection[Any] = ()
) -> Leaves:
    """Leaf tensors requiring grad that ``outputs`` depend on, other than ``exclude``, not looking
    behind the nodes ``stops`` (a module's inputs when it runs on the stage's graph).

    The parameter edges of a fast-path node and of a routed ``F.linear`` node are not followed:
    that node defers its own parameters.  A leaf every edge of which comes from a normalisation
    kernel (:data:`_NORM_NODES`) goes to ``in_b``.
    """
    excluded = {id(t) for t in exclude}
    leaves: dict[int, torch.Tensor] = {}
    only_norms: dict[int, bool] = {}  # id of a leaf: every edge into it came from a norm kernel
    graph: dict[Any, list[Any]] = {}  # node: its children, as the frontier's walk reads them
    heavy = 0  # nodes that are no views
    stack = []
    for out in outputs:
        if out.grad_fn is not None:
            if out.grad_fn not in stops:
                stack.append(out.grad_fn)
        elif id(out) not in excluded:  # a leaf returned as it is
            leaves.setdefault(id(out), out)
            only_norms[id(out)] = False
    while stack:
        node = stack.pop()
        if node in graph:
            continue
        children: list[Any] = []
        graph[node] = children
        edges = node.next_functions
        if isinstance(node, _DEFERRING_NODES):
            edges = edges[:1]  # only the input; its parameters are deferred by the node itself
        name = type(node).__name__
        norm = name in _NORM_NODES
        heavy += name not in VIEWS
        for next_node, _ in edges:
            if next_node is None:
                continue
            variable = getattr(next_node, "variable", None)
            if variable is None:
                if next_node not in stops:
                    stack.append(next_node)
                    children.append(next_node)
                continue
            children.append(id(variable))  # an AccumulateGrad node: a leaf, where the walk ends
            if id(variable) not in excluded:
                leaves.setdefault(id(variable), variable)
                only_norms[id(variable)] = only_norms.get(id(variable), True) and norm
    deferred = [leaf for key, leaf in leaves.items() if not only_norms[key]]
    in_b = [leaf for key, leaf in leaves.items() if only_norms[key]]
    return Leaves(deferred, in_b, graph if heavy > 1 else None)
