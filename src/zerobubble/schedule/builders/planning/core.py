"""The planning core the searching builders share: programs under construction, timed as simulated.

A planner (zb-auto's round greedy and list scheduler, the V planners) decides *which* op each rank
runs next; :class:`PlanState` does everything else, once: it appends the op to the rank's program,
times it exactly as :func:`~zerobubble.schedule.simulate.simulate` does (an op starts when its rank
is free and its input has arrived, transfer time included), keeps each rank's activation memory and
peak, its pending W ops (oldest first) and its idle time, and answers the questions every planner
asks: when does an op's input arrive, does an op fit the memory limit, which W ops fill a gap.

Ops are recorded as ``(kind, stage, microbatch)`` tuples and turned into :class:`~...ir.Op` objects
only for the candidate that wins (:meth:`PlanState.programs_as_ops`), because a search builds many
plans and keeps one.  The iteration time of a finished plan equals the simulator's to the last bit.

Memory limits are compared with :func:`~zerobubble.schedule.costs.within_limit`, the validator's rule.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ...costs import StageCosts, memory_cap, within_limit
from ...ir import Kind, Op, Schedule, ScheduleError, coded_ops
from ...simulate import KIND_OF_CODE, simulate

#: Op kinds in plans (plain ints: a plan records hundreds of thousands of them), the simulator's
#: codes (:data:`~...simulate.KIND_OF_CODE`).
FORWARD, BACKWARD, WEIGHT = 0, 1, 2

#: An op in a plan: ``(kind, stage, microbatch)``.
PlanOp = tuple[int, int, int]


class Stuck(Exception):
    """A planner cannot go on: memory is full and no W is pending, or an input it needs is missing.

    Searches catch it and drop the candidate; it never leaves a builder.
    """


class PlanState:
    """Every rank's program so far, with the simulator's clock, memory and pending W ops.

    ``f_end[s][j]`` / ``b_end[s][j]`` are the end times of F and B of stage ``s`` for microbatch
    ``j`` (−1 while not placed).  ``put_forward``/``put_backward``/``put_weight`` append one op;
    they raise :class:`Stuck` when the op's input is not placed yet or memory would pass the limit.
    """

    def __init__(self, costs: StageCosts, microbatches: int) -> None:
        placement = costs.placement
        p, S, m = placement.num_ranks, placement.num_stages, microbatches
        self.costs, self.m, self.p, self.S = costs, m, p, S
        self.rank_of = placement.stage_ranks
        self.f, self.b, self.w = costs.f, costs.b, costs.w
        self.mem_b, self.mem_w = costs.mem_b, costs.mem_w
        self.limit = costs.memory_limit
        self.capacity = [memory_cap(limit) for limit in self.limit]  # the most memory within the limit
        # hop[s]: transfer time between stage s and s + 1 (0 when one rank holds both)
        self.hop = tuple(
            costs.comm[s] if s + 1 < S and self.rank_of[s] != self.rank_of[s + 1] else 0.0 for s in range(S)
        )
        self.f_end = [[-1.0] * m for _ in range(S)]
        self.b_end = [[-1.0] * m for _ in range(S)]
        self.clock = [0.0] * p
        self.first_start = [math.inf] * p
        self.idle = [0.0] * p
        self.max_idle = 0.0
        self.memory = [0.0] * p
        self.peak = [0.0] * p
        self.pending_w: list[deque[int]] = [deque() for _ in range(p)]  # stages; microbatches below
        self.pending_mb: list[deque[int]] = [deque() for _ in range(p)]
        self.releasable = [0.0] * p  # memory the pending W ops of each rank would free
        self.remaining = [costs.rank_work(rank, m) for rank in range(p)]
        self.programs: list[list[PlanOp]] = [[] for _ in range(p)]
        self.held_back = False

    # -- inputs --------------------------------------------------------------------------------

    def forward_arrival(self, stage: int, microbatch: int) -> float:
        """When F(stage, microbatch)'s input is on its rank; −1 when the producer is not placed."""
        if stage == 0:
            return 0.0
        end = self.f_end[stage - 1][microbatch]
        return end + self.hop[stage - 1] if end >= 0 else -1.0

    def backward_arrival(self, stage: int, microbatch: int) -> float:
        """When B(stage, microbatch)'s inputs are in; −1 when one of them is not placed.

        The last stage's B needs only its own forward (which computes the loss).
        """
        own = self.f_end[stage][microbatch]
        if stage == self.S - 1 or own < 0:
            return own
        end = self.b_end[stage + 1][microbatch]
        if end < 0:
            return -1.0
        arrival = end + self.hop[stage]
        return arrival if arrival > own else own

    # -- placing ops ---------------------------------------------------------------------------

    def _start(self, rank: int, arrival: float) -> float:
        clock = self.clock[rank]
        if arrival <= clock:  # the common case: the input is there, the rank is the constraint
            if self.first_start[rank] == math.inf:
                self.first_start[rank] = clock
            return clock
        if self.first_start[rank] == math.inf:
            self.first_start[rank] = arrival
        else:
            idle = self.idle[rank] + arrival - clock
            self.idle[rank] = idle
            if idle > self.max_idle:  # noqa: PLR1730 (hot path: cheaper than a max() call)
                self.max_idle = idle
        return arrival

    def put_forward(self, rank: int, stage: int, microbatch: int, not_before: float = 0.0) -> float:
        """Append F(stage, microbatch) to ``rank``; return its end time.

        ``not_before`` holds the op back (a pacing planner's device); the simulator would start it
        earlier, so a plan that holds an op back sets ``held_back`` and its time is only an upper bound.
        """
        arrival = self.forward_arrival(stage, microbatch)
        if arrival < 0:
            raise Stuck
        if not_before > arrival and not_before > self.clock[rank]:
            arrival = not_before
            self.held_back = True
        # the memory check and _start inlined: this and put_backward run for every op of every candidate
        level = self.memory[rank] + self.mem_b[stage]
        if level > self.capacity[rank]:
            raise Stuck
        self.memory[rank] = level
        if level > self.peak[rank]:  # noqa: PLR1730 (hot path: cheaper than a max() call)
            self.peak[rank] = level
        clock = self.clock[rank]
        if arrival <= clock and self.first_start[rank] != math.inf:
            start = clock
        else:
            start = self._start(rank, arrival)
        duration = self.f[stage]
        end = start + duration
        self.clock[rank] = end
        self.remaining[rank] -= duration
        self.f_end[stage][microbatch] = end
        self.programs[rank].append((FORWARD, stage, microbatch))
        return end

    def put_backward(self, rank: int, stage: int, microbatch: int) -> float:
        """Append B(stage, microbatch) to ``rank`` and queue its W; return its end time."""
        # backward_arrival, _grow and _start inlined (the hot path of every planner)
        arrival = self.f_end[stage][microbatch]
        if arrival < 0:
            raise Stuck
        if stage != self.S - 1:
            end = self.b_end[stage + 1][microbatch]
            if end < 0:
                raise Stuck
            end += self.hop[stage]
            if end > arrival:  # noqa: PLR1730 (hot path: cheaper than a max() call)
                arrival = end
        change = self.mem_w[stage] - self.mem_b[stage]
        level = self.memory[rank] + change
        if change > 0:
            if level > self.capacity[rank]:
                raise Stuck
            if level > self.peak[rank]:  # noqa: PLR1730
                self.peak[rank] = level
        self.memory[rank] = level
        clock = self.clock[rank]
        if arrival <= clock and self.first_start[rank] != math.inf:
            start = clock
        else:
            start = self._start(rank, arrival)
        duration = self.b[stage]
        end = start + duration
        self.clock[rank] = end
        self.remaining[rank] -= duration
        self.b_end[stage][microbatch] = end
        self.pending_w[rank].append(stage)
        self.pending_mb[rank].append(microbatch)
        self.releasable[rank] += self.mem_w[stage]
        self.programs[rank].append((BACKWARD, stage, microbatch))
        return end

    def put_weight(self, rank: int, arrival: float = 0.0) -> float:
        """Append the oldest pending W of ``rank`` (no earlier than ``arrival``); return its end."""
        pending = self.pending_w[rank]
        if not pending:
            raise Stuck
        stage = pending.popleft()
        microbatch = self.pending_mb[rank].popleft()
        # _place_weight and _start inlined for the common case: the rank is busy until now
        clock = self.clock[rank]
        if arrival > clock or self.first_start[rank] == math.inf:
            return self._place_weight(rank, stage, microbatch, arrival)
        release = self.mem_w[stage]
        self.memory[rank] -= release
        self.releasable[rank] -= release
        duration = self.w[stage]
        end = clock + duration
        self.clock[rank] = end
        self.remaining[rank] -= duration
        self.programs[rank].append((WEIGHT, stage, microbatch))
        return end

    def put_given_weight(self, rank: int, stage: int, microbatch: int) -> float:
        """Append W(stage, microbatch), pending on ``rank`` (not necessarily its oldest W)."""
        stages, microbatches = self.pending_w[rank], self.pending_mb[rank]
        if stages and stages[0] == stage and microbatches[0] == microbatch:
            return self.put_weight(rank)  # the common case: the oldest
        for index, (pending_stage, pending_mb) in enumerate(zip(stages, microbatches)):
            if pending_stage == stage and pending_mb == microbatch:
                del stages[index], microbatches[index]
                return self._place_weight(rank, stage, microbatch, 0.0)
        raise Stuck

    def _place_weight(self, rank: int, stage: int, microbatch: int, arrival: float) -> float:
        release = self.mem_w[stage]
        self.memory[rank] -= release
        self.releasable[rank] -= release
        duration = self.w[stage]
        end = self._start(rank, arrival) + duration
        self.clock[rank] = end
        self.remaining[rank] -= duration
        self.programs[rank].append((WEIGHT, stage, microbatch))
        return end

    # -- W ops and memory ----------------------------------------------------------------------

    def has_weight(self, rank: int) -> bool:
        """Whether ``rank`` has a W op waiting."""
        return bool(self.pending_w[rank])

    def fits(self, rank: int, growth: float) -> bool:
        """Whether ``rank``'s memory stays within its limit after growing by ``growth``."""
        return self.memory[rank] + growth <= self.capacity[rank]

    def can_make_room(self, rank: int, growth: float) -> bool:
        """Whether running all pending W ops first would make ``growth`` fit."""
        return self.memory[rank] + growth - self.releasable[rank] <= self.capacity[rank]

    def make_room(self, rank: int, growth: float) -> None:
        """Run W ops until ``growth`` fits (raises :class:`Stuck` when they cannot make room)."""
        capacity = self.capacity[rank]
        while self.memory[rank] + growth > capacity:
            self.put_weight(rank)

    def fill_gap(self, rank: int, until: float, share: float = 1.0) -> None:
        """Run pending W ops while the next one ends by ``until`` (``share`` < 1: while that share
        of it does), so a wait for an input does useful work."""
        pending, w = self.pending_w[rank], self.w
        while pending and self.clock[rank] + w[pending[0]] * share <= until:
            self.put_weight(rank)

    def drain(self, rank: int) -> None:
        """Run all of ``rank``'s pending W ops."""
        while self.pending_w[rank]:
            self.put_weight(rank)

    # -- results -------------------------------------------------------------------------------

    def span(self, rank: int) -> float:
        """Time from ``rank``'s first op's start to its last op's end (0 before its first op)."""
        start = self.first_start[rank]
        return self.clock[rank] - start if start != math.inf else 0.0

    def cannot_beat(self, rank: int, bound: float) -> bool:
        """Whether ``rank``'s span is sure to end above ``bound`` (its span plus remaining work)."""
        return self.span(rank) + self.remaining[rank] > bound * (1 + 1e-12)

    @property
    def placed(self) -> int:
        """Ops placed so far on all ranks."""
        return sum(map(len, self.programs))

    def iteration_time(self) -> float:
        """Max over ranks of its span: equals ``simulate(...).iteration_time`` of the programs."""
        return max(self.span(rank) for rank in range(self.p))

    def programs_as_ops(self) -> list[list[Op]]:
        """The programs as :class:`~...ir.Op` lists (built once, for the winning candidate)."""
        return [coded_ops(program, KIND_OF_CODE) for program in self.programs]


def schedule_meta(
    costs: StageCosts, iteration_time: float, planner: str, variant: str, candidates: int, **extra: Any
) -> dict[str, Any]:
    """The ``Schedule.meta`` every searching builder writes (one schema for all of them).

    ``memory_limit`` is the per-rank limit planned for (absolute; ``None`` where unlimited),
    ``memory_limit_mb`` the largest finite one in units of one rank-stage's M_B (``None`` when
    unlimited), ``planner`` and ``variant`` what the search chose, ``iteration_time`` its simulated
    iteration time and ``candidates`` how many candidates it compared; ``extra`` adds builder keys.
    """
    limits = [limit if math.isfinite(limit) else None for limit in costs.memory_limit]
    finite = [limit for limit in limits if limit is not None]
    return {
        "memory_limit": limits,
        "memory_limit_mb": max(finite) / costs.memory_unit if finite else None,
        "planner": planner,
        "variant": variant,
        "iteration_time": iteration_time,
        "candidates": candidates,
        **extra,
    }


def one_microbatch_peak(costs: StageCosts, rank: int) -> float:
    """Peak memory of ``rank`` running one microbatch alone: its forwards, then each backward
    followed by its W.  No schedule of the placement needs less."""
    stages = costs.placement.stages_of(rank)
    level = peak = 0.0
    for stage in stages:
        level += costs.mem_b[stage]
        peak = max(peak, level)
    for stage in reversed(stages):
        level += costs.mem_w[stage] - costs.mem_b[stage]
        peak = max(peak, level)
        level -= costs.mem_w[stage]
    return peak


def check_one_microbatch_fits(costs: StageCosts, name: str) -> None:
    """Raise :class:`ScheduleError` when some rank's limit cannot hold one microbatch alone."""
    for rank in range(costs.placement.num_ranks):
        need, limit = one_microbatch_peak(costs, rank), costs.memory_limit[rank]
        if not within_limit(need, limit):
            raise ScheduleError(
                f"{name}: memory limit {limit:g} on rank {rank} is below the {need:g} one microbatch needs "
                f"there (its activations on every stage the rank holds); raise the memory limit to at "
                f"least {need:g}"
            )


@dataclass(frozen=True)
class Planned:
    """A finished candidate: its iteration time, peak memory, work spent and programs (made on demand).

    ``exact`` is False when the time is only an upper bound (a plan that held ops back), so the
    builder simulates the winner once more.
    """

    iteration_time: float
    peak: float
    effort: int
    programs: Callable[[], list[list[Op]]]
    exact: bool = True

    @classmethod
    def of(cls, plan: PlanState, effort: int | None = None) -> Planned:
        """The result of a finished :class:`PlanState`."""
        return cls(
            plan.iteration_time(),
            max(plan.peak),
            plan.placed if effort is None else effort,
            plan.programs_as_ops,
            not plan.held_back,
        )


@dataclass(frozen=True)
class BuilderCandidate:
    """One way to plan: ``run(bound)`` returns a :class:`Planned`, or None when the candidate gets
    stuck or is sure not to beat ``bound`` (the best iteration time so far)."""

    planner: str
    variant: str
    run: Callable[[float], Planned | None]


def replay(costs: StageCosts, microbatches: int, programs: Sequence[Sequence[PlanOp]]) -> PlanState | None:
    """Place fixed per-rank programs in order, each op as soon as its input is placed: the
    simulator's event loop on the planning core.  None when they deadlock or exceed the limit."""
    state = PlanState(costs, microbatches)
    p = costs.placement.num_ranks
    position = [0] * p
    waiting: dict[PlanOp, list[int]] = {}
    runnable = list(range(p))
    f_end, b_end = state.f_end, state.b_end
    try:
        while runnable:
            rank = runnable.pop()
            program, i = programs[rank], position[rank]
            while i < len(program):
                kind, stage, j = program[i]
                if kind == FORWARD:
                    missing = (FORWARD, stage - 1, j) if stage and f_end[stage - 1][j] < 0 else None
                elif kind == BACKWARD:
                    missing = (FORWARD, stage, j) if f_end[stage][j] < 0 else None
                    if missing is None and stage + 1 < state.S and b_end[stage + 1][j] < 0:
                        missing = (BACKWARD, stage + 1, j)
                else:
                    missing = (BACKWARD, stage, j) if b_end[stage][j] < 0 else None
                if missing is not None:
                    waiting.setdefault(missing, []).append(rank)
                    break
                if kind == FORWARD:
                    state.put_forward(rank, stage, j)
                elif kind == BACKWARD:
                    state.put_backward(rank, stage, j)
                else:
                    state.put_given_weight(rank, stage, j)
                woken = waiting.pop((kind, stage, j), None) if kind != WEIGHT else None
                if woken:
                    runnable.extend(woken)
                i += 1
            position[rank] = i
    except Stuck:
        return None
    if any(position[rank] < len(programs[rank]) for rank in range(p)):
        return None
    return state


def as_plan_ops(programs: Sequence[Sequence[Op]]) -> list[list[PlanOp]]:
    """Programs of :class:`~...ir.Op` (split backward only) as the core's ``(kind, stage, mb)``."""
    kinds = {Kind.F: FORWARD, Kind.B: BACKWARD, Kind.W: WEIGHT}
    return [[(kinds[op.kind], op.stage, op.microbatch) for op in program] for program in programs]


def fixed_candidate(
    planner: str,
    variant: str,
    costs: StageCosts,
    microbatches: int,
    make_programs: Callable[[], Sequence[Sequence[PlanOp]]],
) -> BuilderCandidate:
    """Fixed programs (a pattern, a block, a handcrafted schedule) as a candidate, timed by
    :func:`replay`; skipped when they exceed the memory limit or cannot run."""

    def run(bound: float) -> Planned | None:
        plan = replay(costs, microbatches, make_programs())
        return Planned.of(plan) if plan is not None else None

    return BuilderCandidate(planner, variant, run)


def _better(new: Planned, best: Planned | None) -> bool:
    """Shorter iteration time wins; on a tie, lower peak memory."""
    if best is None:
        return True
    tol = 1e-9
    if new.iteration_time < best.iteration_time * (1 - tol):
        return True
    return new.iteration_time <= best.iteration_time * (1 + tol) and new.peak < best.peak * (1 - tol)


def search(
    name: str,
    costs: StageCosts,
    microbatches: int,
    candidates: Iterable[BuilderCandidate],
    op_budget: float = math.inf,
    floor: float = 0.0,
    **extra_meta: Any,
) -> Schedule:
    """Run ``candidates`` in order and return the schedule of the one with the shortest iteration time.

    The search stops early once the best candidate reaches ``floor`` (a lower bound on every
    schedule's iteration time: nothing can beat it) or once ``op_budget`` op placements are spent
    (at least one candidate always runs).  ``Schedule.meta`` follows :func:`schedule_meta`.
    """
    best: Planned | None = None
    chosen: BuilderCandidate | None = None
    tried = spent = 0
    ops_per_run = 3 * costs.placement.num_stages * microbatches
    for candidate in candidates:
        if best is not None and (spent >= op_budget or best.iteration_time <= floor * (1 + 1e-9)):
            break
        tried += 1
        planned = candidate.run(best.iteration_time if best is not None else math.inf)
        spent += planned.effort if planned is not None else ops_per_run
        if planned is not None and _better(planned, best):
            best, chosen = planned, candidate
    if best is None or chosen is None:
        raise ScheduleError(f"{name}: no candidate schedule fits the memory limit")
    schedule = Schedule(name, costs.placement, microbatches, best.programs())
    iteration = best.iteration_time if best.exact else simulate(schedule, costs).iteration_time
    meta = schedule_meta(costs, iteration, chosen.planner, chosen.variant, tried, **extra_meta)
    return replace(schedule, meta=meta)
