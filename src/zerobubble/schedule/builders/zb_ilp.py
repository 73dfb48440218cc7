"""Optimal zero-bubble schedules from the paper's integer program (Qi et al., 2024, Appendix G).

One stage per rank, split B and W.  For every pair of ops on a rank whose order is not already
implied, a binary decides which runs first; continuous variables give every op's end time.  Rows
encode the dependencies, one op at a time (per-pair big-M from time windows), the memory limit after
each F, and the objective (the iteration time).  Orders implied by dependencies, memory and time
windows are fixed up front, so the program stays small.  The incumbent (the best heuristic schedule)
bounds the objective and is the fallback; the analytic lower bound and the LP relaxation often prove
it optimal before any MILP runs.  HiGHS solves through ``scipy.optimize.milp``.

The derivation, the ``Schedule.meta`` fields and the measured solve times are in ``docs/ilp.md``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds

from ..bounds import lower_bound
from ..costs import CostModel, StageCosts, memory_cap
from ..ir import B, F, Kind, Op, Placement, Schedule, ScheduleError, W, check_positive
from ..simulate import Timeline
from ..validate import validate_schedule
from . import build_schedule
from .planning import check_one_microbatch_fits
from .planning.ilp_program import (
    RELATIVE_GAP,
    PairIndex,
    Program,
    Rows,
    closure,
    covering_pairs,
    local_index,
    structural_successors,
)

_INCUMBENT_BUILDERS = ("zb-auto", "zb-h1", "zb-h2", "1f1b")
_WINDOW_ROUNDS = 20
_MAX_PAIRS = 100_000
_HIGHS_STATUS = {0: "optimal", 1: "time_limit", 2: "infeasible", 3: "unbounded", 4: "error"}


def build(
    stages: int, microbatches: int, costs: CostModel, chunks: int = 1, time_limit: float = 60.0
) -> Schedule:
    """The iteration-time-optimal split-backward schedule of a loop pipeline, within ``time_limit``.

    ``costs.memory_limit`` bounds every rank's activation memory (the registry defaults it to
    2p·M_B).  ``time_limit`` (seconds) caps the whole build; when it runs out the best schedule
    found so far is returned and ``meta["optimal"]`` says whether it is proven optimal.
    """
    started = time.perf_counter()
    check_positive(stages=stages, microbatches=microbatches)
    if chunks != 1:
        raise ScheduleError(f"zb-ilp places one stage per rank; it cannot take chunks={chunks}")
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not time_limit > 0:
        raise ScheduleError(f"time_limit must be a positive number of seconds, got {time_limit!r}")
    placement = Placement.loop(stages)
    resolved = costs.resolve(placement)
    check_one_microbatch_fits(resolved, "zb-ilp")
    incumbent = _best_incumbent(stages, microbatches, costs, resolved)
    analytic = lower_bound(stages, microbatches, costs)
    best, solve = incumbent, _Solve(status="bound", dual_bound=analytic, binaries=0)
    pairs = 3 * stages * microbatches * (microbatches - 1) // 2
    if incumbent.timeline.iteration_time <= analytic * (1 + RELATIVE_GAP):
        pass
    elif pairs > _MAX_PAIRS:
        solve = _Solve(status="too_large", dual_bound=analytic, binaries=0)
    else:
        model = _OrderModel(resolved, microbatches, incumbent.timeline.iteration_time, analytic)
        remaining = max(1.0, float(time_limit) - (time.perf_counter() - started))
        programs, solve = model.solve(remaining)
        best = _better(incumbent, programs, placement, microbatches, costs)
    return _finish(best, incumbent, solve, analytic, resolved, time.perf_counter() - started)


@dataclass(frozen=True)
class _IlpCandidate:
    """A schedule, its simulated timeline and where it came from."""

    schedule: Schedule
    timeline: Timeline
    source: str


@dataclass(frozen=True)
class _Solve:
    """What the solver reported: status, proven bound on the iteration time, model size."""

    status: str
    dual_bound: float
    binaries: int


def _split_backward(program: tuple[Op, ...]) -> list[Op]:
    """Replace each fused BW by B then W (same times, same memory peaks)."""
    ops: list[Op] = []
    for op in program:
        ops.extend((B(op.stage, op.microbatch), W(op.stage, op.microbatch)) if op.kind is Kind.BW else (op,))
    return ops


def _sequential_programs(stages: int, microbatches: int) -> list[list[Op]]:
    """One microbatch at a time: fits any limit that holds one microbatch."""
    return [[op for j in range(microbatches) for op in (F(r, j), B(r, j), W(r, j))] for r in range(stages)]


def _relabel(programs: list[list[Op]]) -> list[list[Op]]:
    """Number each rank's ops of one kind in execution order (the k-th F is microbatch k, ...).

    Every dependency and memory level still holds at the same times (a sorted matching is always
    feasible when any matching is), so the simulated schedule is no slower, and it satisfies the
    program's symmetry breaking.
    """
    relabelled = []
    for program in programs:
        seen = {Kind.F: 0, Kind.B: 0, Kind.W: 0}
        ops = []
        for op in program:
            ops.append(Op(op.kind, op.stage, seen[op.kind]))
            seen[op.kind] += 1
        relabelled.append(ops)
    return relabelled


def _best_incumbent(stages: int, microbatches: int, costs: CostModel, resolved: StageCosts) -> _IlpCandidate:
    """The best validated schedule of the cheaper builders that fits the memory limit."""
    placement = Placement.loop(stages)
    found = []
    for name in _INCUMBENT_BUILDERS:
        try:
            schedule = build_schedule(name, stages, microbatches, costs, validate=True)
        except ScheduleError:
            continue
        found.append((_relabel([_split_backward(program) for program in schedule.programs]), name))
    found.append((_sequential_programs(stages, microbatches), "sequential"))
    candidates = []
    for programs, source in found:
        schedule = Schedule("zb-ilp", placement, microbatches, programs)
        try:
            candidates.append(_IlpCandidate(schedule, validate_schedule(schedule, resolved), source))
        except ScheduleError:
            continue
    # The sequential schedule always fits once one microbatch does (checked before), so this is
    # never empty.
    return min(candidates, key=lambda candidate: candidate.timeline.iteration_time)


def _better(
    incumbent: _IlpCandidate,
    programs: list[list[Op]] | None,
    placement: Placement,
    microbatches: int,
    costs: CostModel,
) -> _IlpCandidate:
    """The solver's schedule when it validates and is at least as fast as the incumbent."""
    if programs is None:
        return incumbent
    schedule = Schedule("zb-ilp", placement, microbatches, programs)
    try:
        timeline = validate_schedule(schedule, costs)
    except ScheduleError:
        return incumbent
    if timeline.iteration_time <= incumbent.timeline.iteration_time:
        return _IlpCandidate(schedule, timeline, "ilp")
    return incumbent


def _finish(
    best: _IlpCandidate,
    incumbent: _IlpCandidate,
    solve: _Solve,
    analytic: float,
    costs: StageCosts,
    seconds: float,
) -> Schedule:
    achieved = best.timeline.iteration_time
    bound = min(max(analytic, solve.dual_bound), achieved)
    limits = [limit if math.isfinite(limit) else None for limit in costs.memory_limit]
    meta = {
        "lower_bound": bound,
        "optimal": achieved <= max(analytic, solve.dual_bound) * (1 + 2 * RELATIVE_GAP),
        "solver_status": solve.status,
        "time": seconds,
        "iteration_time": achieved,
        "source": best.source,
        "incumbent": incumbent.source,
        "incumbent_iteration_time": incumbent.timeline.iteration_time,
        "binaries": solve.binaries,
        "memory_limit": limits,
    }
    schedule = best.schedule
    return Schedule("zb-ilp", schedule.placement, schedule.microbatches, schedule.programs, meta)


class _OrderModel:
    """The integer program for one pipeline, built from per-rank precedence matrices.

    Ops of a rank are indexed locally ``F_j = j``, ``B_j = m + j``, ``W_j = 2m + j``; rank ``r``'s
    op ``k`` is variable ``r·3m + k`` (its end time), ``T`` follows, then one binary per undecided
    pair.  Times are divided by the incumbent's iteration time.
    """

    def __init__(
        self, costs: StageCosts, microbatches: int, upper: float, lower: float, strengthen: bool = True
    ):
        self.costs = costs
        self.m = microbatches
        self.p = costs.placement.num_ranks
        self.n = 3 * microbatches
        self.scale = upper
        self.strengthen = strengthen
        self.upper = 1.0 + 1e-9
        self.lower = min(lower / upper, 1.0)
        self.duration = (
            np.array([self._rank_vector(r, costs.f, costs.b, costs.w) for r in range(self.p)]) / upper
        )
        delta_b = [-(mb - mw) for mb, mw in zip(costs.mem_b, costs.mem_w)]
        delta_w = [-mw for mw in costs.mem_w]
        self.memory_unit = costs.memory_unit
        deltas = [self._rank_vector(r, costs.mem_b, delta_b, delta_w) for r in range(self.p)]
        self.delta = np.array(deltas) / self.memory_unit
        self.first_start = self._first_starts()
        self.precedes = [self._initial_order(r) for r in range(self.p)]
        self.earliest = np.zeros((self.p, self.n))
        self.latest = np.zeros((self.p, self.n))
        self.feasible = self._fix_by_windows() if strengthen else self._check_windows()

    def _rank_vector(
        self, rank: int, f: Sequence[float], b: Sequence[float], w: Sequence[float]
    ) -> np.ndarray:
        return np.repeat([f[rank], b[rank], w[rank]], self.m).astype(float)

    def _first_starts(self) -> np.ndarray:
        """Start of F(s,0): microbatch 0's forward chain (each rank's first op starts as early as it can)."""
        starts = np.zeros(self.p)
        for s in range(1, self.p):
            starts[s] = starts[s - 1] + self.duration[s - 1, 0] + self.costs.comm[s - 1] / self.scale
        return starts

    def _initial_order(self, rank: int) -> np.ndarray:
        """Precedence forced by dependencies, symmetry breaking and memory, transitively closed."""
        m, n = self.m, self.n
        order = np.zeros((n, n), dtype=bool)
        for j in range(m):
            order[j, m + j] = order[m + j, 2 * m + j] = True
            if j + 1 < m:
                order[j, j + 1] = order[m + j, m + j + 1] = order[2 * m + j, 2 * m + j + 1] = True
        for i, (backwards, weights) in enumerate(self._memory_minimums(rank) if self.strengthen else ()):
            order[m : m + backwards, i] = True
            order[2 * m : 2 * m + weights, i] = True
        return closure(order)

    def _memory_minimums(self, rank: int) -> list[tuple[int, int]]:
        """For each F_i, how many B and W ops must precede it so that memory stays in the limit."""
        mem_b, mem_w = self.costs.mem_b[rank], self.costs.mem_w[rank]
        limit = memory_cap(self.costs.memory_limit[rank])
        result = []
        for i in range(self.m):
            backwards = (
                0
                if mem_b <= 0 or not math.isfinite(limit)
                else max(0, math.ceil(i + 1 - limit / mem_b - 1e-9))
            )
            weights = 0
            if mem_w > 0 and math.isfinite(limit):
                weights = max(0, math.ceil((mem_b + i * mem_w - limit) / mem_w - 1e-9))
            result.append((min(backwards, i), min(weights, i)))
        return result

    def _cross_rank(self) -> list[tuple[int, int, int, int, float]]:
        """Dependencies between ranks as ``(rank_u, k_u, rank_v, k_v, transfer time)``."""
        m, edges = self.m, []
        for s in range(self.p - 1):
            delay = self.costs.comm[s] / self.scale
            for j in range(m):
                edges.append((s, j, s + 1, j, delay))
                edges.append((s + 1, m + j, s, m + j, delay))
        return edges

    def _windows(self) -> None:
        """Earliest start and latest end of every op under the current precedence and the bound."""
        d = self.duration
        before = np.array([self.precedes[r].T.astype(float) @ d[r] for r in range(self.p)])
        after = np.array([self.precedes[r].astype(float) @ d[r] for r in range(self.p)])
        earliest = self.first_start[:, None] + before
        latest = self.first_start[:, None] + self.upper - after
        latest[:, 0] = self.first_start + d[:, 0]
        edges = self._cross_rank()
        for _ in range(3 * self.n * self.p + 1):
            changed = False
            for r in range(self.p):
                finish = np.where(self.precedes[r], (earliest[r] + d[r])[:, None], -np.inf).max(axis=0)
                improved = np.maximum(earliest[r], finish)
                changed |= bool(np.any(improved > earliest[r] + 1e-12))
                earliest[r] = improved
                start = np.where(self.precedes[r], (latest[r] - d[r])[None, :], np.inf).min(axis=1)
                tightened = np.minimum(latest[r], start)
                changed |= bool(np.any(tightened < latest[r] - 1e-12))
                latest[r] = tightened
            for ru, ku, rv, kv, delay in edges:
                if earliest[ru, ku] + d[ru, ku] + delay > earliest[rv, kv] + 1e-12:
                    earliest[rv, kv] = earliest[ru, ku] + d[ru, ku] + delay
                    changed = True
                if latest[rv, kv] - d[rv, kv] - delay < latest[ru, ku] - 1e-12:
                    latest[ru, ku] = latest[rv, kv] - d[rv, kv] - delay
                    changed = True
            if not changed:
                break
        self.earliest, self.latest = earliest, latest

    def _fix_by_windows(self) -> bool:
        """Decide pairs whose one order cannot fit the time windows; False if the bound is infeasible."""
        for _ in range(_WINDOW_ROUNDS):
            self._windows()
            end_earliest = self.earliest + self.duration
            start_latest = self.latest - self.duration
            if np.any(end_earliest > self.latest + 1e-9):
                return False
            changed = False
            for r in range(self.p):
                order = self.precedes[r]
                free = ~(order | order.T)
                np.fill_diagonal(free, False)
                # v cannot precede u when v's earliest end is after u's latest start.
                impossible = end_earliest[r][None, :] > start_latest[r][:, None] + 1e-9
                forced = free & impossible
                if np.any(forced & forced.T):
                    return False
                if np.any(forced):
                    self.precedes[r] = closure(order | forced)
                    changed = True
            if not changed:
                return True
        return True

    def _check_windows(self) -> bool:
        self._windows()
        return not np.any(self.earliest + self.duration > self.latest + 1e-9)

    def pairs(self, rank: int) -> list[tuple[int, int]]:
        """Undecided pairs ``(u, v)``, ``u < v``, of one rank."""
        order = self.precedes[rank]
        free = ~(order | order.T)
        return [(int(u), int(v)) for u, v in zip(*np.nonzero(np.triu(free, 1)))]

    def formulate(self) -> Program:
        """The program as arrays for :func:`scipy.optimize.milp`."""
        rows = Rows()
        pair_index = self._pair_variables()
        binaries = len(pair_index)
        self._dependency_rows(rows)
        self._disjunction_rows(rows, pair_index)
        self._memory_rows(rows, pair_index)
        if self.strengthen:
            self._monotone_rows(rows, pair_index)
            self._work_rows(rows, pair_index)
        self._objective_rows(rows)
        size = self.p * self.n + 1 + binaries
        objective = np.zeros(size)
        objective[self.p * self.n] = 1.0
        lower = np.concatenate([(self.earliest + self.duration).ravel(), [self.lower], np.zeros(binaries)])
        upper = np.concatenate([self.latest.ravel(), [self.upper], np.ones(binaries)])
        integrality = np.concatenate([np.zeros(self.p * self.n + 1), np.ones(binaries)])
        return Program(
            objective, integrality, Bounds(lower, np.maximum(lower, upper)), rows.constraint(size), pair_index
        )

    def encode(self, programs: list[list[Op]], ends: list[list[float]], iteration_time: float) -> np.ndarray:
        """A known schedule as a point of the program (to check that the program admits it)."""
        pair_index = self._pair_variables()
        point = np.zeros(self.p * self.n + 1 + len(pair_index))
        point[self.p * self.n] = iteration_time / self.scale
        for r, (program, rank_ends) in enumerate(zip(programs, ends)):
            position = {}
            for index, (op, end) in enumerate(zip(program, rank_ends)):
                local = local_index(op, self.m)
                position[local] = index
                point[self._variable(r, local)] = end / self.scale
            for (rank, u, v), var in pair_index.items():
                if rank == r:
                    point[var] = 1.0 if position[u] < position[v] else 0.0
        return point

    def solve(self, time_limit: float) -> tuple[list[list[Op]] | None, _Solve]:
        """Run HiGHS: the relaxation first (its bound may already close the gap), then the MILP.

        Returns each rank's program (or None) and the solver's report.
        """
        if not self.feasible:
            return None, _Solve("bound_infeasible", self.lower * self.scale, 0)
        deadline = time.perf_counter() + time_limit
        program = self.formulate()
        binaries = len(program.pair_index)
        relaxation = program.run(np.zeros_like(program.integrality), time_limit)
        bound = max(self.lower, relaxation.fun) if relaxation.status == 0 else self.lower
        if bound >= self.upper * (1 - RELATIVE_GAP):
            return None, _Solve("relaxation_bound", bound * self.scale, binaries)
        if time.perf_counter() >= deadline:
            return None, _Solve("time_limit", bound * self.scale, binaries)
        result = program.run(program.integrality, max(0.1, deadline - time.perf_counter()))
        dual = getattr(result, "mip_dual_bound", None)
        if dual is not None and math.isfinite(dual):
            bound = max(bound, dual)
        if result.status == 0:
            bound = max(bound, result.fun * (1 - RELATIVE_GAP))
        report = _Solve(_HIGHS_STATUS.get(result.status, "error"), bound * self.scale, binaries)
        if result.x is None:
            return None, report
        return self._programs(result.x, program.pair_index), report

    def _variable(self, rank: int, k: int) -> int:
        return rank * self.n + k

    def _pair_variables(self) -> dict[tuple[int, int, int], int]:
        base = self.p * self.n + 1
        index: dict[tuple[int, int, int], int] = {}
        for r in range(self.p):
            for u, v in self.pairs(r):
                index[(r, u, v)] = base + len(index)
        return index

    def _before(self, pair_index: PairIndex, rank: int, a: int, b: int) -> tuple[int, float, float] | None:
        """``[a before b]`` as ``(variable, coefficient, constant)``, or None when decided."""
        if a < b and (rank, a, b) in pair_index:
            return pair_index[(rank, a, b)], 1.0, 0.0
        if b < a and (rank, b, a) in pair_index:
            return pair_index[(rank, b, a)], -1.0, 1.0
        return None

    def _dependency_rows(self, rows: Rows) -> None:
        d = self.duration
        for ru, ku, rv, kv, delay in self._cross_rank():
            rows.add({self._variable(rv, kv): 1.0, self._variable(ru, ku): -1.0}, d[rv, kv] + delay, math.inf)
        for r in range(self.p):
            for u, v in covering_pairs(self.precedes[r]):
                rows.add({self._variable(r, v): 1.0, self._variable(r, u): -1.0}, d[r, v], math.inf)

    def _disjunction_rows(self, rows: Rows, pair_index: PairIndex) -> None:
        d, early, late = self.duration, self.earliest, self.latest
        for (r, u, v), x in pair_index.items():
            eu, ev = self._variable(r, u), self._variable(r, v)
            # x = 1: u first, so start(v) >= end(u); big-M covers end(u) - start(v) otherwise.
            big_uv = max(0.0, late[r, u] - early[r, v])
            rows.add({ev: 1.0, eu: -1.0, x: -big_uv}, d[r, v] - big_uv, math.inf)
            big_vu = max(0.0, late[r, v] - early[r, u])
            rows.add({eu: 1.0, ev: -1.0, x: big_vu}, d[r, u], math.inf)

    def _monotone_rows(self, rows: Rows, pair_index: PairIndex) -> None:
        m = self.m
        for r, u, v in list(pair_index):
            for first, second in ((u, v), (v, u)):
                for after in structural_successors(second, m):
                    implied = self._before(pair_index, r, first, after)
                    given = self._before(pair_index, r, first, second)
                    if implied is None or given is None:
                        continue
                    coefficients: dict[int, float] = {}
                    for var, coef in ((given[0], given[1]), (implied[0], -implied[1])):
                        coefficients[var] = coefficients.get(var, 0.0) + coef
                    rows.add(coefficients, -math.inf, implied[2] - given[2])

    def _memory_rows(self, rows: Rows, pair_index: PairIndex) -> None:
        for r in range(self.p):
            limit = memory_cap(self.costs.memory_limit[r])
            if not math.isfinite(limit):
                continue
            limit /= self.memory_unit
            order, delta = self.precedes[r], self.delta[r]
            for k in range(self.m):
                level = delta[k] + float(order[:, k] @ delta)
                coefficients: dict[int, float] = {}
                for u in np.nonzero(~(order[:, k] | order[k, :]))[0]:
                    term = self._before(pair_index, r, int(u), k)
                    if term is None:
                        continue
                    coefficients[term[0]] = coefficients.get(term[0], 0.0) + term[1] * delta[u]
                    level += term[2] * delta[u]
                positive = sum(max(0.0, c) for c in coefficients.values())
                if level + positive > limit:
                    rows.add(coefficients, -math.inf, limit - level)

    def _work_rows(self, rows: Rows, pair_index: PairIndex) -> None:
        """Each op starts after all work ordered before it and ends before all work after it.

        ``E[v] ≥ first + Σ_{u before v} T(u) + T(v)`` and ``E[v] + Σ_{u after v} T(u) ≤ first + T``
        are implied by the pairwise rows but, unlike them, stay strong when binaries are
        fractional, which is what lifts the relaxation's bound above the busiest rank's work.
        """
        t = self.p * self.n
        for r in range(self.p):
            order, d = self.precedes[r], self.duration[r]
            for k in range(self.n):
                start = {self._variable(r, k): 1.0}
                finish = {self._variable(r, k): 1.0, t: -1.0}
                start_constant = float(order[:, k] @ d) + d[k]
                finish_constant = float(order[k, :] @ d)
                for u in np.nonzero(~(order[:, k] | order[k, :]))[0]:
                    before = self._before(pair_index, r, int(u), k)
                    if before is None:
                        continue
                    start[before[0]] = start.get(before[0], 0.0) - before[1] * d[u]
                    start_constant += before[2] * d[u]
                    # [u after k] = 1 - [u before k]
                    finish[before[0]] = finish.get(before[0], 0.0) - before[1] * d[u]
                    finish_constant += (1.0 - before[2]) * d[u]
                rows.add(start, self.first_start[r] + start_constant, math.inf)
                rows.add(finish, -math.inf, self.first_start[r] - finish_constant)

    def _objective_rows(self, rows: Rows) -> None:
        t = self.p * self.n
        for r in range(self.p):
            order = self.precedes[r]
            for k in np.nonzero(~order.any(axis=1))[0]:
                rows.add({t: 1.0, self._variable(r, int(k)): -1.0}, -self.first_start[r], math.inf)

    def _programs(self, x: np.ndarray, pair_index: PairIndex) -> list[list[Op]]:
        """Each rank's order: ops ranked by how many ops precede them, ties by end time."""
        position = np.array([order.sum(axis=0) for order in self.precedes], dtype=float)
        for (rank, u, v), var in pair_index.items():
            position[rank, v if x[var] > 0.5 else u] += 1
        programs = []
        for r in range(self.p):
            ends = x[r * self.n : (r + 1) * self.n]
            ranked = sorted(range(self.n), key=lambda k: (position[r, k], ends[k]))
            programs.append([self._op(r, k) for k in ranked])
        return programs

    def _op(self, rank: int, k: int) -> Op:
        kind = (Kind.F, Kind.B, Kind.W)[k // self.m]
        return Op(kind, rank, k % self.m)
