"""Where the generic split's W starts when the module's parameters sit behind expensive nodes.

The W op of a local graph (:mod:`.generic`) runs autograd from the module's outputs to its
parameters.  Every node on the way that B also ran is run a second time, for its parameter side.
For ``nn.Linear`` that is the ``addmm`` itself (the two masked calls cost about the fused one), but
a module computing ``softmax(x Wq (x Wk)ᵀ) x Wv Wo`` has its attention between its output and
``Wq``: W would run the attention's backward again only to reach ``Wq``.

The *frontier* of a local graph is the set of nodes B runs (they lead to a local input) with an edge
into a part of the graph that leads only to parameters.  A pre-hook on each frontier node keeps the
gradient B hands it; W then starts at those nodes (``GradientEdge`` roots), each asking autograd
only for the parameters behind its own parameter edges, so nothing between the outputs and the
frontier runs twice.  The same walk ``torch.distributed.pipelining`` does on the whole stage graph at
every backward is done here once per call, on the module's small local graph, at forward time.

:func:`find_frontier` returns None, and W keeps starting from the outputs, when that is as cheap
(the only input sides W from the outputs would run again are views') or when starting at the
frontier would count a gradient twice (a parameter reachable from a frontier node both through its
parameter edges and through its input edge: a weight shared inside the module).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd import Variable
from torch.autograd.graph import GradientEdge

run_backward = Variable._execution_engine.run_backward
"""The engine's entry point, without ``torch.autograd``'s Python argument handling: roots, their
gradients, keep graph, create graph, inputs, allow unreachable inputs, accumulate into ``.grad``."""
EDGE_ROOTS = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)
"""Whether the engine takes ``GradientEdge`` roots (torch 2.5 and later); without, W starts from
the outputs."""

VIEWS = frozenset(
    ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "TBackward0", "TransposeBackward0",
     "TransposeBackward1", "PermuteBackward0", "ExpandBackward0", "SqueezeBackward0", "SqueezeBackward1",
     "SqueezeBackward2", "SqueezeBackward3", "SqueezeBackward4", "UnsqueezeBackward0", "AliasBackward0",
     "AsStridedBackward0", "CloneBackward0", "ToCopyBackward0", "SplitBackward0", "SplitBackward1",
     "SplitWithSizesBackward0", "UnbindBackward0", "SliceBackward0", "SelectBackward0")
)  # fmt: skip
"""Nodes whose backward moves data at most: running them twice costs next to nothing."""


class Frontier:
    """W's roots in one local graph: the frontier nodes and the parameters behind each.

    :meth:`arm` before B's engine run makes the pre-hooks keep the gradients B hands each node;
    :meth:`weight_pass` (the W op) runs autograd from each node with them and drops everything.
    """

    __slots__ = ("__weakref__", "armed", "grads", "leaves", "nodes")

    def __init__(self, nodes: list[Any], leaves: list[tuple[torch.Tensor, ...]]):
        self.nodes = nodes
        self.leaves = leaves  # per node: the parameters its parameter edges lead to
        self.grads: list[Sequence[torch.Tensor | None] | None] = [None] * len(nodes)
        self.armed = False
        for index, node in enumerate(nodes):
            node.register_prehook(self._keeper(index))

    def _keeper(self, index: int) -> Callable[[Sequence[torch.Tensor | None]], None]:
        # a weak reference: the node holds the hook, so a strong one would make a cycle keeping the
        # whole local graph (its saved tensors) alive until the garbage collector finds it
        frontier = weakref.ref(self)

        def keep(grad_outputs: Sequence[torch.Tensor | None]) -> None:
            owner = frontier()
            if owner is not None and owner.armed:  # B's run only: a fused backward keeps nothing
                owner.grads[index] = grad_outputs

        return keep

    def arm(self) -> None:
        """Keep the gradients of the next engine run (B's) at the frontier nodes."""
        self.armed = True

    def weight_pass(self) -> None:
        """The W op of this local graph: every frontier node's parameter side, once."""
        self.armed = False
        nodes, grads, leaves = self.nodes, self.grads, self.leaves
        self.nodes, self.grads, self.leaves = [], [], []
        for node, node_grads, node_leaves in zip(nodes, grads, leaves):
            if node_grads is None:  # B never reached the node: a plain backward would not either
                continue
            if len(node_grads) == 1 and node_grads[0] is not None:  # most nodes: one output
                edges: tuple[GradientEdge, ...] = (GradientEdge(node, 0),)
                given = tuple(node_grads)
            else:
                edges = tuple(GradientEdge(node, i) for i, grad in enumerate(node_grads) if grad is not None)
                given = tuple(grad for grad in node_grads if grad is not None)
            # the graph stays until the last run: a node behind two frontier nodes runs in both
            run_backward(edges, given, True, False, node_leaves, True, True)


def find_frontier(
    outputs: list[torch.Tensor],
    inputs: list[torch.Tensor],
    deferred: list[torch.Tensor],
    graph: dict[Any, list[Any]],
) -> Frontier | None:
    """The frontier of a local graph, or None when W should start from the outputs.

    ``inputs`` are the local inputs, ``deferred`` the leaves W computes, ``graph`` the children of
    every node as the walk for the leaves recorded them (:func:`.generic.reachable_leaves`: a leaf
    child is the ``id`` of the leaf tensor; fast-path and routed nodes list their input only).
    Runs at every forward of a module with such a graph, so the loops are written out.
    """
    if not EDGE_ROOTS or not inputs or not deferred:
        return None
    # a leaf's code: bit 0 for a local input, bit i + 1 for deferred[i], nothing for other leaves
    codes = {id(t): 1 for t in inputs}
    codes.update((id(leaf), 2 << i) for i, leaf in enumerate(deferred))
    roots = [out.grad_fn for out in outputs if out.grad_fn is not None]
    reach = _reach(graph, roots, codes)
    if any(reach[root] > 1 and not reach[root] & 1 for root in roots):
        return None  # an output depends on parameters alone: it would need a root of its own
    nodes: list[Any] = []
    leaf_sets: list[int] = []
    worth_it = False
    for node, bits in reach.items():
        if not bits & 1 or bits == 1:  # leads to no local input, or to no deferred leaf
            continue
        parameter_side = mixed_side = 0
        for child in graph[node]:
            child_bits = codes.get(child, 0) if type(child) is int else reach[child]
            if child_bits & 1:
                mixed_side |= child_bits
            else:
                parameter_side |= child_bits
        if parameter_side & mixed_side:
            return None  # a parameter behind both sides: starting here would count it twice
        if parameter_side:
            nodes.append(node)
            leaf_sets.append(parameter_side)
            # W from the outputs would also run this node's input side, to reach parameters below it
            worth_it = worth_it or mixed_side > 1
        elif type(node).__name__ not in VIEWS:
            worth_it = True  # W from the outputs would run this node's backward again
    # every deferred leaf behind some frontier node: not so for a parameter the module returns as
    # it is (no node leads to it), which only W from the outputs reaches
    covered = 0
    for bits in leaf_sets:
        covered |= bits
    if not worth_it or covered != (2 << len(deferred)) - 2:
        return None
    leaves = [tuple(leaf for bit, leaf in enumerate(deferred, 1) if bits >> bit & 1) for bits in leaf_sets]
    return Frontier(nodes, leaves)


def _reach(graph: dict[Any, list[Any]], roots: list[Any], codes: dict[int, int]) -> dict[Any, int]:
    """For every node below ``roots``, the codes of the leaves it leads to, or-ed (``codes``: bit 0
    for a local input, bit ``i + 1`` for ``deferred[i]``).

    Bottom-up over the recorded children (no second walk of autograd's own graph), with an explicit
    stack, so deep graphs do not hit Python's recursion limit: a node is finished once every child is.
    """
    reach: dict[Any, int] = {}
    stack = list(roots)
    while stack:
        node = stack[-1]
        if node in reach:
            stack.pop()
            continue
        bits, pending = 0, False
        for child in graph[node]:
            if type(child) is int:
                bits |= codes.get(child, 0)
            else:
                child_bits = reach.get(child)
                if child_bits is None:
                    stack.append(child)
                    pending = True
                else:
                    bits |= child_bits
        if not pending:
            stack.pop()
            reach[node] = bits
    return reach
