"""Choosing how to lower: the fastest FSDP unit size, reshard policy, prefetch depth or bucket size
under a memory cap.

For a built schedule, a :class:`~..grid.Grid` with data parallelism and the stages' per-layer bytes,
:func:`choose_options` lowers and simulates every candidate of :func:`candidate_options` and keeps
the fastest whose peak memory (activations plus parameters, :mod:`.memory`) fits the cap, with a
one-line reason.  The planner chooses with it too (``modelplan/choices.py``): one chooser.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ...errors import ScheduleError
from ..costs import CostModel, StageCosts
from ..grid import Grid
from ..ir import Schedule
from ..sharding import ONCE_PER_STEP, FSDPOptions
from .collectives import CollectiveCosts
from .layout import StageBytes
from .lower import lower
from .overlap import simulate_lowered
from .spans import CommTimeline

#: The reshard policies tried: (after forward, after backward).
RESHARD_POLICIES = ((False, False), (True, False), (True, True))


@dataclass(frozen=True)
class CommChoice:
    """The chosen options, their simulated timeline, why, and every candidate's ``(options,
    iteration time, peak memory)``; ``tie``: when others that fit simulate to the same step, which
    rule kept this one (:func:`break_tie`), else empty."""

    options: FSDPOptions
    timeline: CommTimeline
    reason: str
    tried: tuple[tuple[FSDPOptions, float, float], ...]
    tie: str = ""


#: Steps within this relative difference are a tie (the simulator's float sums, not a real difference).
TIE = 1e-9


def candidate_options(
    grid: Grid,
    *,
    groups: Sequence[int] = (2,),
    prefetch: Sequence[int] = (1, 2),
    bucket_bytes: Sequence[float] = (0.0,),
) -> list[FSDPOptions]:
    """The lowerings worth trying on ``grid``: FSDP's unit granularity (per chunk, per layer, per
    group of ``g`` layers) × reshard policy × prefetch depth, or replicate's bucket sizes."""
    if grid.dp_mode == "replicate":
        return [replace(ONCE_PER_STEP, bucket_bytes=size) for size in bucket_bytes]
    if grid.dp_mode == "none":
        return [ONCE_PER_STEP]
    units: list[str | int] = ["chunk", "layer", *(max(g, 1) for g in groups)]
    return [
        FSDPOptions(
            units=unit,
            reshard_after_forward=forward,
            reshard_after_backward=backward,
            prefetch=depth,
        )
        for unit in units
        for forward, backward in RESHARD_POLICIES
        for depth in prefetch
    ]


def choose_options(
    schedule: Schedule,
    costs: CostModel | StageCosts,
    grid: Grid,
    model: StageBytes,
    *,
    memory_cap: float | None = None,
    collectives: CollectiveCosts | None = None,
    candidates: Sequence[FSDPOptions] | None = None,
    resident: Sequence[float] = (),
) -> CommChoice:
    """The fastest candidate whose largest rank peak is at most ``memory_cap`` (in the unit shared
    by ``costs.mem_b`` and ``model``'s bytes); when none fits, the one with the lowest peak, and the
    reason says so.  Equal steps are broken by :func:`break_tie`.
    ``resident[r]``: bytes rank ``r`` holds whatever the lowering (the planner's optimizer state),
    added to its peak."""
    tried = candidates or candidate_options(grid)
    if not tried:
        raise ScheduleError("choose_options needs at least one candidate")
    collectives = collectives or CollectiveCosts.from_grid(grid)
    scored = []
    for options in tried:
        lowered = lower(schedule, options, grid=grid, model=model)
        timeline = simulate_lowered(lowered, costs, collectives)
        scored.append((options, timeline))
    if resident:
        scored = [(options, _with_resident(t, resident)) for options, t in scored]
    table = tuple((options, t.iteration_time, max(t.peak_memory)) for options, t in scored)
    fitting = [
        entry
        for entry in scored
        if memory_cap is None or max(entry[1].peak_memory) <= memory_cap * (1 + 1e-9)
    ]
    tie = ""
    if fitting:
        index, tie = break_tie([(o, t.iteration_time, max(t.peak_memory)) for o, t in fitting], grid.dp_mode)
        options, timeline = fitting[index]
    else:
        options, timeline = min(scored, key=lambda entry: max(entry[1].peak_memory))
    reason = _reason(options, timeline, scored, memory_cap, fits=bool(fitting), mode=grid.dp_mode)
    return CommChoice(options, timeline, reason + (f"; {tie}" if tie else ""), table, tie)


def break_tie(
    fitting: Sequence[tuple[FSDPOptions, float, float]],
    mode: str,
    size: Callable[[float], str] = "{:.4g}".format,
) -> tuple[int, str]:
    """Which of ``fitting`` (``(options, step, peak)`` in candidate order) is the fastest and, when
    others simulate to the same step (within :data:`TIE`), the rule that kept it: fewer bytes at the
    peak, then a shallower prefetch (fewer gathers in flight), then the earlier candidate (coarser
    units, less resharding); ``size`` writes bytes."""
    fastest = min(step for _, step, _ in fitting)
    tied = [i for i, (_, step, _) in enumerate(fitting) if step <= fastest * (1 + TIE)]
    ranked = sorted(tied, key=lambda i: (fitting[i][2], fitting[i][0].prefetch))  # stable: candidate order
    if len(ranked) == 1:
        return ranked[0], ""
    (won, _, peak), (runner, _, other_peak) = fitting[ranked[0]], fitting[ranked[1]]
    if peak < other_peak:
        rule = f"fewer bytes ({size(peak)} against {size(other_peak)})"
    elif won.prefetch < runner.prefetch:
        rule = f"the same bytes and a shallower prefetch ({won.prefetch} against {runner.prefetch})"
    else:
        rule = "the same bytes and prefetch, and comes first (coarser units, less resharding)"
    others = f"{len(tied) - 1} others" if len(tied) > 2 else runner.describe(mode)
    return ranked[0], f"tied with {others} at the same step; kept for {rule}"


def _with_resident(timeline: CommTimeline, resident: Sequence[float]) -> CommTimeline:
    """``timeline`` whose parameter and total peaks count ``resident[r]`` more bytes on rank ``r``."""
    memory = timeline.memory
    more = lambda peaks: tuple(p + r for p, r in zip(peaks, resident))  # noqa: E731
    return replace(
        timeline, memory=replace(memory, parameters=more(memory.parameters), total=more(memory.total))
    )


def _reason(
    options: FSDPOptions,
    timeline: CommTimeline,
    scored: list[tuple[FSDPOptions, CommTimeline]],
    cap: float | None,
    *,
    fits: bool,
    mode: str,
) -> str:
    peak = max(timeline.peak_memory)
    head = (
        f"{options.describe(mode)}: iteration {timeline.iteration_time:.4g}, peak {peak:.4g}, "
        f"{timeline.exposed_dp:.3g} of data-parallel communication exposed"
    )
    if not fits:
        return f"{head}; no candidate fits the cap {cap:.4g}, this one peaks lowest of {len(scored)}"
    fastest_options, fastest = min(scored, key=lambda entry: entry[1].iteration_time)
    if timeline.iteration_time <= fastest.iteration_time * (1 + TIE):  # the fastest, or tied with it
        within = f" within the cap {cap:.4g}" if cap is not None else ""
        return f"{head}; the fastest of {len(scored)} candidates{within}"
    return (
        f"{head}; the fastest of {len(scored)} within the cap {cap:.4g} ({fastest_options.describe(mode)} "
        f"takes {fastest.iteration_time:.4g} but peaks at {max(fastest.peak_memory):.4g})"
    )
