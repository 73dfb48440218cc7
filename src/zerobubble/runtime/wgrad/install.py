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
        self.rules: dict[int, str] = {}  # id of a fast module: its rule's class name
        self.routed: set[int] = set()
        """Ids of generic modules whose forward routed ``F.linear`` calls (filled in as they run)."""
        self.direct: set[int] = set()
        """Ids of generic modules whose next forward runs on the stage's graph, without a local graph
        (every parameter behind routed calls: ``docs/wgrad.md``, "Modules without a local graph")."""
        self.not_direct: set[int] = set()
        """Ids of generic modules a forward on the stage's graph found using a parameter as it is."""
        self.unrouted: set[int] = set()
        """Ids of generic modules whose routed forward routed no call (not routed again)."""
        self.fallen: dict[int, tuple[nn.Module, str]] = {}
        """Modules given back their own forward by :meth:`fall_back`: ``id: (module, why)``."""

    def version(self) -> tuple[int, ...]:
        """Changes whenever a module's split takes another path (a generic module routing, going
        to the stage's graph or back, a fall-back): the split guard checks each version once."""
        return (
            len(self.routed),
            len(self.direct),
            len(self.not_direct),
            len(self.unrouted),
            len(self.fallen),
        )

    def path_of(self, module: nn.Module) -> str:
        """How ``module``'s backward is split now, in words (:meth:`paths` lists every module)."""
        key = id(module)
        if key in self.fallen:
            return "plain autograd (fallback)"
        if key in self.rules:
            return f"fast path ({self.rules[key]})"
        if key in self.direct:
            return "generic, routed, on the stage's graph"
        if key in self.routed:
            return "generic, routed calls"
        return "generic"

    def paths(self) -> list[tuple[nn.Module, str]]:
        """Every module installed or fallen back, with :meth:`path_of` it."""
        fallen = [module for module, _ in self.fallen.values()]
        return [(module, self.path_of(module)) for module in self.fast + self.generic + fallen]

    def fall_back(self, module: nn.Module, why: str) -> None:
        """Give ``module`` its own forward back: plain autograd computes its parameters' gradients
        in the stage's backward (exact; B then does W's share for them)."""
        module.__dict__.pop("forward", None)
        self.fast = [m for m in self.fast if m is not module]
        self.generic = [m for m in self.generic if m is not module]
        self.fallen[id(module)] = (module, why)

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
        for ids in (self.routed, self.direct, self.not_direct, self.unrouted):
            ids.clear()
        self.fallen.clear()
        self.rules.clear()


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
    else:
        fallback = generic_forward(store, deferral, route=paths.route_linear)
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
                deferral.rules[id(module)] = type(rule).__name__
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
