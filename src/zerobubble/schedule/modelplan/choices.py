"""Which FSDP units, resharding, prefetch depth or all-reduce buckets a planned layout runs with.

``plan --cluster`` plans each layout's schedule with the sharding that holds the least (FSDP units of
one layer, resharded after the forward, no gather ahead; replicated: one all-reduce after the step),
then scores every :func:`sharding_variants` of the layout on the winner's partition and simulated
timeline: the bytes each rank holds (:meth:`~..grid.Grid.held_bytes` plus the timeline's peak
activations) and the step (the simulated period with the variant's exposed collectives,
:meth:`~..grid.Grid.step_seconds`).  :func:`choose_sharding` keeps the fastest that fits the memory,
and :func:`sharding_reason` says which and why (``docs/auto-planning.md``, "A cluster on paper").
Pure Python; no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..grid import Grid
from ..sharding import ONCE_PER_STEP, FSDPOptions
from .amounts import format_bytes
from .profile import LayerProfile, ModelProfile
from .result import PlanCandidate

UNIT_SIZES: tuple[str | int, ...] = ("layer", 2, 4, "chunk")
"""The FSDP unit sizes tried: a layer, groups of 2 and 4 layers, the chunk."""

PREFETCH_DEPTHS = (0, 1, 2)
"""Gathers in flight ahead of the unit computing."""

BUCKETS = (0.0, 25e6, 100e6)
"""Replicated all-reduce buckets: after the step, DDP's 25 MB default, 100 MB."""


def sharding_records(grid: Grid) -> list[FSDPOptions]:
    """Every communication record tried on ``grid``: the runtime's chunk gathered once a step and
    the FSDP units (size × reshard after the forward or not, always after the backward ×
    prefetch), or the replicated all-reduce's buckets."""
    if grid.dp == 1:
        return [grid.comm]
    if grid.shard == 1:
        return [replace(ONCE_PER_STEP, bucket_bytes=size) for size in BUCKETS]
    return [ONCE_PER_STEP] + [
        FSDPOptions(units=unit, reshard_after_forward=forward, reshard_after_backward=True, prefetch=depth)
        for unit in UNIT_SIZES
        for forward in (True, False)
        for depth in PREFETCH_DEPTHS
    ]


def sharding_variants(grid: Grid) -> list[Grid]:
    """``grid`` with each of :func:`sharding_records` as its ``comm``."""
    return [replace(grid, comm=record) for record in sharding_records(grid)]


def least_memory(grid: Grid) -> Grid:
    """The variant that holds the fewest bytes: what a layout's schedule is planned with."""
    if grid.dp == 1 or grid.shard == 1:
        return replace(grid, comm=ONCE_PER_STEP)
    return replace(grid, comm=FSDPOptions(units="layer", reshard_after_forward=True, prefetch=0))


def describe_sharding(grid: Grid) -> str:
    """``FSDP units of 1 layer, resharded after the forward, 1 gather ahead`` and the like."""
    comm = grid.comm
    if grid.dp == 1:
        return "no data parallelism"
    if grid.shard == 1:
        if not comm.bucket_bytes:
            return "gradients all-reduced once after the step"
        return f"gradients all-reduced in {comm.bucket_bytes / 1e6:g} MB buckets during the backward"
    if not comm.resharded:
        return "each chunk gathered once a step (the runtime's)"
    words = {"layer": "one layer", "1": "one layer", "chunk": "a chunk"}
    unit = words.get(str(comm.units), f"{comm.units} layers")
    kept = "resharded after the forward" if comm.reshard_after_forward else "kept whole until the backward"
    ahead = f"{comm.prefetch} gather{'s' if comm.prefetch != 1 else ''} ahead"
    return f"FSDP units of {unit}, {kept}, {ahead}"


@dataclass(frozen=True)
class ShardingScore:
    """One variant on the planned candidate: its step (seconds), each rank's peak bytes, whether
    every rank fits the budget."""

    grid: Grid
    step: float
    peaks: tuple[float, ...]
    fits: bool

    @property
    def peak(self) -> float:
        """The busiest rank's bytes."""
        return max(self.peaks)


def rank_layers(profile: ModelProfile, candidate: PlanCandidate, ranks: int) -> list[list[LayerProfile]]:
    """The layers of ``profile`` (one rank's share) each pipeline rank holds in ``candidate``."""
    assert candidate.built is not None
    bounds = [0, *candidate.partition, len(profile.layers)]
    held: list[list[LayerProfile]] = [[] for _ in range(ranks)]
    for stage, rank in enumerate(candidate.built.placement.stage_ranks):
        held[rank].extend(profile.layers[bounds[stage] : bounds[stage + 1]])
    return held


def score_shardings(
    planned: Grid,
    profile: ModelProfile,
    candidate: PlanCandidate,
    *,
    microbatches: int,
    budget: float,
    variants: Sequence[Grid] | None = None,
) -> list[ShardingScore]:
    """``variants`` (default: every :func:`sharding_variants` of ``planned``, the grid the candidate
    was planned with) on ``candidate``'s partition and timeline, the fastest that fits first: of
    those within 0.1 % of it, the one that holds the least."""
    assert candidate.timeline is not None and candidate.period is not None
    ranks = len(candidate.timeline.peak_memory)
    held = rank_layers(planned.per_rank(profile), candidate, ranks)
    chunks = candidate.chunks

    def collectives(grid: Grid) -> float:
        return max(grid.step_seconds(layers, chunks, microbatches) for layers in held)

    compute = candidate.period - collectives(planned)
    scores = []
    for grid in sharding_variants(planned) if variants is None else variants:
        peaks = tuple(grid.held_bytes(layers) + a for layers, a in zip(held, candidate.timeline.peak_memory))
        fits = all(peak <= budget * (1 + 1e-9) for peak in peaks)
        scores.append(ShardingScore(grid, compute + collectives(grid), peaks, fits))
    scores.sort(key=lambda s: (not s.fits, s.step, s.peak))
    close = [s for s in scores if s.fits and s.step <= scores[0].step * (1 + 1e-3)]
    if close:
        first = min(close, key=lambda s: s.peak)
        scores.remove(first)
        scores.insert(0, first)
    return scores


def sharding_reason(scores: Sequence[ShardingScore], budget: float) -> str:
    """Why the first of ``scores`` (:func:`score_shardings`'s order) was chosen over the others."""
    best = scores[0]
    text = f"{describe_sharding(best.grid)}: step {best.step:.3f} s, {format_bytes(best.peak)} a GPU"
    others = [s for s in scores[1:] if s.fits]
    if others:
        text += f"; the next, {describe_sharding(others[0].grid)}, {others[0].step - best.step:+.3f} s"
    over = [s for s in scores if not s.fits]
    if over:
        closest = min(over, key=lambda s: s.step)
        if closest.step < best.step and not math.isclose(closest.step, best.step):
            text += (
                f"; {describe_sharding(closest.grid)} would be {best.step - closest.step:.3f} s faster but "
                f"needs {format_bytes(closest.peak)} of {format_bytes(budget)}"
            )
        text += f"; {len(over)} of {len(scores)} do not fit"
    return text
