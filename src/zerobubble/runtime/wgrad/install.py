"""Choosing the split of every module of a stage: a fast path, the generic split, or none."""

from __future__ import annotations

import types
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from .compiled import split_linears, unsplit_linear
from .fast import FastPlan, fast_forward
from .generic import ModuleSplit, PathChanges
from .routed import LinearRouter
from .rules import FastPaths, default_fast_paths
from .store import WeightGradStore


@dataclass
class _Installed:
    """One module whose forward the installation replaced."""

    module: nn.Module
    rule: str | None  # a fast path's rule class name, COMPILED_LINEAR inside a compiled layer; None
    # for the generic split
    split: ModuleSplit | None  # the generic split's state: the module's own, or a fast path's fallback


class Deferral:
    """What :func:`install_deferral` changed; :meth:`remove` restores the modules' own forwards.

    Each installed module's split state lives in its own object (:class:`~.generic.ModuleSplit`,
    held here with the module), so nothing outlives the stage or is keyed by ``id``.
    """

    def __init__(self) -> None:
        self._installed: list[_Installed] = []
        self._paths = PathChanges()
        self.fallen: list[tuple[nn.Module, str]] = []
        """Modules given back their own forward by :meth:`fall_back`, with why."""
        self.compiled: list[nn.Module] = []
        """Modules compiled with ``torch.compile`` (:func:`is_compiled`): their linear layers defer
        their weight gradients from inside the compiled graph (:mod:`.compiled`, where the schedule
        has W ops), everything else in them keeps the compiled fused backward
        (``docs/wgrad.md``, "torch.compile")."""

    @property
    def fast(self) -> list[nn.Module]:
        """The modules split by a fast path, in installation order (the linears inside compiled
        modules are :attr:`compiled_linears`)."""
        return [each.module for each in self._installed if each.rule not in (None, COMPILED_LINEAR)]

    @property
    def compiled_linears(self) -> list[nn.Module]:
        """The linear layers inside compiled modules whose weight gradients W computes."""
        return [each.module for each in self._installed if each.rule == COMPILED_LINEAR]

    @property
    def generic(self) -> list[nn.Module]:
        """The modules split generically, in installation order."""
        return [each.module for each in self._installed if each.rule is None]

    @property
    def direct(self) -> set[int]:
        """Ids of the generic modules whose forwards run on the stage's graph now (no local graph:
        every parameter behind routed calls, ``docs/wgrad.md``, "Modules without a local graph")."""
        return {id(e.module) for e in self._installed if e.rule is None and e.split and e.split.direct}

    @property
    def routed(self) -> set[int]:
        """Ids of the generic modules whose forward routed a call."""
        return {id(e.module) for e in self._installed if e.rule is None and e.split and e.split.routed}

    def version(self) -> tuple[int, int]:
        """Changes whenever a module's split takes another path (a generic module routing, going
        to the stage's graph or back, a fall-back): the split guard checks each version once."""
        return (self._paths.changes, len(self.fallen))

    def path_of(self, module: nn.Module) -> str:
        """How ``module``'s backward is split now, in words (:meth:`paths` lists every module)."""
        if any(fallen is module for fallen, _ in self.fallen):
            return "plain autograd (fallback)"
        if any(compiled is module for compiled in self.compiled):
            inner = {id(m) for m in self.compiled_linears}
            return COMPILED_SPLIT_PATH if any(id(m) in inner for m in module.modules()) else COMPILED_PATH
        for each in self._installed:
            if each.module is module:
                if each.rule == COMPILED_LINEAR:
                    return COMPILED_LINEAR_PATH
                if each.rule is not None:
                    return f"fast path ({each.rule})"
                return each.split.path if each.split is not None else "generic"
        return "not split"

    def paths(self) -> list[tuple[nn.Module, str]]:
        """Every module installed or fallen back, with :meth:`path_of` it."""
        fallen = [module for module, _ in self.fallen]
        modules = self.fast + self.generic + self.compiled_linears + fallen + self.compiled
        return [(module, self.path_of(module)) for module in modules]

    def why_fallen(self, module: nn.Module) -> str | None:
        """Why ``module`` fell back (:meth:`fall_back`), or None if it did not."""
        return next((why for fallen, why in self.fallen if fallen is module), None)

    def fall_back(self, module: nn.Module, why: str) -> None:
        """Give ``module`` its own forward back: plain autograd computes its parameters' gradients
        in the stage's backward (exact; B then does W's share for them)."""
        # only the forward: a compiled linear's weight keeps its store, another linear may share it
        module.__dict__.pop("forward", None)
        self._installed = [each for each in self._installed if each.module is not module]
        self.fallen.append((module, why))

    def add(self, module: nn.Module, rule: str | None, split: ModuleSplit | None) -> None:
        """Record that ``module``'s forward was replaced (by :func:`install_deferral`)."""
        self._installed.append(_Installed(module, rule, split))

    @property
    def path_changes(self) -> PathChanges:
        """The counter every :class:`~.generic.ModuleSplit` of this installation moves."""
        return self._paths

    @property
    def modules(self) -> list[nn.Module]:
        """Every module whose forward was replaced (fast paths first, compiled layers' linears last)."""
        return self.fast + self.generic + self.compiled_linears

    def summary(self) -> dict[str, int]:
        """``{"fast Linear": 4, "generic MyLayer": 1, ...}``: how each module type is split.

        A generic module whose forward has routed ``F.linear`` calls on leaf weights to their
        closed-form split counts as ``"generic+linear MyLayer"`` (known once it has run forward).
        """
        counts: dict[str, int] = {}
        routed_ids = self.routed
        kinds = (("fast", self.fast), ("generic", self.generic), ("compiled+split", self.compiled_linears))
        for kind, modules in kinds:
            for module in modules:
                routed = kind == "generic" and id(module) in routed_ids
                key = f"{kind}{'+linear' if routed else ''} {type(module).__name__}"
                counts[key] = counts.get(key, 0) + 1
        for module in self.compiled:
            key = f"compiled {type(module).__name__}"
            counts[key] = counts.get(key, 0) + 1
        return counts

    def remove(self) -> None:
        """Undo the installation: the modules use their class's forward again."""
        for module in self.modules:
            unsplit_linear(module)
        self._installed = []
        self.fallen = []
        self.compiled = []


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

    A module compiled with ``torch.compile`` (``module.compile()``, :func:`is_compiled`) runs as the
    user compiled it, with none of the split's hooks in the compiled region (``deferral.compiled``).
    With ``generic`` (a schedule with W ops) its linear layers get a forward that dynamo traces
    into the compiled graph and whose backward defers their weight gradients to W
    (:mod:`.compiled`; path :data:`COMPILED_LINEAR_PATH`); its other parameters get their gradients
    from the compiled backward, in B (path :data:`COMPILED_SPLIT_PATH`, or :data:`COMPILED_PATH`
    when nothing in it is split).

    ``generic=False`` installs the fast paths only; every other module keeps plain autograd.  That
    is what a schedule without W ops (1F1B, GPipe) runs: its fused BW gets the fast paths' cheaper
    accumulation (one ``addmm_`` into ``.grad``), and no module pays for a local graph it would
    never defer.
    """
    installation = _Installation(store, default_fast_paths() if fast_paths is None else fast_paths, generic)
    modules = list(modules)
    for module in modules:
        installation.visit(module, covered=False)
    store.track(p for module in modules for p in module.parameters())
    return installation.deferral


class _Installation:
    """One walk of :func:`install_deferral` over a stage's modules, each module visited once."""

    def __init__(self, store: WeightGradStore, paths: FastPaths, generic: bool):
        self.store, self.paths, self.generic = store, paths, generic
        self.deferral = Deferral()
        # one router per installation: it holds the copies of torch.nn.functional's functions
        self.router = LinearRouter(store) if generic and paths.route_linear else None
        self.seen: set[int] = set()

    def visit(self, module: nn.Module, covered: bool) -> None:
        """Split ``module`` and its descendants; ``covered``: an ancestor's local graph already holds
        the parameters of its plain descendants."""
        if id(module) in self.seen:
            return
        self.seen.add(id(module))
        if is_compiled(module):
            self._split_compiled(module, covered)
            return
        if "forward" not in module.__dict__:
            if self._split_fast(module):
                return
            if self._split_generic(module, covered):
                covered = True  # its local graph holds the parameters of its plain descendants
        for child in module.children():
            self.visit(child, covered)

    def _split_of(self, module: nn.Module) -> ModuleSplit | None:
        """A generic split of ``module`` (None under ``generic=False``)."""
        if not self.generic:
            return None
        return ModuleSplit(module, self.store, self.router, self.deferral.path_changes)

    def _split_compiled(self, module: nn.Module, covered: bool) -> None:
        """A compiled module runs as compiled; with W ops its linear layers defer their weights."""
        self.deferral.compiled.append(module)
        if self.generic and not covered:  # else an outer module's local graph holds its parameters
            for linear in split_linears(module, self.store, self.paths):
                self.deferral.add(linear, COMPILED_LINEAR, None)

    def _split_fast(self, module: nn.Module) -> bool:
        """Give ``module`` its fast path, if a rule covers it; whether one did."""
        rule = self.paths.rule_for(module)
        if rule is None or not FastPlan.covers(rule, module):
            return False
        split = self._split_of(module)  # its fallback (keyword calls, autocast for some rules)
        fallback = _plain if split is None else split.forward
        _set_forward(module, fast_forward(FastPlan(rule, module, self.store), fallback))
        self.deferral.add(module, type(rule).__name__, split)
        return True

    def _split_generic(self, module: nn.Module, covered: bool) -> bool:
        """Give ``module`` the generic split if it owns parameters no ancestor covers; whether it did."""
        if not self.generic or covered or not any(p is not None for p in module._parameters.values()):
            return False
        split = self._split_of(module)
        assert split is not None
        _set_forward(module, split.forward)
        self.deferral.add(module, None, split)
        return True


COMPILED_PATH = "compiled: fused backward in B"
"""The path of a compiled module nothing in which is split (a schedule without W ops, no linear
layer): AOTAutograd's one backward node computes the input and the weight gradients in one call."""

COMPILED_SPLIT_PATH = "compiled: linear weights in W, other parameters in B"
"""The path of a compiled module whose linear layers defer their weight gradients (:mod:`.compiled`);
the compiled backward computes the rest in B."""

COMPILED_LINEAR = "compiled linear"
"""The rule name :class:`Deferral` records for a linear layer split inside a compiled module."""

COMPILED_LINEAR_PATH = "compiled: weight gradient in W"
"""The path of a linear layer inside a compiled module: B computes its input gradient in the
compiled backward, W its weight (and bias) gradient (:mod:`.compiled`)."""


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module``'s calls run compiled: ``module.compile()`` sets ``_compiled_call_impl``
    (``nn.Module.__call__`` then calls it instead of ``_call_impl``); the :class:`~..pipeline.Pipeline`
    turns an ``OptimizedModule`` and ``compile=`` into that form (:mod:`..compiled`)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def remove_deferral(deferral: Deferral) -> None:
    """Undo :func:`install_deferral` (the same as ``deferral.remove()``)."""
    deferral.remove()


def _plain(module: nn.Module, *args, **kwargs):
    """The module's own forward: a fast path's fallback when the generic split is not installed."""
    return type(module).forward(module, *args, **kwargs)


def _set_forward(module: nn.Module, forward) -> None:
    # an instance attribute shadows the class's forward: type and state_dict names stay the same
    module.forward = types.MethodType(forward, module)
