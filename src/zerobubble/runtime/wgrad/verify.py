"""The split guard: every stage proves its B/W split against plain autograd on the user's own model.

Before a stage's first training forward — and again whenever the split would take a new path: new
input shapes or dtypes, autocast switched, a generic module moving to the stage's graph, a module
falling back — :class:`SplitGuard` runs the microbatch about to go forward twice, aside from the
step: once with every module's own forward (plain autograd, one ``torch.autograd.grad``) and once
through the split (its forward, B, then W; and a fused BW where the schedule has those), with the
same RNG draws and the same random output gradient.  Parameters, input gradients and outputs must
agree: the same parameters get gradients, within the dtype's tolerance.  Nothing of the check
stays: ``.grad``, buffers (batch-norm statistics), the RNG streams and hooks are as before it, and
no parameter hook runs for it.

On a mismatch the module is never trained wrong: the modules owning the parameters that differ
fall back to their own forward (plain autograd computes their gradients in the stage's backward,
exact), a :class:`SplitMismatchWarning` names module, parameter, path and error, and the check
runs again — widening the fall-back to every generically split module, then to every module, until
the stage agrees with plain autograd.  ``verify="strict"`` raises :class:`SplitMismatchError`
instead.  ``docs/wgrad.md``, "The split guard", says what it costs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ...errors import SplitMismatchError, SplitMismatchWarning
from ..tensors import full_value, is_dtensor
from .install import Deferral
from .store import HeldHooks, WeightGradStore


@dataclass(frozen=True)
class SplitRecord:
    """How one module of a stage splits its backward (:meth:`~zerobubble.Pipeline.split_report`)."""

    stage: int
    module: str
    """The module's name in the layers given to the Pipeline."""
    type: str
    path: str
    """``"fast path (MatmulRule)"``, ``"generic, routed calls"``, ``"plain autograd (fallback)"``, ..."""
    verified: bool
    """Whether the guard has checked the stage since the module took this path."""
    note: str = ""
    """Why a module fell back: the parameter, its error, the path it had."""


_NONE: Mapping[str, Any] = {}  # no keyword arguments

_MAX_ROUNDS = 6  # transitions (local graph -> stage graph -> back) and fall-backs are few and monotone


class SplitGuard:
    """Checks one stage's split against plain autograd, once per path (see the module docstring).

    ``names`` maps module ids to their names in the user's layers; ``deferred``/``fused`` say which
    backward ops the schedule runs on this stage (B then W, a fused BW).
    """

    def __init__(
        self,
        *,
        stage: int,
        module: nn.Module,
        store: WeightGradStore,
        deferral: Deferral,
        names: dict[int, str],
        strict: bool,
        deferred: bool,
        fused: bool,
    ):
        self.stage, self.module, self.store, self.deferral = stage, module, store, deferral
        self.names, self.strict, self.deferred, self.fused = names, strict, deferred, fused
        self.verified: set[tuple[Any, ...]] = set()
        self._versions: set[tuple[int, ...]] = set()  # deferral versions some check has covered
        self._checks = 0

    def signature(self, inputs: Sequence[Any], kwargs: Mapping[str, Any] = _NONE) -> tuple[Any, ...]:
        """What decides the path a forward takes: the split's version, autocast, the inputs and the
        keyword arguments."""
        # runs before every training forward: a few attribute reads
        shapes = tuple(_path_key(x) for x in inputs)
        if kwargs:
            shapes += tuple((key, _path_key(value)) for key, value in kwargs.items())
        return (self.deferral.version(), _autocast_state(), shapes)

    def before_forward(self, inputs: Sequence[Any], kwargs: Mapping[str, Any] = _NONE) -> None:
        """Check the stage on ``inputs`` (and the keyword arguments ``kwargs``, constants of the
        forward) unless this path was checked already (the executor's F)."""
        if self.signature(inputs, kwargs) in self.verified:
            return
        for _ in range(_MAX_ROUNDS):
            signature = self.signature(inputs, kwargs)
            if signature in self.verified:
                return
            if self._check(inputs, kwargs) if kwargs else self._check(inputs):
                self.verified.add(signature)
                self._versions.add(signature[0])
        if self.signature(inputs, kwargs) in self.verified:
            return
        # still moving or still disagreeing after every round: plain autograd is exact by definition
        if self.strict:
            raise SplitMismatchError(
                f"stage {self.stage}: the split did not settle on a checked path within {_MAX_ROUNDS} checks"
            )
        for module in self.deferral.modules:
            self._fall_back(module, f"no agreement with plain autograd within {_MAX_ROUNDS} checks")
        signature = self.signature(inputs, kwargs)
        self.verified.add(signature)
        self._versions.add(signature[0])

    def report(self) -> list[SplitRecord]:
        """One record per split (or fallen-back) module of the stage."""
        current = self.deferral.version() in self._versions
        records = []
        for module, path in self.deferral.paths():
            why = self.deferral.why_fallen(module)
            records.append(
                SplitRecord(
                    stage=self.stage,
                    module=self.names.get(id(module), type(module).__name__),
                    type=type(module).__name__,
                    path=path,
                    verified=current or why is not None,
                    note=why or "",
                )
            )
        return records

    # -- one check -----------------------------------------------------------------------------------

    def _check(self, inputs: Sequence[Any], kwargs: Mapping[str, Any] = _NONE) -> bool:
        """One comparison; on a mismatch a round of fall-backs (or an error).  True if it agreed."""
        self._checks += 1
        params = [p for p in self.store.tracked() if p.requires_grad]
        buffers = [(b, b.clone()) for b in self.module.buffers()]
        seed = 0x5EED + self._checks  # of the random output gradients
        devices = _cuda_devices(inputs)
        held = HeldHooks(self.store.tracked())  # .grad aside, hooks silent, for the whole check
        try:
            # every run starts from the RNG state the real forward will start from (its dropout
            # masks), and the real forward still finds it so afterwards
            with torch.random.fork_rng(devices=devices):
                start = torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]
                expected = self._plain(inputs, params, seed, kwargs)
                runs: list[tuple[bool, _Outcome | Exception]] = []
                for defer in (True, False):
                    if (self.deferred and defer) or (self.fused and not defer):
                        _restore(buffers)
                        _set_rng(start, devices)
                        try:
                            runs.append((defer, self._split(inputs, params, seed, defer, kwargs)))
                        except Exception as error:  # the split failed where plain autograd ran
                            runs.append((defer, error))
        finally:
            _restore(buffers)
            held.release()
        for defer, actual in runs:
            kind = "B then W" if defer else "a fused BW"
            if isinstance(actual, Exception):
                self._mismatch([], kind, f"failed in {kind} where plain autograd ran: {actual!r}", actual)
                return False
            found = _differences(expected, actual, params)
            if found:
                self._mismatch(found, kind, _describe(found, kind, self._name_of))
                return False
        return True

    def _plain(
        self, inputs: Sequence[Any], params: list[torch.Tensor], seed: int, kwargs: Mapping[str, Any] = _NONE
    ) -> _Outcome:
        """The stage with every module's own forward: outputs and gradients of one backward."""
        # the modules' own forwards until the backward is done: checkpointing recomputes in it;
        # compiled modules run eagerly (their graphs were traced through the split's forwards, and
        # eager autograd is the reference a compiled graph must match too)
        forwards = [(m, m.__dict__.pop("forward")) for m in self.deferral.modules if "forward" in m.__dict__]
        compiled = [(m, m._compiled_call_impl) for m in self.deferral.compiled]
        for module, _ in compiled:
            module._compiled_call_impl = None
        try:
            local = _copies(inputs)
            outputs = _differentiable(self.module(*local, **kwargs))
            wanted = [*params, *_needing_grad(local)]
            grads: list[torch.Tensor | None] = [None] * len(wanted)
            if outputs:
                cotangents = _cotangents(outputs, seed)
                grads = list(torch.autograd.grad(outputs, wanted, cotangents, allow_unused=True))
        finally:
            for module, forward in forwards:
                module.forward = forward
            for module, impl in compiled:
                module._compiled_call_impl = impl
        return _Outcome([o.detach() for o in outputs], list(grads[: len(params)]), list(grads[len(params) :]))

    def _split(
        self,
        inputs: Sequence[Any],
        params: list[torch.Tensor],
        seed: int,
        defer: bool,
        kwargs: Mapping[str, Any] = _NONE,
    ) -> _Outcome:
        """The same through the split: its forward, then B and W (``defer``) or a fused BW."""
        key = (self.stage, -self._checks)  # no real microbatch has a negative index
        local = _copies(inputs)
        try:
            with self.store.keyed_forward(key):
                outputs = _differentiable(self.module(*local, **kwargs))
            if outputs:
                self.store.begin(key, defer)
                try:
                    torch.autograd.backward(outputs, _cotangents(outputs, seed))
                finally:
                    self.store.end()
                if defer:
                    self.store.flush(key)
        finally:
            self.store.discard(key)
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        return _Outcome([o.detach() for o in outputs], grads, [x.grad for x in _needing_grad(local)])

    # -- what a mismatch does --------------------------------------------------------------------------

    def _mismatch(
        self,
        found: list[tuple[torch.Tensor | None, str]],
        kind: str,
        what: str,
        error: Exception | None = None,
    ) -> None:
        """Raise (strict), or fall the suspects back, each warned of with its own parameters' errors."""
        if self.strict:
            raise SplitMismatchError(
                f"stage {self.stage}: {what}. Pass verify=True to let the Pipeline fall back to a fused "
                "backward for such modules (exact, slower), or fix or unregister the split rule "
                "(docs/wgrad.md, 'The split guard')"
            ) from error
        culprits = [p for p, _ in found if p is not None]
        suspects = self._owners(culprits) or self._widen()
        for module in suspects:
            own = {id(p) for p in module.parameters()}
            mine: list[tuple[torch.Tensor | None, str]] = [
                (p, t) for p, t in found if p is not None and id(p) in own
            ]
            self._fall_back(module, _describe(mine, kind, self._name_of) if mine else what)

    def _fall_back(self, module: nn.Module, what: str) -> None:
        """Give ``module`` plain autograd back and say so (:class:`SplitMismatchWarning`)."""
        path = self.deferral.path_of(module)
        name = self.names.get(id(module), type(module).__name__)
        self.deferral.fall_back(module, f"{what} (was: {path})")
        warnings.warn(
            f"zerobubble: stage {self.stage}, module {name} ({type(module).__name__}, {path}): {what}; "
            "it now runs a fused backward for its parameters (exact, slower). "
            "pipe.split_report() lists every module's path; docs/wgrad.md, 'The split guard'",
            SplitMismatchWarning,
            stacklevel=3,
        )

    def _owners(self, culprits: list[torch.Tensor]) -> list[nn.Module]:
        """The split modules whose own parameters include a culprit (innermost first)."""
        wanted = {id(p) for p in culprits}
        closed_form = self.deferral.fast + self.deferral.compiled_linears
        fast = {id(p): m for m in closed_form for p in m.parameters(recurse=False)}
        owners = [fast[key] for key in wanted if key in fast]
        rest = wanted - fast.keys()  # a generic module's own, or of its plain descendants
        for module in self.deferral.generic:
            if any(id(p) in rest for p in module.parameters()):
                owners.append(module)
        return list({id(m): m for m in owners}.values())

    def _widen(self) -> list[nn.Module]:
        """No owner found (or fallen back already): every generic module, then every module."""
        return list(self.deferral.generic) or list(self.deferral.modules)

    def _name_of(self, param: torch.Tensor) -> str:
        for name, candidate in self.module.named_parameters(remove_duplicate=False):
            if candidate is param:
                return _layer_name(name, self.names, self.module)
        return "a parameter"


@dataclass
class _Outcome:
    outputs: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    input_grads: list[torch.Tensor | None]


def _path_key(x: Any) -> Any:
    return (x.shape, x.dtype, x.requires_grad) if isinstance(x, torch.Tensor) else type(x)


def _copies(inputs: Sequence[Any]) -> list[Any]:
    """Fresh leaves with the inputs' values and ``requires_grad``: the check's own arguments."""
    return [
        x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
        for x in inputs
    ]


def _needing_grad(inputs: Sequence[Any]) -> list[torch.Tensor]:
    return [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]


def _differentiable(result: Any) -> list[torch.Tensor]:
    flat = [result] if isinstance(result, torch.Tensor) else tree_flatten(result)[0]
    return [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]


def _cotangents(outputs: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """Random output gradients, the same for both runs: a wrong vector-Jacobian product shows on
    almost every random vector."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=generator, dtype=torch.float64).to(o) for o in outputs]


def _set_rng(state: tuple[torch.Tensor, list[torch.Tensor]], devices: list[int]) -> None:
    torch.set_rng_state(state[0])
    for device, device_state in zip(devices, state[1]):
        torch.cuda.set_rng_state(device_state, device)


def _restore(buffers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for buffer, value in buffers:
            buffer.copy_(value)


def _cuda_devices(inputs: Sequence[Any]) -> list[int]:
    return sorted({x.device.index or 0 for x in inputs if isinstance(x, torch.Tensor) and x.is_cuda})


def _tolerance(*tensors: torch.Tensor) -> float:
    """Relative tolerance of a comparison of gradients in these dtypes (the coarsest wins); under
    autocast the products round in 16 bits whatever the parameter's dtype."""
    if _autocast_state() or any(t.dtype in (torch.float16, torch.bfloat16) for t in tensors):
        return 5e-2
    if all(t.dtype == torch.float64 for t in tensors):
        return 1e-7
    return 1e-4


def _autocast_state() -> tuple[Any, ...] | bool:
    """False outside autocast (one flag read, torch's own); else each device type's dtype."""
    if not torch._C._is_any_autocast_enabled():
        return False
    return tuple(
        torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        for device in ("cpu", "cuda")
    )


def _relative(actual: torch.Tensor, expected: torch.Tensor, floor: float) -> float:
    difference = (actual.double() - expected.double()).norm().item()
    return difference / max(expected.double().norm().item(), floor)


def _differences(
    expected: _Outcome, actual: _Outcome, params: list[torch.Tensor]
) -> list[tuple[torch.Tensor | None, str]]:
    """``(parameter or None, what differs)`` for every disagreement."""
    found: list[tuple[torch.Tensor | None, str]] = []
    for param, want, got in zip(params, expected.grads, actual.grads):
        if want is not None and got is not None and _placements(got) != _placements(want):
            placed = f"gets a gradient placed {_placements(got)}, plain autograd's {_placements(want)}"
            found.append((param, placed))
    expected, actual = _full(expected), _full(actual)
    largest = max((g.double().norm().item() for g in expected.grads if g is not None), default=0.0)
    floor = max(1e-4 * largest, 1e-30)  # a gradient zero in exact arithmetic is rounding noise
    for param, want, got in zip(params, expected.grads, actual.grads):
        if (want is None) != (got is None):
            found.append(
                (param, "gets no gradient" if got is None else "gets a gradient plain autograd does not give")
            )
        elif want is not None and got is not None:
            error = _relative(got, want, floor)
            if not error <= _tolerance(want, param):  # also NaN
                found.append((param, f"gets a gradient {error:.1e} relative off plain autograd's"))
    for index, (want, got) in enumerate(zip(expected.input_grads, actual.input_grads)):
        if (want is None) != (got is None) or (
            want is not None and got is not None and not _relative(got, want, 1e-30) <= _tolerance(want)
        ):
            found.append((None, f"input {index}'s gradient differs from plain autograd's"))
    for index, (want, got) in enumerate(zip(expected.outputs, actual.outputs)):
        if want.shape != got.shape or not _relative(got, want, 1e-30) <= _tolerance(want):
            found.append((None, f"output {index} differs from plain autograd's"))
    return found


def _placements(tensor: torch.Tensor) -> Any:
    """A DTensor's placements (tensor parallelism), None for a plain tensor."""
    return tuple(getattr(tensor, "placements", ())) if is_dtensor(tensor) else None


def _full(outcome: _Outcome) -> _Outcome:
    """``outcome`` with every DTensor as its full tensor, so that every rank of its mesh compares the
    same values and takes the same decision (collective over the mesh: its ranks check alike)."""

    def full(tensors: list[Any]) -> list[Any]:
        return [full_value(t) for t in tensors]

    if not any(is_dtensor(t) for part in vars(outcome).values() for t in part):
        return outcome
    return _Outcome(full(outcome.outputs), full(outcome.grads), full(outcome.input_grads))


def _describe(
    found: list[tuple[torch.Tensor | None, str]], kind: str, name_of: Callable[[torch.Tensor], str]
) -> str:
    shown = [f"{name_of(p) if p is not None else 'the stage'} {what}" for p, what in found[:3]]
    more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
    return f"with {kind}, " + "; ".join(shown) + more


def _layer_name(name: str, names: dict[int, str], module: nn.Module) -> str:
    """A parameter's name in the user's layers, from its name inside the stage module."""
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    prefix = names.get(id(owner))
    return f"{prefix}.{attr}" if prefix else name
