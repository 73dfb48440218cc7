"""Side-by-side comparison of every registered schedule for one pipeline setup.

:func:`compare_schedules` builds, validates and simulates each schedule under the same costs and
returns one :class:`ComparisonRow` each, best first.  A schedule that cannot be built for the setup
(interleaving with a microbatch count it cannot take, a memory limit it cannot meet) gets a row with
``error`` set instead of numbers, so a comparison never fails as a whole; a setup no schedule can
take (no ranks, no microbatches, a negative step time) is a :class:`ScheduleError` before any row.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from .bounds import lower_bound
from .builders import REGISTRY, build_schedule
from .costs import CostModel, within_limit
from .ir import Schedule, ScheduleError, check_positive
from .polish import check_polish_request
from .simulate import Timeline
from .validate import validate_schedule

__all__ = [
    "OPTIMIZER_MODES",
    "ComparisonRow",
    "compare_schedules",
    "iteration_period",
]

OPTIMIZER_MODES = ("sync", "post-validation")

#: Schedules left out of a comparison and of the planner's search unless asked for by name: zb-ilp
#: takes seconds to minutes; dualpipe-v runs (overlapped F&B pairs) but pays off only by hiding an
#: expert all-to-all, which a profile does not measure yet, and it takes no vocabulary-parallel head.
SLOW_SCHEDULES = frozenset({"zb-ilp", "dualpipe-v"})


@dataclass(frozen=True)
class ComparisonRow:
    """One schedule's numbers in a comparison (``error`` set and numbers ``None`` when it failed).

    ``period`` is the iteration period under the comparison's optimizer mode; ``period_sync`` and
    ``period_post_validation`` give both modes (see :func:`iteration_period`).  ``polished`` says
    whether a polish (``compare_schedules(polish_seconds=...)``) made the schedule faster.
    """

    schedule: str
    chunks: int | None = None
    iteration_time: float | None = None
    makespan: float | None = None
    period: float | None = None
    period_sync: float | None = None
    period_post_validation: float | None = None
    bubble_rate: float | None = None
    bubble_rate_makespan: float | None = None
    peak_memory: float | None = None
    speedup_vs_1f1b: float | None = None
    lower_bound: float | None = None
    gap_to_bound: float | None = None
    fits_memory: bool | None = None
    optimal: bool | None = None
    polished: bool | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


def iteration_period(timeline: Timeline, optimizer: str = "post-validation", step_time: float = 0.0) -> float:
    """Time between the starts of consecutive training iterations.

    With a synchronous optimizer step every rank waits for the whole pipeline to drain, then steps:
    the period is the makespan plus the step.  With optimizer post-validation the step needs no global
    synchronisation, so iterations overlap and the period is each rank's own span plus its step.
    """
    check_step_time(step_time)
    if optimizer == "sync":
        return timeline.makespan + step_time
    if optimizer == "post-validation":
        return timeline.iteration_time + step_time
    raise ScheduleError(f"unknown optimizer mode {optimizer!r}; choose one of {', '.join(OPTIMIZER_MODES)}")


def check_step_time(step_time: float) -> None:
    """Raise :class:`ScheduleError` unless ``step_time`` (the optimizer step) is finite and ≥ 0."""
    if isinstance(step_time, bool) or not isinstance(step_time, (int, float)):
        raise ScheduleError(f"step time must be a number of at least 0, got {step_time!r}")
    if not (math.isfinite(step_time) and step_time >= 0):
        raise ScheduleError(f"step time must be finite and at least 0, got {step_time!r}")


def compare_schedules(
    stages: int,
    microbatches: int,
    costs: CostModel,
    names: Iterable[str] | None = None,
    chunks: int | None = None,
    optimizer: str = "post-validation",
    step_time: float = 0.0,
    options: dict[str, dict[str, Any]] | None = None,
    *,
    polish_seconds: float | None = None,
) -> list[ComparisonRow]:
    """Build and simulate each schedule in ``names`` (default: all fast ones), best period first.

    ``chunks`` applies to schedules whose chunk count is free (interleaved-1f1b); ``options`` maps a
    schedule name to extra builder options (e.g. ``{"zb-ilp": {"time_limit": 10}}``).  With
    ``polish_seconds`` each schedule is polished by CP-SAT for up to that long
    (:func:`~.polish.polish_schedule`); speed-ups stay against the unpolished 1F1B.
    """
    if optimizer not in OPTIMIZER_MODES:
        raise ScheduleError(
            f"unknown optimizer mode {optimizer!r}; choose one of {', '.join(OPTIMIZER_MODES)}"
        )
    check_positive(stages=stages, microbatches=microbatches)
    if chunks is not None:
        check_positive(chunks=chunks)
    check_step_time(step_time)
    if polish_seconds is not None:
        check_polish_request(polish_seconds)  # once, not as the same error on every row
    selected = list(names) if names is not None else [n for n in REGISTRY if n not in SLOW_SCHEDULES]
    request = _Request(stages, microbatches, costs, chunks, optimizer, step_time, polish_seconds)
    rows = [_row(name, request, (options or {}).get(name, {})) for name in selected]
    # a polished 1F1B is not the baseline a speed-up means: then the plain one is built for it
    reference = None
    if polish_seconds is None:
        reference = next((row.period for row in rows if row.schedule == "1f1b" and row.period), None)
    if reference is None and rows:
        reference = _reference_period(stages, microbatches, costs, optimizer, step_time)
    rows = [_with_speedup(row, reference) for row in rows]
    return sorted(rows, key=lambda row: (row.error is not None, row.period or 0.0, row.peak_memory or 0.0))


class _Request(NamedTuple):
    """What every row of one :func:`compare_schedules` call is built and timed with."""

    stages: int
    microbatches: int
    costs: CostModel
    chunks: int | None
    optimizer: str
    step_time: float
    polish_seconds: float | None


def _row(name: str, request: _Request, options: dict[str, Any]) -> ComparisonRow:
    stages, microbatches, costs, chunks, optimizer, step_time, polish_seconds = request
    spec = REGISTRY.get(name)
    take_chunks = chunks if spec is not None and spec.chunks is None else None
    try:
        schedule = build_schedule(
            name,
            stages,
            microbatches,
            costs,
            chunks=take_chunks,
            validate=False,
            polish_seconds=polish_seconds,
            **options,
        )
        planned = spec.resolve_costs(costs, stages) if spec else costs
        timeline = validate_schedule(schedule, planned.with_memory_limit(None))
    except ScheduleError as error:
        return ComparisonRow(schedule=name, error=str(error))
    limits = planned.resolve(schedule.placement).memory_limit
    bound = _lower_bound(schedule, timeline, stages, microbatches, costs)
    return ComparisonRow(
        schedule=name,
        chunks=schedule.chunks,
        iteration_time=timeline.iteration_time,
        makespan=timeline.makespan,
        period=iteration_period(timeline, optimizer, step_time),
        period_sync=iteration_period(timeline, "sync", step_time),
        period_post_validation=iteration_period(timeline, "post-validation", step_time),
        bubble_rate=timeline.bubble_rate,
        bubble_rate_makespan=timeline.bubble_rate_makespan,
        peak_memory=max(timeline.peak_memory_mb),
        fits_memory=all(map(within_limit, timeline.peak_memory, limits)),
        lower_bound=bound,
        gap_to_bound=(timeline.iteration_time / bound - 1.0) if bound else None,
        optimal=schedule.meta.get("optimal"),
        polished=schedule.meta["polish"]["kept"] if "polish" in schedule.meta else None,
    )


def _lower_bound(
    schedule: Schedule, timeline: Timeline, stages: int, microbatches: int, costs: CostModel
) -> float | None:
    """The best bound known on the iteration time of any schedule using no more memory per rank.

    Bounding at the schedule's own peak memory makes the gap say how far it is from the best
    schedule of equal memory, not from one that may use unlimited memory.
    """
    proven = schedule.meta.get("lower_bound")
    own_memory = costs.with_memory_limit([max(peak, 1e-12) for peak in timeline.peak_memory])
    analytic = lower_bound(
        stages, microbatches, own_memory, chunks=schedule.chunks, placement=schedule.placement
    )
    return max(analytic, proven) if proven is not None else analytic


def _reference_period(
    stages: int, microbatches: int, costs: CostModel, optimizer: str, step_time: float
) -> float | None:
    from .simulate import simulate

    try:
        return iteration_period(
            simulate(build_schedule("1f1b", stages, microbatches, costs), costs), optimizer, step_time
        )
    except ScheduleError:
        return None


def _with_speedup(row: ComparisonRow, reference: float | None) -> ComparisonRow:
    if row.period is None or not reference:
        return row
    return ComparisonRow(**{**asdict(row), "speedup_vs_1f1b": reference / row.period})
