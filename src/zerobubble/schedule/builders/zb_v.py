"""ZB-V (Qi et al., 2024): two chunks per rank in a V, split backward, searched under p·M_B.

Rank ``r`` holds stage ``r`` (down) and stage ``2p−1−r`` (up), so rank 0 computes the first and the
last chunk.  With equal F, B and W times and no transfer time the V reaches zero bubble once
m ≥ 2p.  The schedule is searched rather than fixed: the equalised planner
(:mod:`.planning.v_equalised`, the authors' strategy), a time-ordered greedy
(:mod:`.planning.v_greedy`, one run per policy of :data:`ZB_V_POLICIES`) and a round planner
(:mod:`.planning.v_rounds`) propose candidates on the shared planning core and the shortest
iteration time wins.  :mod:`.v_memory` runs the same greedy for V-Half and V-Min.

How each planner decides is described in ``docs/schedulers.md``.
"""

from __future__ import annotations

from ..bounds import lower_bound
from ..costs import CostModel
from ..ir import Placement, Schedule, ScheduleError
from .planning import check_one_microbatch_fits, search
from .planning.v_equalised import EqualisedVariant
from .planning.v_greedy import VPolicy, v_candidates
from .planning.v_rounds import _B0, _B1, _F0, _F1, ZB_V_ROUND_VARIANTS

_BACKWARD_FIRST = (_B1, _B0, _F1, _F0)
_CHUNK1_FORWARD_FIRST = (_F1, _B1, _B0, _F0)
_CHUNK1_FIRST = (_B1, _F1, _B0, _F0)

# Greedy candidates for ZB-V, most often best first (a search under an op budget tries a prefix).
ZB_V_POLICIES: tuple[VPolicy, ...] = (
    VPolicy(_BACKWARD_FIRST),
    VPolicy(_BACKWARD_FIRST, alternate=True, guard=True),
    VPolicy(_BACKWARD_FIRST, gap_share=0.0),
    VPolicy(_CHUNK1_FIRST, guard=True),
    VPolicy(_CHUNK1_FORWARD_FIRST, alternate=True, guard=True),
    VPolicy(_CHUNK1_FIRST, guard=True, gap_share=0.75),
    VPolicy(_BACKWARD_FIRST, alternate=True, guard=True, gap_share=0.75),
    VPolicy(_CHUNK1_FORWARD_FIRST, reserve=2),
    VPolicy(_CHUNK1_FIRST, gap_share=0.0),
    VPolicy(_BACKWARD_FIRST, lifespan_slack=6),
    VPolicy(_CHUNK1_FIRST, lifespan_slack=6),
)

#: Op placements one V search may spend (past it, no further candidate starts).  The equalised
#: planner's leading variants fit in it at p = 32, m = 256; smaller problems try everything.
OP_BUDGET = 60_000

# Equalised-planner candidates for ZB-V, most often best first: not filling short gaps before a
# forward wins the paper's deep (p = 32) rows.
ZB_V_EQUALISED_VARIANTS: tuple[EqualisedVariant, ...] = (
    EqualisedVariant(True, False),
    EqualisedVariant(False, False),
    EqualisedVariant(True, True),
    EqualisedVariant(False, True),
)


def build(stages: int, microbatches: int, costs: CostModel, chunks: int = 2) -> Schedule:
    """ZB-V for ``stages`` ranks (two chunks each) under ``costs.memory_limit`` (p·M_B by default).

    The equalised planner's variants come first (they win on realistic costs), then the round
    planner and the greedy; ``Schedule.meta`` names the winner (``planner``, ``variant``).
    """
    if chunks != 2:
        raise ScheduleError(f"zb-v runs exactly 2 chunks per rank (the V); got chunks={chunks}")
    placement = Placement.vshape(stages)
    resolved = costs.resolve(placement)
    check_one_microbatch_fits(resolved, "zb-v")
    floor = lower_bound(stages, microbatches, costs, placement=placement)
    candidates = v_candidates(
        resolved,
        microbatches,
        ZB_V_POLICIES,
        ZB_V_ROUND_VARIANTS,
        ZB_V_EQUALISED_VARIANTS,
        floor=floor,
    )
    return search("zb-v", resolved, microbatches, candidates, OP_BUDGET, floor)
