"""Checks a schedule before anything runs it.

:func:`validate_schedule` raises :class:`ValidationError` naming the rank, the op and the reason for:
an op of a stage its rank does not hold, an op outside the microbatches, a missing or duplicated op,
an order on one rank that contradicts a dependency, a cross-rank order that can never make progress
(reporting the cycle of waits), and activation memory above the limit.
"""

from __future__ import annotations

from collections import Counter

from .costs import CostModel, StageCosts, within_limit
from .ir import Kind, Op, Schedule, ScheduleError, dependencies
from .simulate import DeadlockError, Timeline, simulate


class ValidationError(ScheduleError):
    """A schedule failed a check; ``rank`` and ``op`` say where (when known)."""

    def __init__(self, message: str, rank: int | None = None, op: Op | None = None):
        super().__init__(message)
        self.rank = rank
        self.op = op


def validate_schedule(schedule: Schedule, costs: CostModel | StageCosts | None = None) -> Timeline:
    """Check ``schedule`` completely and return its simulated :class:`Timeline`.

    Memory is checked against ``costs.memory_limit`` when costs are given (unit costs otherwise).
    """
    _check_placement(schedule)
    _check_complete(schedule)
    _check_local_order(schedule)
    try:
        timeline = simulate(schedule, costs)
    except DeadlockError as error:
        rank = next(iter(error.waits), None)
        raise ValidationError(str(error), rank, error.waits[rank][0] if rank is not None else None) from None
    _check_memory(timeline)
    return timeline


def _check_placement(schedule: Schedule) -> None:
    S, m = schedule.num_stages, schedule.microbatches
    for rank, op in schedule.ops():
        if not 0 <= op.stage < S:
            raise ValidationError(
                f"rank {rank}: {op} names stage {op.stage}, but there are stages 0..{S - 1}", rank, op
            )
        if not 0 <= op.microbatch < m:
            raise ValidationError(
                f"rank {rank}: {op} names microbatch {op.microbatch}, but there are microbatches 0..{m - 1}",
                rank,
                op,
            )
        owner = schedule.placement.rank_of(op.stage)
        if owner != rank:
            raise ValidationError(
                f"rank {rank}: {op} is of stage {op.stage}, which rank {owner} holds", rank, op
            )


def _check_complete(schedule: Schedule) -> None:
    counts = Counter(op for _, op in schedule.ops())
    location = {op: rank for rank, op in schedule.ops()}
    for op, count in counts.items():
        if count > 1:
            rank = location[op]
            raise ValidationError(
                f"rank {rank}: {op} appears {count} times; every op runs exactly once", rank, op
            )
    rank_of = schedule.placement.rank_of
    for stage in range(schedule.num_stages):
        for j in range(schedule.microbatches):
            rank = rank_of(stage)
            fused, split_b, split_w = (Op(k, stage, j) in counts for k in (Kind.BW, Kind.B, Kind.W))
            if Op(Kind.F, stage, j) not in counts:
                raise ValidationError(
                    f"rank {rank}: {Op(Kind.F, stage, j)} is missing", rank, Op(Kind.F, stage, j)
                )
            if fused and (split_b or split_w):
                raise ValidationError(
                    f"rank {rank}: stage {stage} microbatch {j} has both a fused BW and a split B/W",
                    rank,
                    Op(Kind.BW, stage, j),
                )
            if not fused and not (split_b and split_w):
                missing = Op(Kind.W, stage, j) if split_b else Op(Kind.B, stage, j)
                if not split_b and not split_w:
                    missing = Op(Kind.BW, stage, j)
                raise ValidationError(
                    f"rank {rank}: {missing} is missing (no backward for stage {stage} microbatch {j})",
                    rank,
                    missing,
                )


def _check_local_order(schedule: Schedule) -> None:
    S = schedule.num_stages
    for rank, program in enumerate(schedule.programs):
        position = {op: i for i, op in enumerate(program)}
        for i, op in enumerate(program):
            for role, stage, mb in dependencies(op, S):
                for candidate in (
                    (Op(role, stage, mb), Op(Kind.BW, stage, mb))
                    if role is Kind.B
                    else (Op(role, stage, mb),)
                ):
                    if position.get(candidate, -1) > i:
                        raise ValidationError(
                            f"rank {rank}: {op} (position {i}) comes before {candidate} "
                            f"(position {position[candidate]}), which it depends on",
                            rank,
                            op,
                        )


def _check_memory(timeline: Timeline) -> None:
    limits = timeline.costs.memory_limit
    for rank, trace in enumerate(timeline.memory):
        limit = limits[rank]
        for i, level in enumerate(trace):
            if not within_limit(level, limit):
                op = timeline.schedule.programs[rank][i]
                raise ValidationError(
                    f"rank {rank}: activation memory reaches {level:g} after {op}, above the limit {limit:g}",
                    rank,
                    op,
                )
