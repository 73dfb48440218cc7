"""Which FSDP units, resharding, prefetch depth or all-reduce buckets a planned layout runs with.

The planner searches each layout's schedule with the sharding that holds the least
(:func:`least_memory`: FSDP units of one layer, resharded after each pass, no gather ahead; or the
replicated all-reduce once a step), scored by the closed form of :mod:`.sharding` (a fast
pre-filter: no lowering per candidate).  Then :func:`choose_comm` chooses the winner's
communication by the lowering's simulator, the one chooser of the project
(:func:`~..lowering.choose_options`): the winner's schedule lowered with every
:func:`~..lowering.candidate_options` record (per-layer bytes from the profile, the grid's links),
simulated with communication overlapping compute, and the fastest whose peak (activations,
parameters and gradients as the lowering holds them, plus the optimizer state) fits the budget
kept, with the reason.  ``docs/auto-planning.md``, "One chooser".  Pure Python; no torch.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..grid import Grid
from ..lowering import CommChoice, StageBytes, candidate_options, choose_options
from ..lowering.choose import TIE, break_tie
from ..sharding import ONCE_PER_STEP, FSDPOptions
from .amounts import format_bytes
from .profile import ModelProfile
from .result import PlanCandidate

UNIT_GROUPS = (2, 4)
"""FSDP unit sizes tried besides a layer and the chunk: groups of 2 and 4 layers."""

PREFETCH_DEPTHS = (0, 1, 2)
"""Gathers in flight ahead of the unit computing."""

BUCKETS = (0.0, 25e6, 100e6)
"""Replicated all-reduce buckets: one per chunk after its last gradient, DDP's 25 MB, 100 MB."""


def least_memory(grid: Grid) -> Grid:
    """The variant that holds the fewest bytes: what a layout's schedule is planned with."""
    if grid.dp == 1 or grid.shard == 1:
        return replace(grid, comm=ONCE_PER_STEP)
    return replace(grid, comm=FSDPOptions(units="layer", reshard_after_forward=True, prefetch=0))


def planner_candidates(grid: Grid) -> list[FSDPOptions]:
    """The records the planner tries on ``grid``: :func:`~..lowering.candidate_options` with the
    unit groups, prefetch depths and buckets above."""
    return candidate_options(grid, groups=UNIT_GROUPS, prefetch=PREFETCH_DEPTHS, bucket_bytes=BUCKETS)


def choose_comm(
    grid: Grid,
    profile: ModelProfile,
    candidate: PlanCandidate,
    *,
    budget: float | None,
    candidates: list[FSDPOptions] | None = None,
) -> CommChoice:
    """The communication ``candidate`` (a planned winner on ``grid``, ``profile`` one rank's share,
    :meth:`~..grid.Grid.per_rank`) runs with: :func:`~..lowering.choose_options` under ``budget``
    over ``candidates`` (default :func:`planner_candidates`)."""
    assert candidate.built is not None and candidate.costs is not None
    schedule = candidate.built
    bounds = [0, *candidate.partition, len(profile.layers)]
    stages = [profile.layers[bounds[s] : bounds[s + 1]] for s in range(schedule.num_stages)]
    tp, shard = grid.tp, grid.shard
    model = StageBytes(
        tuple(tuple(layer.parameter_bytes / tp for layer in stage) for stage in stages),
        tuple(tuple(layer.gradient_bytes / tp for layer in stage) for stage in stages),
    )
    optimizer = [
        math.fsum(layer.optimizer_bytes for s in schedule.placement.stages_of(rank) for layer in stages[s])
        / (tp * shard)
        for rank in range(schedule.num_ranks)
    ]
    choice = choose_options(
        schedule,
        candidate.costs,
        grid,
        model,
        memory_cap=budget,
        candidates=candidates or planner_candidates(grid),
        resident=optimizer,
    )
    return replace(choice, reason=comm_reason(choice, budget, grid.dp_mode))


def comm_reason(choice: CommChoice, budget: float | None, mode: str) -> str:
    """Why ``choice`` won, in bytes and seconds: its simulated step and peak against ``budget``, the
    candidates tied with it and the rule that kept it (:func:`~..lowering.choose.break_tie`), else the
    next fastest that fits (what it lost by), and the fastest that does not fit (its peak)."""
    step, peak = choice.timeline.iteration_time, max(choice.timeline.peak_memory)
    cap = f" of {format_bytes(budget)}" if budget is not None else ""
    text = f"{choice.options.describe(mode)}: step {step:.3f} s, peak {format_bytes(peak)}{cap}"
    fits = [t for t in choice.tried if budget is None or t[2] <= budget * (1 + 1e-9)]
    if budget is not None and peak > budget * (1 + 1e-9):
        return text + f"; none of {len(choice.tried)} fits, this one peaks lowest"
    text += f"; the fastest of {len(fits)} that fit, of {len(choice.tried)} simulated"
    _, tie = break_tie(fits, mode, format_bytes)
    others = sorted((t for t in fits if t[1] > step * (1 + TIE)), key=lambda t: t[1])
    if tie:
        text += f"; {tie}"
    if others:
        options, time, held = others[0]
        text += f"; next {options.describe(mode)}, {time - step:+.3g} s, {format_bytes(held)}"
    faster = [t for t in choice.tried if t not in fits and t[1] < step]
    if faster:
        options, time, held = min(faster, key=lambda t: t[1])
        text += f"; {options.describe(mode)} would take {time:.3f} s but peaks at {format_bytes(held)}"
    return text
