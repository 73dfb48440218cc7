"""Refinements of a search's candidates: exact times for paced plans, and a local improvement pass.

**Retiming.**  A pacing planner holds ops back, so its plan's time is only an upper bound and the
search used to rank it by that bound.  :func:`retimed` replays such a plan's op order as the
simulator runs it (every op as soon as its rank and input allow) and ranks it by that exact time,
which is often shorter; the replayed order is the schedule.

**Local improvement.**  A winner built for unit or equalised costs (the authors' squeezed V-Half /
V-Min order, the equalised ZB-V plan) still idles under the real costs on a *critical* rank (one whose
span is the iteration time).  For each such idle gap, largest first, :func:`improve_programs` tries:

* **fill** — the earliest later W of that rank whose B already ran (it only frees memory earlier);
* **pull** — the op the gap waits for, up to ``_PULL_WINDOW`` places earlier on its own rank;
* **chain pull** — one place earlier, an op up the chain of last-arriving inputs that waited for
  its rank rather than its input;
* **defer** — one of the last ``_DEFER_WINDOW`` W ops before the gap moved into it;
* **hoist** — one of the next ``_HOIST_WINDOW`` F or B ops whose input was in when the gap began.

All but fill may hold memory longer.  Each move is replayed on the planning core
(:func:`.core.replay`: the simulator's timing, the validator's memory rule, deadlocks rejected)
and kept only when it lowers the iteration time, or keeps it and lowers the sum of all ranks' spans
(so that a tie between critical ranks can be broken one rank at a time).  The pass stops at the
lower bound, when no move helps, or when its budget of replayed ops is spent, so its cost is
bounded whatever the problem size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from ...costs import StageCosts
from ...ir import Op, Schedule
from .core import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    BuilderCandidate,
    Planned,
    PlanOp,
    PlanState,
    as_plan_ops,
    replay,
)

Programs = list[list[PlanOp]]

#: Relative tolerance below which two times count as equal (float noise of summed costs).
_TOLERANCE = 1e-9

#: Ops one improvement pass may replay: about 100 replays at p = 8, m = 24 (6·p·m ops each).
IMPROVE_BUDGET = 120_000

#: Schedules with more ops are left as they are: a pass there gets fewer than 20 replays, and at
#: p = 32, m = 256 (49,152 ops) it would cost more than the whole search.
IMPROVE_MAX_OPS = 6_144

#: The moves' reach: how far the pull move moves a producer earlier, how many W ops before a gap
#: the defer move tries (the latest first), how many later ops the hoist move looks at.
_PULL_WINDOW = 4
_DEFER_WINDOW = 6
_HOIST_WINDOW = 12


def retimed(candidate: BuilderCandidate, costs: StageCosts, microbatches: int) -> BuilderCandidate:
    """``candidate`` ranked by its exact time: a plan that held ops back is replayed as simulated.

    The replay keeps every rank's op order and starts each op as soon as it can, which is what the
    schedule will do anyway; when that order exceeds the memory limit the held-back plan stays.
    The candidate runs without the search's bound: it would prune on the upper bound, not the
    exact time.
    """

    def run(bound: float) -> Planned | None:
        planned = candidate.run(math.inf)
        if planned is None or planned.exact:
            return planned
        state = replay(costs, microbatches, as_plan_ops(planned.programs()))
        return Planned.of(state, planned.effort) if state is not None else planned

    return BuilderCandidate(candidate.planner, candidate.variant, run)


@dataclass(frozen=True)
class Improved:
    """What a pass found: the replayed plan, its iteration time and the moves and replays it took."""

    state: PlanState
    iteration_time: float
    moves: int
    replays: int


def improve_programs(
    costs: StageCosts,
    microbatches: int,
    programs: Sequence[Sequence[PlanOp]],
    *,
    floor: float = 0.0,
    budget: int = IMPROVE_BUDGET,
) -> Improved | None:
    """Improve fixed per-rank ``programs`` by single-op moves (see the module docstring).

    ``floor`` is a lower bound on the iteration time (the pass stops there); ``budget`` caps the
    ops replayed.  Returns None when the programs cannot run under ``costs`` (deadlock or memory).
    """
    current = [list(program) for program in programs]
    state = replay(costs, microbatches, current)
    if state is None:
        return None
    per_replay = sum(map(len, current))
    score = _score(state)
    moves = replays = 0
    while score[0] > floor * (1 + _TOLERANCE):
        found = None
        for candidate in _candidate_moves(state, current):
            if (replays + 1) * per_replay > budget:
                break
            replays += 1
            trial = replay(costs, microbatches, candidate)
            if trial is not None and _better(_score(trial), score):
                found = candidate, trial
                break
        if found is None:
            break
        current, state = found
        score = _score(state)
        moves += 1
    return Improved(state, score[0], moves, replays)


def improve_schedule(
    schedule: Schedule,
    costs: StageCosts,
    *,
    floor: float = 0.0,
    budget: int = IMPROVE_BUDGET,
    max_ops: int = IMPROVE_MAX_OPS,
) -> Schedule:
    """``schedule`` improved by :func:`improve_programs`, or ``schedule`` itself when no move helps
    (or it has more than ``max_ops`` ops).

    ``costs`` are the planned (resolved, memory-limited) costs.  An improved schedule's
    ``meta["iteration_time"]`` is its new time and ``meta["local_moves"]`` the moves it kept.
    """
    if schedule.num_ops > max_ops:
        return schedule
    improved = improve_programs(
        costs, schedule.microbatches, as_plan_ops(schedule.programs), floor=floor, budget=budget
    )
    if improved is None or improved.moves == 0:
        return schedule
    programs: list[list[Op]] = improved.state.programs_as_ops()
    meta = {**schedule.meta, "iteration_time": improved.iteration_time, "local_moves": improved.moves}
    return replace(Schedule(schedule.name, schedule.placement, schedule.microbatches, programs), meta=meta)


def _score(state: PlanState) -> tuple[float, float]:
    """What the pass minimises: the iteration time, then the sum of the ranks' spans."""
    spans = [state.span(rank) for rank in range(state.p)]
    return max(spans), sum(spans)


def _better(new: tuple[float, float], old: tuple[float, float]) -> bool:
    if new[0] < old[0] * (1 - _TOLERANCE):
        return True
    return new[0] <= old[0] * (1 + _TOLERANCE) and new[1] < old[1] * (1 - _TOLERANCE)


def _op_times(state: PlanState) -> list[list[tuple[float, float]]]:
    """(start, end) of every op of a replayed plan, rank by rank (an op starts when its rank is
    free and its input is in, as in :func:`.core.replay`)."""
    times = []
    durations = (state.f, state.b, state.w)
    for rank, program in enumerate(state.programs):
        clock = state.first_start[rank]
        rank_times = []
        for kind, stage, j in program:
            if kind == FORWARD:
                arrival = state.forward_arrival(stage, j)
            elif kind == BACKWARD:
                arrival = state.backward_arrival(stage, j)
            else:
                arrival = clock
            start = max(clock, arrival)
            clock = start + durations[kind][stage]
            rank_times.append((start, clock))
        times.append(rank_times)
    return times


def _candidate_moves(state: PlanState, programs: Programs) -> Iterator[Programs]:
    """Programs with one op moved, for the gaps of the critical ranks, largest gap first."""
    times = _op_times(state)
    worst = state.iteration_time()
    gaps = []
    for rank in range(state.p):
        if state.span(rank) < worst * (1 - _TOLERANCE):
            continue
        rank_times = times[rank]
        for i in range(1, len(rank_times)):
            idle = rank_times[i][0] - rank_times[i - 1][1]
            if idle > worst * _TOLERANCE:
                gaps.append((idle, rank, i))
    gaps.sort(reverse=True)
    where = {op: (rank, i) for rank, program in enumerate(programs) for i, op in enumerate(program)}
    for _, rank, i in gaps:
        filled = _fill(programs, rank, i, where)
        if filled is not None:
            yield filled
        yield from _pull(state, programs, rank, i, where)
        yield from _chain_pull(state, times, programs, rank, i, where)
        yield from _defer(programs, rank, i)
        yield from _hoist(state, times, programs, rank, i)


def _with_program(programs: Programs, rank: int, program: list[PlanOp]) -> Programs:
    """``programs`` with ``rank``'s program replaced (the others shared, not copied)."""
    return [program if r == rank else other for r, other in enumerate(programs)]


def _fill(programs: Programs, rank: int, i: int, where: dict[PlanOp, tuple[int, int]]) -> Programs | None:
    """Programs with the earliest later W of ``rank`` whose B ran before op ``i`` moved before it."""
    program = programs[rank]
    for k in range(i + 1, len(program)):
        kind, stage, j = program[k]
        if kind == WEIGHT and where[(BACKWARD, stage, j)][1] < i:
            moved = [*program[:i], program[k], *program[i:k], *program[k + 1 :]]
            return _with_program(programs, rank, moved)
    return None


def _pull(
    state: PlanState, programs: Programs, rank: int, i: int, where: dict[PlanOp, tuple[int, int]]
) -> Iterator[Programs]:
    """Programs with the producer of op ``i`` of ``rank`` moved 1.._PULL_WINDOW places earlier on
    its own rank, past ops it does not need."""
    kind, stage, j = programs[rank][i]
    if kind == FORWARD:
        producer = (FORWARD, stage - 1, j) if stage > 0 else None
    elif kind == BACKWARD:
        producer = (BACKWARD, stage + 1, j) if stage + 1 < state.S else None
    else:
        producer = None
    if producer is None or producer not in where:
        return
    other, q = where[producer]
    program = programs[other]
    for target in range(q - 1, max(q - 1 - _PULL_WINDOW, -1), -1):
        if _depends(producer, program[target]):
            return
        moved = [*program[:target], producer, *program[target:q], *program[q + 1 :]]
        yield _with_program(programs, other, moved)


def _depends(op: PlanOp, on: PlanOp) -> bool:
    """Whether ``op`` needs ``on`` (its own input on the same rank)."""
    kind, stage, j = op
    if on[2] != j:
        return False
    if kind == FORWARD:
        return on == (FORWARD, stage - 1, j)
    if kind == BACKWARD:
        return on in ((FORWARD, stage, j), (BACKWARD, stage + 1, j))
    return on == (BACKWARD, stage, j)


def _defer(programs: Programs, rank: int, i: int) -> Iterator[Programs]:
    """Programs with one earlier W of ``rank`` moved into the gap before op ``i`` (latest W first):
    the ops between it and the gap then start earlier where the rank, not an input, held them."""
    program = programs[rank]
    tried = 0
    for k in range(i - 1, -1, -1):
        if tried >= _DEFER_WINDOW:
            return
        if program[k][0] != WEIGHT:
            continue
        tried += 1
        if k == i - 1:
            continue
        moved = [*program[:k], *program[k + 1 : i], program[k], *program[i:]]
        yield _with_program(programs, rank, moved)


def _binding_input(state: PlanState, op: PlanOp) -> PlanOp | None:
    """The input of an F or B that arrived last (None for the first forward and for W ops)."""
    kind, stage, j = op
    if kind == FORWARD:
        return (FORWARD, stage - 1, j) if stage > 0 else None
    if kind != BACKWARD or stage + 1 == state.S:
        return (FORWARD, stage, j) if kind == BACKWARD else None
    from_next = state.b_end[stage + 1][j] + state.hop[stage]
    return (BACKWARD, stage + 1, j) if from_next >= state.f_end[stage][j] else (FORWARD, stage, j)


def _chain_pull(
    state: PlanState,
    times: list[list[tuple[float, float]]],
    programs: Programs,
    rank: int,
    i: int,
    where: dict[PlanOp, tuple[int, int]],
) -> Iterator[Programs]:
    """Follow the gap's wait up its chain of last-arriving inputs; wherever an op on the chain
    waited for its rank (not for its input), yield the programs with it one place earlier, before
    the op that held it."""
    op: PlanOp | None = programs[rank][i]
    for _ in range(2 * state.S):
        op = _binding_input(state, op) if op is not None else None
        if op is None:
            return
        other, q = where[op]
        if q == 0:
            continue
        start, before_end = times[other][q][0], times[other][q - 1][1]
        program = programs[other]
        if start <= before_end + _TOLERANCE * max(start, 1.0) and not _depends(op, program[q - 1]):
            moved = [*program[: q - 1], op, program[q - 1], *program[q + 1 :]]
            yield _with_program(programs, other, moved)


def _ready_at(state: PlanState, op: PlanOp) -> float:
    """When ``op``'s input is on its rank in the replayed plan."""
    kind, stage, j = op
    if kind == FORWARD:
        return state.forward_arrival(stage, j)
    if kind == BACKWARD:
        return state.backward_arrival(stage, j)
    return state.b_end[stage][j]


def _hoist(
    state: PlanState, times: list[list[tuple[float, float]]], programs: Programs, rank: int, i: int
) -> Iterator[Programs]:
    """Programs with a later F or B of ``rank``, whose input was in when the gap began, moved into
    the gap before op ``i`` (it may raise memory: the replay checks the limit)."""
    program = programs[rank]
    gap_start = times[rank][i - 1][1]
    for k in range(i + 1, min(len(program), i + 1 + _HOIST_WINDOW)):
        op = program[k]
        if op[0] == WEIGHT or _ready_at(state, op) > gap_start:
            continue
        if any(_depends(op, between) for between in program[i:k]):
            continue
        moved = [*program[:i], op, *program[i:k], *program[k + 1 :]]
        yield _with_program(programs, rank, moved)
