"""Analytic lower bounds on the iteration time and the makespan of any schedule.

The bounds hold for every schedule of a placement under a cost model and its memory limit, whatever
its builder.  Per rank: the warm-up idle before the first backward can arrive (less the forwards
that fit in memory meanwhile), the cool-down idle after the last forward (less the backward work
already in memory), and the turnaround chains from each of its stages; the iteration time is at
least the maximum over ranks.  They cost O(S²) arithmetic, so planners rank candidates by their
distance to the bound and stop a search that meets it; the integer program of
:mod:`~zerobubble.schedule.builders.zb_ilp` uses them as a cut.

The argument in full, and where the bound is tight: ``docs/schedulers.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .costs import CostModel, StageCosts, memory_cap
from .ir import Placement, ScheduleError, check_positive


@dataclass(frozen=True)
class _Chains:
    """Per virtual stage: the dependency chains of one microbatch through a placement."""

    forward_prefix: tuple[float, ...]
    round_trip: tuple[float, ...]
    backward_suffix: tuple[float, ...]


def lower_bound(
    stages: int,
    microbatches: int,
    costs: CostModel | None = None,
    chunks: int = 1,
    placement: Placement | None = None,
) -> float:
    """A lower bound on the iteration time of every schedule for this pipeline.

    ``stages`` is the number of ranks ``p``; ``placement`` defaults to the loop placement with
    ``chunks`` virtual stages per rank.  ``costs.memory_limit`` (absolute, per rank) bounds how many
    forwards a rank can run ahead; ``None`` means unlimited.
    """
    resolved, m = _resolve(stages, microbatches, costs, chunks, placement)
    chains = _chains(resolved)
    return max(_rank_span_bound(resolved, m, chains, rank) for rank in range(resolved.placement.num_ranks))


def lower_bound_makespan(
    stages: int,
    microbatches: int,
    costs: CostModel | None = None,
    chunks: int = 1,
    placement: Placement | None = None,
) -> float:
    """A lower bound on the makespan (first op's start to last op's end) of every schedule."""
    resolved, m = _resolve(stages, microbatches, costs, chunks, placement)
    chains = _chains(resolved)
    best = 0.0
    for rank in range(resolved.placement.num_ranks):
        offset = min(chains.forward_prefix[s] for s in resolved.placement.stages_of(rank))
        best = max(best, offset + _rank_span_bound(resolved, m, chains, rank))
    return best


def _resolve(
    stages: int, microbatches: int, costs: CostModel | None, chunks: int, placement: Placement | None
) -> tuple[StageCosts, int]:
    check_positive(stages=stages, microbatches=microbatches, chunks=chunks)
    if placement is None:
        placement = Placement.loop(stages, chunks)
    elif placement.num_ranks != stages:
        raise ScheduleError(
            f"the placement has {placement.num_ranks} ranks but stages={stages}; pass matching values"
        )
    return (costs if costs is not None else CostModel()).resolve(placement), microbatches


def _delay(costs: StageCosts, lower: int) -> float:
    """Transfer time between stages ``lower`` and ``lower + 1`` (0 when one rank holds both)."""
    rank_of = costs.placement.rank_of
    return costs.comm[lower] if rank_of(lower) != rank_of(lower + 1) else 0.0


def _chains(costs: StageCosts) -> _Chains:
    """Forward prefix (start of F(s) after F(0) starts), round trip D_s, backward suffix to stage 0."""
    S = costs.placement.num_stages
    prefix = [0.0] * S
    for s in range(1, S):
        prefix[s] = prefix[s - 1] + costs.f[s - 1] + _delay(costs, s - 1)
    round_trip = [0.0] * S
    round_trip[S - 1] = costs.f[S - 1]
    for s in range(S - 2, -1, -1):
        round_trip[s] = round_trip[s + 1] + costs.f[s] + costs.b[s + 1] + 2 * _delay(costs, s)
    suffix = [0.0] * S
    for s in range(1, S):
        suffix[s] = suffix[s - 1] + costs.b[s - 1] + _delay(costs, s - 1)
    return _Chains(tuple(prefix), tuple(round_trip), tuple(suffix))


def _rank_span_bound(costs: StageCosts, m: int, chains: _Chains, rank: int) -> float:
    """``work + idle`` for one rank (see the module docstring)."""
    stages = costs.placement.stages_of(rank)
    limit = memory_cap(costs.memory_limit[rank])
    work = costs.rank_work(rank, m)
    forward_work = m * sum(costs.f[s] for s in stages)
    # The rank's first op is a forward of its first stage (every other stage it holds waits for
    # that one's forward of the same microbatch), so a backward of stage s starts no earlier than
    # the forward chain from there to s plus s's round trip after the rank's first start.
    first = stages[0]
    first_backward = min(
        chains.forward_prefix[s] - chains.forward_prefix[first] + chains.round_trip[s] for s in stages
    )
    warm_idle = max(0.0, first_backward - _forward_capacity(costs, m, stages, limit))
    cool_idle = max(
        0.0,
        min(
            chains.round_trip[s] - costs.f[s] - _backward_capacity(costs, m, stages, s, limit) for s in stages
        ),
    )
    all_forwards_fit = m * sum(costs.mem_b[s] for s in stages) <= limit
    idle = max(warm_idle, cool_idle) if all_forwards_fit else warm_idle + cool_idle
    last_microbatch = min(
        forward_work + chains.round_trip[s] - costs.f[s] + costs.b[s] + costs.w[s] for s in stages
    )
    return max(work + idle, last_microbatch, _turnaround_bound(costs, m, chains, stages))


def _turnaround_bound(costs: StageCosts, m: int, chains: _Chains, stages: tuple[int, ...]) -> float:
    """Span bound from a later stage's last backward travelling back to one of the rank's stages.

    For a stage ``e`` of the rank and any ``t ≥ e``: every forward of ``t`` waits for the forward
    of ``e`` (on this rank, so after its first start) and the chain between them; stage ``t`` runs
    all its ``m`` forwards and backwards before its last backward, which cannot start before the
    round trip; its input gradient then travels back to ``e``, whose B and W come last.
    """
    best = 0.0
    S = costs.placement.num_stages
    for e in stages:
        for t in range(e, S):
            last_backward_end = max(
                m * (costs.f[t] + costs.b[t]),
                chains.round_trip[t] + m * costs.b[t],
                m * costs.f[t] + chains.round_trip[t] - costs.f[t] + costs.b[t],
            )
            there = chains.forward_prefix[t] - chains.forward_prefix[e]
            back = chains.backward_suffix[t] - chains.backward_suffix[e]
            best = max(best, there + last_backward_end + back + costs.w[e])
    return best


def _forward_capacity(costs: StageCosts, m: int, stages: tuple[int, ...], limit: float) -> float:
    """Most forward work a rank can run before its first backward, within its memory limit."""
    if len(stages) == 1:
        s = stages[0]
        count = m if costs.mem_b[s] <= 0 or math.isinf(limit) else min(m, math.floor(limit / costs.mem_b[s]))
        return count * costs.f[s]
    return _knapsack([(costs.f[s], costs.mem_b[s], m) for s in stages], limit)


def _backward_capacity(costs: StageCosts, m: int, stages: tuple[int, ...], last: int, limit: float) -> float:
    """Most backward and weight-gradient work available while the last forward's microbatch is away.

    Every microbatch still in flight holds its activations and offers its B and W; every pending W
    holds its share and offers W.  The waiting microbatch itself (of stage ``last``) holds M_B too.
    """
    items = []
    for s in stages:
        others = m - 1 if s == last else m
        items.append((costs.b[s] + costs.w[s], costs.mem_b[s], others))
        items.append((costs.w[s], costs.mem_w[s], others))
    total = sum(m * (costs.b[s] + costs.w[s]) for s in stages) - costs.b[last] - costs.w[last]
    return min(total, _knapsack(items, limit - costs.mem_b[last]))


def _knapsack(items: list[tuple[float, float, int]], capacity: float) -> float:
    """Fractional knapsack: the most value from ``(value, weight, count)`` items within ``capacity``.

    An upper bound on any integral choice, computed greedily by value per weight.
    """
    total = 0.0
    room = max(0.0, capacity)
    weightless = [(value, count) for value, weight, count in items if weight <= 0]
    total += sum(value * count for value, count in weightless)
    weighted = sorted(
        ((value, weight, count) for value, weight, count in items if weight > 0),
        key=lambda item: item[0] / item[1],
        reverse=True,
    )
    for value, weight, count in weighted:
        if room <= 0:
            break
        taken = min(count, room / weight)
        total += taken * value
        room -= taken * weight
    return total
