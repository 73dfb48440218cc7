"""V-Half and V-Min: V-shape schedules with controllable activation memory (arXiv 2405.15362).

Each rank is limited to ⌊(p+2)/2⌋ (V-Half) or ⌊(p+4)/3⌋ (V-Min) microbatches of M_B.  One search
(:func:`.planning.search`) compares the authors' squeezed pattern (:mod:`.planning.v_pattern`, so
the result is never slower than their order), our building blocks modulo-scheduled at the real
costs (:mod:`.planning.v_blocks`) and the V greedy zb-v also runs (:mod:`.planning.v_greedy`) with
lifespan-capped and paced policies; the shortest iteration time wins.  A smaller
``costs.memory_limit`` still applies.  ``Schedule.meta`` records the limit, ``memory_microbatches``
and the winner (``meta["planner"]``).

The paper's memory and bubble figures: ``docs/schedulers.md``.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..bounds import lower_bound
from ..costs import CostModel, StageCosts
from ..ir import Placement, Schedule, ScheduleError
from .planning import BuilderCandidate, check_one_microbatch_fits, search
from .planning.local_improve import improve_schedule, retimed
from .planning.v_blocks import BLOCK_VARIANTS, block_candidate
from .planning.v_greedy import VPolicy, v_candidates
from .planning.v_pattern import pattern_candidates

_ORDERS = (("B1", "B0", "F1", "F0"), ("B1", "F1", "B0", "F0"), ("F1", "B1", "B0", "F0"))

_LEADING = (
    VPolicy(_ORDERS[0], pace=0.5),
    VPolicy(_ORDERS[1], lifespan_slack=1, pace=0.8),
    VPolicy(_ORDERS[0], lifespan_slack=2),
    VPolicy(_ORDERS[0], lifespan_slack=1),
    VPolicy(_ORDERS[0], lifespan_slack=3),
    VPolicy(_ORDERS[0], alternate=True, lifespan_slack=0),
)

# Candidates, most often best first (large problems try only a prefix): paced and lifespan-capped
# policies lead (they win under tight limits), then the rest of the grid and the plain ones.
MEMORY_POLICIES: tuple[VPolicy, ...] = _LEADING + tuple(
    policy
    for policy in (
        *(
            VPolicy(order, alternate=alternate, lifespan_slack=slack)
            for slack in (0, 1, 2, 3)
            for order in _ORDERS[:2]
            for alternate in (False, True)
        ),
        VPolicy(_ORDERS[0]),
        VPolicy(_ORDERS[2]),
        VPolicy(_ORDERS[0], alternate=True, guard=True),
    )
    if policy not in _LEADING
)


#: Op placements (or simulated ops) one V-Half / V-Min search may spend before it stops trying
#: further candidates: at p = 32, m = 256 the authors' pattern alone (6·p·m = 49,152 ops); smaller
#: problems try every candidate.
OP_BUDGET = 40_000


def half_memory_microbatches(stages: int) -> int:
    """V-Half's peak activation memory in microbatches (units of one rank-stage's M_B)."""
    return (stages + 2) // 2


def min_memory_microbatches(stages: int) -> int:
    """V-Min's peak activation memory in microbatches (units of one rank-stage's M_B)."""
    return (stages + 4) // 3


def build_with_memory(
    name: str, stages: int, microbatches: int, costs: CostModel, microbatches_in_memory: float
) -> Schedule:
    """A V schedule whose every rank holds at most ``microbatches_in_memory`` of its own M_B.

    Rank ``r``'s limit is that many times the activation memory of one microbatch on its two chunks
    (so per-stage memory lists give per-rank limits), or the user's limit where that is smaller.
    """
    if microbatches_in_memory < 1:
        raise ScheduleError(
            f"{name} needs room for at least one microbatch per rank, got {microbatches_in_memory}"
        )
    placement = Placement.vshape(stages)
    resolved = costs.resolve(placement)
    limits = []
    for rank in range(stages):
        own = microbatches_in_memory * sum(resolved.mem_b[s] for s in placement.stages_of(rank))
        if own <= 0:  # this rank allocates nothing, so any positive limit holds
            own = resolved.memory_limit[rank] if resolved.memory_limit[rank] < float("inf") else 1.0
        limits.append(min(own, resolved.memory_limit[rank]))
    planned = costs.with_memory_limit(limits)
    resolved = planned.resolve(placement)
    check_one_microbatch_fits(resolved, name)
    floor = lower_bound(stages, microbatches, planned, placement=placement)
    candidates = [
        *pattern_candidates(resolved, microbatches, name),
        *(block_candidate(resolved, microbatches, variant) for variant in BLOCK_VARIANTS),
        *_greedy_candidates(resolved, microbatches),
    ]
    best = search(
        name, resolved, microbatches, candidates, OP_BUDGET, floor, memory_microbatches=microbatches_in_memory
    )
    return improve_schedule(best, resolved, floor=floor)


def _greedy_candidates(costs: StageCosts, microbatches: int) -> Iterator[BuilderCandidate]:
    """The V greedy under :data:`MEMORY_POLICIES`; the paced ones ranked by their exact times."""
    for policy in MEMORY_POLICIES:
        for candidate in v_candidates(costs, microbatches, (policy,)):
            yield retimed(candidate, costs, microbatches) if policy.pace else candidate


def _check_chunks(name: str, chunks: int) -> None:
    if chunks != 2:
        raise ScheduleError(f"{name} runs exactly 2 chunks per rank (the V); got chunks={chunks}")


def build_half(stages: int, microbatches: int, costs: CostModel, chunks: int = 2) -> Schedule:
    """V-Half: about half of 1F1B's activation memory and half of its bubble."""
    _check_chunks("v-half", chunks)
    return build_with_memory("v-half", stages, microbatches, costs, half_memory_microbatches(stages))


def build_min(stages: int, microbatches: int, costs: CostModel, chunks: int = 2) -> Schedule:
    """V-Min: about a third of 1F1B's activation memory, about two thirds of its bubble."""
    _check_chunks("v-min", chunks)
    return build_with_memory("v-min", stages, microbatches, costs, min_memory_microbatches(stages))


__all__ = [
    "MEMORY_POLICIES",
    "build_half",
    "build_min",
    "build_with_memory",
    "half_memory_microbatches",
    "min_memory_microbatches",
]
