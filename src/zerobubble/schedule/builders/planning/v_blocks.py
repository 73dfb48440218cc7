"""Building-block V schedules (arXiv 2405.15362): one microbatch's ops, repeated every interval.

A building block fixes when each op of one microbatch runs relative to its entry; microbatch ``j``
repeats it ``j`` intervals later, so the peak memory follows from the lifespans within the block.
The block is found by modulo scheduling at the real costs (each op at the earliest arrival time
whose slot modulo the interval is free on its rank; W ops ``late`` or ``eager``); sorting each
rank's ops by block time gives the programs, which the simulator then compresses.  ``depth`` extra
intervals of chunk-0 forwards trade memory for a shorter warm-up.

Why the peak is the steady state's: ``docs/schedulers.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...costs import StageCosts
from ...ir import B, F, Op, W
from .core import BuilderCandidate, as_plan_ops, fixed_candidate

_TOLERANCE = 1e-9


@dataclass(frozen=True)
class BlockVariant:
    """One building block.

    * ``interval_factor`` — the interval as a multiple of the busiest rank's work per microbatch.
    * ``depth`` — extra intervals chunk-0 forwards run ahead on every rank.
    * ``eager_w`` — 0: W ops placed after the whole F/B chain; 1: right after their B; 2: right
      after their B when that slot is free, else after the chain.
    * ``packed`` — False places every op at its input's arrival, ignoring the modulo slots (the
      simulator then resolves the overlaps).
    """

    interval_factor: float = 1.0
    depth: int = 0
    eager_w: int = 0
    packed: bool = True


def _free_start(busy: list[tuple[float, float]], ready: float, duration: float, interval: float) -> float:
    """Earliest ``t ≥ ready`` whose slot ``[t, t + duration)`` modulo ``interval`` misses ``busy``.

    Falls back to ``ready`` itself (the op then overlaps and the simulator stretches the period)
    when no slot of that length is free.
    """
    if math.isinf(interval):
        return ready
    candidates = [ready]
    base = ready - (ready % interval)
    for start, length in busy:
        for shift in (base - interval, base, base + interval):
            end = shift + start + length
            if ready <= end < ready + interval:
                candidates.append(end)
    for t in sorted(candidates):
        if all(_misses(t % interval, duration, start, length, interval) for start, length in busy):
            return t
    return ready


def _misses(x: float, d: float, y: float, e: float, interval: float) -> bool:
    """Whether ``[x, x + d)`` and ``[y, y + e)`` are disjoint on the circle of length ``interval``."""
    return (y - x) % interval >= d - _TOLERANCE and (x - y) % interval >= e - _TOLERANCE


def block_offsets(costs: StageCosts, interval: float, eager_w: int) -> dict[tuple[str, int], float]:
    """Start time of every op of one microbatch (keys ``("F"|"B"|"W", stage)``), modulo-scheduled."""
    S = costs.placement.num_stages
    rank_of = costs.placement.stage_ranks
    busy: list[list[tuple[float, float]]] = [[] for _ in range(costs.placement.num_ranks)]
    offsets: dict[tuple[str, int], float] = {}

    def place(key: tuple[str, int], ready: float, duration: float) -> float:
        rank = rank_of[key[1]]
        start = _free_start(busy[rank], ready, duration, interval)
        busy[rank].append((start % interval if math.isfinite(interval) else 0.0, duration))
        offsets[key] = start
        return start + duration

    def hop(s: int) -> float:
        return costs.comm[s] if rank_of[s] != rank_of[s + 1] else 0.0

    end = 0.0
    for s in range(S):
        end = place(("F", s), end + (hop(s - 1) if s > 0 else 0.0), costs.f[s])
    for s in range(S - 1, -1, -1):
        end = place(("B", s), end + (hop(s) if s < S - 1 else 0.0), costs.b[s])
        rank = rank_of[s]
        if eager_w == 1 or (
            eager_w == 2 and _free_start(busy[rank], end, costs.w[s], interval) <= end + _TOLERANCE
        ):
            place(("W", s), end, costs.w[s])
    for s in range(S - 1, -1, -1):
        if ("W", s) not in offsets:
            place(("W", s), offsets[("B", s)] + costs.b[s], costs.w[s])
    return offsets


_KIND_ORDER = {"B": 0, "W": 1, "F": 2}
_MAKERS = {"F": F, "B": B, "W": W}


def block_programs(costs: StageCosts, microbatches: int, variant: BlockVariant) -> list[list[Op]]:
    """Each rank's ops of all microbatches, ordered by their times in the repeated block."""
    placement = costs.placement
    p = placement.num_ranks
    interval = variant.interval_factor * max(costs.rank_work(rank, 1) for rank in range(p))
    offsets = block_offsets(costs, interval if variant.packed else math.inf, variant.eager_w)
    timed: list[list[tuple[float, int, int, int, str]]] = [[] for _ in range(p)]
    for (kind, stage), offset in offsets.items():
        if kind == "F" and stage < p:  # chunk 0
            offset -= variant.depth * interval
        rank = placement.stage_ranks[stage]
        for j in range(microbatches):
            timed[rank].append((j * interval + offset, _KIND_ORDER[kind], j, stage, kind))
    return [[_MAKERS[kind](stage, j) for _, _, j, stage, kind in sorted(ops)] for ops in timed]


# Candidate blocks, most often best first.  Intervals below one rank's work make the modulo picture
# overlap a little; the simulator's compression turns that into shorter lifespans at full rate.
BLOCK_VARIANTS: tuple[BlockVariant, ...] = (
    BlockVariant(0.9),
    BlockVariant(0.9, eager_w=1),
    BlockVariant(1.0, eager_w=1),
    BlockVariant(1.2),
    BlockVariant(1.3),
    BlockVariant(1.0, packed=False),
)


def block_candidate(costs: StageCosts, microbatches: int, variant: BlockVariant) -> BuilderCandidate:
    """One building block as a search candidate (skipped when it exceeds the memory limit)."""
    label = f"block-{variant.interval_factor:g}-depth{variant.depth}-w{variant.eager_w}"
    label += "" if variant.packed else "-unpacked"
    return fixed_candidate(
        "block", label, costs, microbatches, lambda: as_plan_ops(block_programs(costs, microbatches, variant))
    )
