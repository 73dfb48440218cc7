"""Choosing the split of every module of a stage: a fast path, the generic split, or none."""

from __future__ import annotations

import types
from collections.abc import Iterable

from torch import nn

from .fast import FastPlan, fast_forward
from .generic import generic_forward
from .rules import FastPaths, default_fast_paths
from .store import WeightGradStore


class Deferral:
    """What :func:`install_deferral` changed; :meth:`remove` restores the modules' own forwards."""

    def __init__(self) -> None:
        self.fast: list[nn.Module] = []
        self.generic: list[nn.Module] = []
        self.routed: set[int] = set()
        """Ids of generic modules whose forward routed ``F.linear`` calls (filled in as they run)."""
        self.direct: set[int] = set()
        """Ids of generic modules whose next forward runs on the stage's graph, without a local graph
        (every parameter behind routed calls: ``docs/wgrad.md``, "Modules without a local graph")."""

    @property
    def modules(self) -> list[nn.Module]:
        """Every module whose forward was replaced (fast paths first)."""
        return self.fast + self.generic

    def summary(self) -> dict[str, int]:
        """``{"fast Linear": 4, "generic MyLayer": 1, ...}``: how each module type is split.

        A generic module whose forward has routed ``F.linear`` calls on leaf weights to their
        closed-form split counts as ``"generic+linear MyLayer"`` (known once it has run forward).
        """
        counts: dict[str, int] = {}
        for kind, modules in (("fast", self.fast), ("generic", self.generic)):
            for module in modules:
                routed = kind == "generic" and id(module) in self.routed
                key = f"{kind}{'+linear' if routed else ''} {type(module).__name__}"
                counts[key] = counts.get(key, 0) + 1
        return counts

    def remove(self) -> None:
        """Undo the installation: the modules use their class's forward again."""
        for module in self.modules:
            module.__dict__.pop("forward", None)
        self.fast, self.generic = [], []
        self.routed.clear()
        self.direct.clear()


def install_deferral(
    modules: Iterable[nn.Module],
    store: WeightGradStore,
    fast_paths: FastPaths | None = None,
    generic: bool = True,
) -> Deferral:
    """Split the backward of every parameter under ``modules``: B computes input gradients, W the rest.

    A module with a rule in ``fast_paths`` (default: :func:`default_fast_paths`) gets that rule; any
    other module owning parameters gets the generic split, which also covers the parameters of its
    descendants that have no fast path; with ``fast_paths.route_linear`` the ``F.linear`` calls and
    ``x @ w`` products on leaf weights in its forward take a closed form (:mod:`.routed`).  Only
    instance ``forward`` attributes change: types, parameters and state_dict names stay.  Modules
    that already have an instance ``forward`` are left alone (their parameters get their gradients
    in B).

    ``generic=False`` installs the fast paths only; every other module keeps plain autograd.  That
    is what a schedule without W ops (1F1B, GPipe) runs: its fused BW gets the fast paths' cheaper
    accumulation (one ``addmm_`` into ``.grad``), and no module pays for a local graph it would
    never defer.
    """
    paths = default_fast_paths() if fast_paths is None else fast_paths
    deferral = Deferral()
    if not generic:
        fallback = _plain
    elif paths.route_linear:
        fallback = generic_forward(store, deferral.routed, deferral.direct)
    else:
        fallback = generic_forward(store)
    seen: set[int] = set()

    def visit(module: nn.Module, covered: bool) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if "forward" not in module.__dict__:
            rule = paths.rule_for(module)
            if rule is not None and FastPlan.covers(rule, module):
                _set_forward(module, fast_forward(FastPlan(rule, module, store), fallback))
                deferral.fast.append(module)
                return
            if generic and not covered and any(p is not None for p in module._parameters.values()):
                _set_forward(module, fallback)
                deferral.generic.append(module)
                covered = True  # its local graph holds the parameters of its plain descendants
        for child in module.children():
            visit(child, covered)

    modules = list(modules)
    for module in modules:
        visit(module, covered=False)
    store.track(p for module in modules for p in module.parameters())
    return deferral


def remove_deferral(deferral: Deferral) -> None:
    """Undo :func:`install_deferral` (the same as ``deferral.remove()``)."""
    deferral.remove()


def _plain(module: nn.Module, *args, **kwargs):
    """The module's own forward: a fast path's fallback when the generic split is not installed."""
    return type(module).forward(module, *args, **kwargs)


def _set_forward(module: nn.Module, forward) -> None:
    # an instance attribute shadows the class's forward: type and state_dict names stay the same
    module.forward = types.MethodType(forward, module)
