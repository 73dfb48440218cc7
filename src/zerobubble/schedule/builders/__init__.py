"""The registry of schedule builders: one module per family, looked up by name.

Every builder is a function ``build(stages, microbatches, costs, chunks, **options) -> Schedule``
where ``costs`` is a :class:`~zerobubble.schedule.costs.CostModel` whose ``memory_limit`` is already
final.  :func:`build_schedule` is the one entry point: it checks the request, applies the schedule's
memory-limit rule, imports the family's module on first use and validates the result.  The helpers
the families share (the planning core, local improvement, the ILP program, the V planners and
building blocks) are the subpackage :mod:`.planning`, which imports no family.

A schedule defined outside the package joins the registry with :func:`register_schedule` (no edit
of the package): from then on :func:`build_schedule`, the CLI, :func:`~..compare.compare_schedules` and the
model-level planner see it like a built-in one.  Registration is explicit and reversible —
:func:`unregister_schedule`, or the :func:`registered_schedule` context manager that removes it on
exit — so a test or a notebook leaves :data:`REGISTRY` as it found it.  Built-in names can be
neither replaced nor removed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..costs import CostModel
from ..gcpause import collector_paused
from ..ir import Schedule, ScheduleError, check_positive


@dataclass(frozen=True)
class BuilderSpec:
    """How to build one named schedule.

    ``chunks`` is the fixed number of virtual stages per rank, or ``None`` when the user chooses it
    (then ``default_chunks`` applies).  ``memory_limit`` is the limit the schedule plans for when the
    user gives none (``"1p"`` = p·M_B); with ``fixed_memory_limit`` the user cannot change it.
    ``builder`` is the function itself for a schedule registered from outside the package
    (:func:`register_schedule`); built-in specs leave it ``None`` and name ``module`` and ``function``.
    """

    name: str
    summary: str
    module: str
    function: str = "build"
    chunks: int | None = 1
    default_chunks: int = 1
    memory_limit: str | None = None
    fixed_memory_limit: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)
    builder: Callable[..., Schedule] | None = field(default=None, compare=False, repr=False)

    def resolve_chunks(self, chunks: int | None) -> int:
        """The number of chunks per rank this request gets, or a clear error."""
        if chunks is None:
            return self.chunks if self.chunks is not None else self.default_chunks
        check_positive(chunks=chunks)
        if self.chunks is not None and chunks != self.chunks:
            raise ScheduleError(
                f"schedule {self.name!r} runs {self.chunks} chunk(s) per rank; it cannot take chunks={chunks}"
            )
        return chunks

    def resolve_costs(self, costs: CostModel, stages: int) -> CostModel:
        """Apply this schedule's memory-limit rule to the user's costs."""
        if self.fixed_memory_limit or costs.memory_limit is None:
            return costs.apply_memory_limit(self.memory_limit, stages)
        return costs

    def load(self) -> Callable[..., Schedule]:
        """Import the family's module and return the builder function (or the registered function)."""
        if self.builder is not None:
            return self.builder
        module = importlib.import_module(f"{__name__}.{self.module}")
        return getattr(module, self.function)


_SPECS = (
    BuilderSpec("gpipe", "GPipe: all forwards, then all fused backwards", "gpipe"),
    BuilderSpec("1f1b", "1F1B: warm-up forwards, then one forward one fused backward", "one_f_one_b"),
    BuilderSpec(
        "interleaved-1f1b",
        "Megatron interleaved 1F1B over v chunks per rank (loop placement)",
        "interleaved",
        chunks=None,
        default_chunks=2,
    ),
    BuilderSpec("zb-h1", "ZB-H1: 1F1B memory, W fills the cool-down bubbles", "zb_handcrafted", "build_h1"),
    BuilderSpec(
        "zb-h2", "ZB-H2: more warm-up forwards, W fills the rest; (2p-1)·M_B", "zb_handcrafted", "build_h2"
    ),
    BuilderSpec("zb-auto", "automatic zero-bubble scheduler under --memory-limit (paper §3.1)", "zb_auto"),
    BuilderSpec(
        "zb-1p", "zb-auto with memory limit p·M_B", "zb_auto", memory_limit="1p", fixed_memory_limit=True
    ),
    BuilderSpec(
        "zb-2p", "zb-auto with memory limit 2p·M_B", "zb_auto", memory_limit="2p", fixed_memory_limit=True
    ),
    BuilderSpec(
        "zb-v", "ZB-V: V-shape, 2 chunks per rank, searched under p·M_B", "zb_v", chunks=2, memory_limit="1p"
    ),
    BuilderSpec(
        "v-half",
        "V-Half: V-shape with about half of 1F1B's activation memory",
        "v_memory",
        "build_half",
        chunks=2,
    ),
    BuilderSpec(
        "v-min",
        "V-Min: V-shape with about a third of 1F1B's activation memory",
        "v_memory",
        "build_min",
        chunks=2,
    ),
    BuilderSpec(
        "dualpipe-v",
        "DualPipeV: V-shape, overlapped F&B pairs hide the expert all-to-all; m ≥ 2p",
        "dualpipe",
        chunks=2,
    ),
    BuilderSpec(
        "zb-ilp",
        "optimal schedule from the paper's integer program (HiGHS), warm-started by zb-auto",
        "zb_ilp",
        memory_limit="2p",
        options=MappingProxyType({"time_limit": 60.0}),
    ),
)

_BUILT_IN = frozenset(spec.name for spec in _SPECS)
_SPECS_BY_NAME: dict[str, BuilderSpec] = {spec.name: spec for spec in _SPECS}

#: Every schedule by name, built-in ones first: a read-only live view (:func:`register_schedule`
#: and :func:`unregister_schedule` are the only ways to change it).
REGISTRY: Mapping[str, BuilderSpec] = MappingProxyType(_SPECS_BY_NAME)


def register_schedule(
    name: str,
    builder: Callable[..., Schedule],
    summary: str = "",
    *,
    chunks: int | None = 1,
    default_chunks: int = 1,
    memory_limit: str | None = None,
    fixed_memory_limit: bool = False,
    options: Mapping[str, Any] | None = None,
) -> BuilderSpec:
    """Add the schedule ``name`` built by ``builder`` to :data:`REGISTRY`; returns its spec.

    ``builder`` has the builders' signature, ``builder(stages, microbatches, costs, chunks, **options)
    -> Schedule``; ``costs`` arrives with its memory limit already final.  The keywords are those of
    :class:`BuilderSpec` (``chunks=None``: the user chooses, ``default_chunks`` otherwise).  A name
    already registered raises :class:`ScheduleError` (unregister it first); the registration lasts
    until :func:`unregister_schedule` (or the end of :func:`registered_schedule`'s block).
    """
    if not isinstance(name, str) or not name.strip():
        raise ScheduleError(f"a schedule name must be a non-empty string, got {name!r}")
    if name in _SPECS_BY_NAME:
        kind = "a built-in schedule" if name in _BUILT_IN else "already registered"
        raise ScheduleError(
            f"schedule {name!r} is {kind}; choose another name"
            + ("" if name in _BUILT_IN else f" or call unregister_schedule({name!r}) first")
        )
    if not callable(builder):
        raise ScheduleError(f"the builder of schedule {name!r} must be callable, got {builder!r}")
    if chunks is not None:
        check_positive(chunks=chunks)
    check_positive(default_chunks=default_chunks)
    spec = BuilderSpec(
        name,
        summary or (builder.__doc__ or "").strip().split("\n")[0] or name,
        getattr(builder, "__module__", "") or "",
        getattr(builder, "__qualname__", "") or "build",
        chunks=chunks,
        default_chunks=default_chunks,
        memory_limit=memory_limit,
        fixed_memory_limit=fixed_memory_limit,
        options=MappingProxyType(dict(options or {})),
        builder=builder,
    )
    _SPECS_BY_NAME[name] = spec
    return spec


def unregister_schedule(name: str) -> None:
    """Remove a schedule added by :func:`register_schedule` (built-in ones cannot be removed)."""
    if name in _BUILT_IN:
        raise ScheduleError(f"schedule {name!r} is built in; only registered schedules can be removed")
    if name not in _SPECS_BY_NAME:
        raise ScheduleError(f"schedule {name!r} is not registered")
    del _SPECS_BY_NAME[name]


@contextmanager
def registered_schedule(
    name: str, builder: Callable[..., Schedule], summary: str = "", **spec: Any
) -> Iterator[BuilderSpec]:
    """:func:`register_schedule` for the ``with`` block only; the schedule is removed on exit."""
    registered = register_schedule(name, builder, summary, **spec)
    try:
        yield registered
    finally:
        unregister_schedule(name)


def get_spec(name: str) -> BuilderSpec:
    """The spec registered under ``name``, or an error listing the known names."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ScheduleError(f"unknown schedule {name!r}; known schedules: {', '.join(REGISTRY)}") from None


def build_schedule(
    name: str,
    stages: int,
    microbatches: int,
    costs: CostModel | None = None,
    chunks: int | None = None,
    validate: bool = True,
    *,
    polish_seconds: float | None = None,
    vocab_parallel: bool = False,
    **options: Any,
) -> Schedule:
    """Build the schedule ``name`` for ``stages`` ranks and ``microbatches`` microbatches.

    ``costs`` defaults to unit costs; its ``memory_limit`` (absolute, per rank) bounds schedules that
    plan for memory.  With ``polish_seconds`` the built schedule's last ops are then reordered by
    CP-SAT for up to that many seconds, kept only when faster (:func:`~..polish.polish_schedule`;
    needs ``zerobubble[solver]``).  ``vocab_parallel`` places a vocabulary-parallel output layer's S
    and T ops into the built schedule (:func:`~..vocab.add_vocab_ops`, under the ``vocab_*`` costs).
    The result is validated unless ``validate=False``.
    """
    spec = get_spec(name)
    check_positive(stages=stages, microbatches=microbatches)
    v = spec.resolve_chunks(chunks)
    given = costs if costs is not None else CostModel()
    resolved = spec.resolve_costs(given, stages)
    final = resolved
    if vocab_parallel:
        from ..vocab import vocab_budgets

        own_limit = not spec.fixed_memory_limit and given.memory_limit is not None
        resolved, final = vocab_budgets(resolved, stages, budget_given=own_limit)

    def build(under: CostModel) -> Schedule:
        built = spec.load()(stages, microbatches, under, v, **{**spec.options, **options})
        if built.name != name:
            built = Schedule(
                name, built.placement, built.microbatches, built.programs, built.meta, built.overlapped
            )
        if polish_seconds is not None:
            from ..polish import polish_schedule

            built = polish_schedule(built, under, seconds=polish_seconds)
        return built

    with collector_paused():  # the searches allocate much and free nothing cyclic (gcpause.py)
        if vocab_parallel:
            from ..vocab import place_vocab_ops

            schedule = place_vocab_ops(build, resolved, final)
        else:
            schedule = build(resolved)
        if validate:
            from ..validate import validate_schedule

            validate_schedule(schedule, final)
    return schedule
