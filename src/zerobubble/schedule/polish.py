"""Polish a built schedule's last ops with an exact solver: OR-tools CP-SAT (optional dependency).

The builders place ops by rules (the authors' patterns, greedy planners, local moves), and one move
at a time cannot undo a rule's choice where several ranks must change together: at 1.5B p8 m24 the
authors' V-Half order is 0.37 % from a better one that reorders ops on all eight ranks at once.
:func:`polish_schedule` hands the ops that start in the last stretch of the iteration (about
``window`` per rank) to CP-SAT and keeps everything before them as it is.  The model
(``docs/schedulers.md``, "Polishing"): kept ops keep their order and times, each rank runs its freed
ops one at a time (``NoOverlap``) after its inputs plus the transfer time, ops of one kind and stage
keep their order, activation memory is a ``Cumulative`` resource per rank capped at
``min(memory limit, peak before polishing)``, and the objective is the longest rank span.  Times
and memory are scaled to integers (exactly where a power of two allows it); the search is
warm-started from the schedule itself.  The solver's order is replayed by the simulator at the
real costs and validated, and kept only when it is strictly faster and no rank's peak rose, so a
polish never makes a schedule slower or hungrier, whatever the rounding admitted.

CP-SAT runs its portfolio of workers (one per core, up to eight) for a wall-clock limit: where it
stops before proving the optimum, the result can differ between runs and machines (never getting
worse than the schedule it started from); save a polished schedule (``Schedule.to_json``) to reuse
it.  Why a solver and not a further move rule: ``docs/schedulers.md`` ("Polishing").
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from .costs import CostModel, StageCosts, memory_cap
from .gcpause import collector_paused
from .ir import Kind, Op, Schedule, ScheduleError, dependencies
from .simulate import Timeline, resolve_costs_for, simulate
from .validate import validate_schedule

#: Ops per rank, on average, that a polish frees at first: a round of about a second at p = 8 on
#: 2 cores (the window then doubles while rounds end proven optimal).
DEFAULT_WINDOW = 40

#: CP-SAT workers by default: one per core up to this many (its portfolio gains little beyond).
_MAX_WORKERS = 8

#: Memory that no small power of two makes integral is scaled so that each rank's cap is at most this
#: many units (fewer where capacity times horizon would near CP-SAT's 64-bit energy sums) and every
#: part is rounded up.
_MEMORY_UNITS = 1e12

#: Durations and memory are scaled by the smallest power of two up to this one that makes them all
#: integers; otherwise durations so that the longest op is about ``_TIME_UNITS`` units (the replay
#: decides then) and memory as ``_MEMORY_UNITS`` says.
_EXACT_SCALE = 1024
_TIME_UNITS = 2**20


@dataclass(frozen=True)
class PolishReport:
    """What a polish did: iteration time before and after, the ops freed in its last round, that
    round's window (ops per rank), the rounds solved, the last solver verdict (``"OPTIMAL"``: no
    better order of the freed ops exists under the model) and whether the schedule changed."""

    before: float
    after: float
    freed_ops: int
    window: int
    rounds: int
    status: str
    kept: bool

    def as_meta(self) -> dict[str, Any]:
        """The report as JSON-ready ``Schedule.meta["polish"]``."""
        return asdict(self)


def solver_available() -> bool:
    """Whether OR-tools (``pip install 'zerobubble[solver]'``) can be imported."""
    try:
        import ortools.sat.python.cp_model  # noqa: F401
    except ImportError:
        return False
    return True


def polish_schedule(
    schedule: Schedule,
    costs: CostModel | StageCosts | None = None,
    *,
    seconds: float,
    window: int = DEFAULT_WINDOW,
    workers: int | None = None,
) -> Schedule:
    """``schedule`` with its last ops reordered by CP-SAT when that is strictly faster.

    ``costs`` are the planned costs (their ``memory_limit`` is kept); ``seconds`` the wall-clock
    budget of the whole polish; ``window`` the ops freed per rank on average at first: each time the
    solver proves the freed ops' order optimal with time left, the window doubles and it solves again
    from the better schedule.  ``workers`` are CP-SAT's threads (default: one per core, up to 8).
    The result's ``meta["polish"]`` is a :class:`PolishReport`.  Raises :class:`ScheduleError`
    when OR-tools is not installed, an argument is out of range or the schedule has vocabulary ops
    (the model has no S and T: polish before :func:`~.vocab.add_vocab_ops`, as ``build_schedule`` does).
    """
    cp_model = check_polish_request(seconds, window=window, workers=workers)
    if schedule.vocab_shards:
        raise ScheduleError(
            f"schedule {schedule.name!r} has vocabulary-parallel ops (S, T), which the polish does not "
            "model: polish the schedule before placing them (build_schedule(..., polish_seconds=, "
            "vocab_parallel=True) does)"
        )
    if schedule.overlapped:
        raise ScheduleError(
            f"schedule {schedule.name!r} has overlapped F&B pairs, which the polish does not model; "
            "use it as built"
        )
    resolved = resolve_costs_for(schedule, costs)
    deadline = time.monotonic() + seconds
    with collector_paused():
        timeline = simulate(schedule, resolved)
        before, freed, status, rounds, used = timeline.iteration_time, 0, "NONE", 0, window
        while (remaining := deadline - time.monotonic()) > 0:
            free = _freed_ops(timeline, window)
            if len(free) <= freed:  # nothing more to free: the last round covered all it can
                break
            rounds, freed, used = rounds + 1, len(free), window
            status, order = _TailModel(cp_model, timeline, resolved, free).solve(remaining, workers)
            candidate = _with_tails(schedule, order) if order is not None else None
            better = _accepted(candidate, timeline, resolved)
            if better is not None:
                schedule, timeline = better.schedule, better
            if status != "OPTIMAL":
                break
            window *= 2
    after = timeline.iteration_time
    return _reported(schedule, PolishReport(before, after, freed, used, rounds, status, after < before))


def check_polish_request(seconds: float, *, window: int = DEFAULT_WINDOW, workers: int | None = None) -> Any:
    """Raise :class:`ScheduleError` if a polish with these arguments cannot run (a bad argument,
    OR-tools missing); else return CP-SAT's ``cp_model`` module."""
    _check_arguments(seconds, window, workers)
    return _import_cp_model()


def _check_arguments(seconds: float, window: int, workers: int | None) -> None:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
        raise ScheduleError(f"polish seconds must be a positive, finite number, got {seconds!r}")
    if not _is_positive_int(window):
        raise ScheduleError(f"polish window must be a positive integer (ops per rank), got {window!r}")
    if workers is not None and not _is_positive_int(workers):
        raise ScheduleError(f"polish workers must be a positive integer or None, got {workers!r}")


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _import_cp_model() -> Any:
    try:
        from ortools.sat.python import cp_model
    except ImportError as error:
        raise ScheduleError(
            "polishing needs OR-tools' CP-SAT solver: pip install 'zerobubble[solver]' (or ortools)"
        ) from error
    return cp_model


def _reported(schedule: Schedule, report: PolishReport) -> Schedule:
    meta = {**schedule.meta, "polish": report.as_meta()}
    if report.kept:
        meta["iteration_time"] = report.after
    return replace(schedule, meta=meta)


def _freed_ops(timeline: Timeline, window: int) -> set[tuple[int, int]]:
    """(rank, index) of the ops starting at or after the cut: about ``window`` per rank, never a
    rank's first op (its start anchors the rank's span)."""
    starts = sorted((s for rank_starts in timeline.start for s in rank_starts), reverse=True)
    if not starts:
        return set()
    wanted = min(len(starts), window * timeline.num_ranks)
    cut = starts[wanted - 1]
    firsts = [rank_starts[0] for rank_starts in timeline.start if rank_starts]
    cut = max(cut, math.nextafter(max(firsts), math.inf))
    return {
        (rank, i)
        for rank, rank_starts in enumerate(timeline.start)
        for i, start in enumerate(rank_starts)
        if start >= cut
    }


def _with_tails(schedule: Schedule, order: Sequence[Sequence[Op]]) -> Schedule:
    """``schedule`` with each rank's freed ops replaced by ``order[rank]`` (they are its last ops)."""
    programs = [
        [*program[: len(program) - len(tail)], *tail] for program, tail in zip(schedule.programs, order)
    ]
    return Schedule(schedule.name, schedule.placement, schedule.microbatches, programs, schedule.meta)


def _accepted(candidate: Schedule | None, before: Timeline, costs: StageCosts) -> Timeline | None:
    """The candidate's timeline if it is valid, strictly faster and raises no rank's peak."""
    if candidate is None:
        return None
    try:
        after = validate_schedule(candidate, costs)
    except ScheduleError:  # the integer model admitted something the exact rules do not
        return None
    if after.iteration_time >= before.iteration_time * (1 - 1e-12):
        return None
    if any(new > memory_cap(old) for new, old in zip(after.peak_memory, before.peak_memory)):
        return None
    return after


class _TailModel:
    """The CP-SAT model of the freed ops (see the module docstring)."""

    def __init__(self, cp_model: Any, timeline: Timeline, costs: StageCosts, free: set[tuple[int, int]]):
        self.cp_model = cp_model
        self.model = cp_model.CpModel()
        self.timeline, self.costs = timeline, costs
        schedule = timeline.schedule
        self.schedule = schedule
        self.time_scale = _time_scale(costs)
        self.tails: list[list[Op]] = []
        self.where: dict[Op, tuple[int, int]] = {}
        for rank, program in enumerate(schedule.programs):
            first_free = min((i for i in range(len(program)) if (rank, i) in free), default=len(program))
            self.tails.append(list(program[first_free:]))
            for i, op in enumerate(program):
                self.where[op] = (rank, i)
        self.duration = {op: self._ticks(costs.duration(op)) for tail in self.tails for op in tail}
        self.hint = self._integer_replay()
        # every freed op run one after another after the last hinted end: no solution needs longer
        hop = self._ticks(max(costs.comm, default=0.0))
        self.horizon = max(self._fixed_ends(), max(self.hint.values(), default=0)) + sum(
            duration + hop + 1 for duration in self.duration.values()
        )
        self.start: dict[Op, Any] = {}
        self.end: dict[Op, Any] = {}
        self._add_ops()
        self._add_memory()
        self._add_objective()

    def _ticks(self, value: float) -> int:
        return round(value * self.time_scale)

    def _fixed_end(self, op: Op) -> int:
        rank, i = self.where[op]
        return self._ticks(self.timeline.end[rank][i])

    def _fixed_ends(self) -> int:
        return max((self._ticks(ends[-1]) for ends in self.timeline.end if ends), default=0)

    def _end_of(self, op: Op) -> Any:
        return self.end[op] if op in self.end else self._fixed_end(op)

    def _ready(self, rank: int) -> int:
        """When the rank's last kept op ends, in ticks: its freed ops start no sooner."""
        kept = len(self.schedule.programs[rank]) - len(self.tails[rank])
        return self._ticks(self.timeline.end[rank][kept - 1]) if kept else 0

    def _delay(self, producer_stage: int, stage: int) -> float:
        rank_of = self.schedule.placement.stage_ranks
        return (
            self.costs.comm[min(stage, producer_stage)] if rank_of[producer_stage] != rank_of[stage] else 0.0
        )

    def _inputs(self, op: Op) -> list[tuple[Op, int]]:
        """Each input's producer and the transfer time after it, in ticks."""
        return [
            (self._producer(role, stage, j), self._ticks(self._delay(stage, op.stage)))
            for role, stage, j in dependencies(op, self.schedule.num_stages)
        ]

    def _integer_replay(self) -> dict[Op, int]:
        """The freed ops' starts in the current order at the integer durations: a hint that meets
        every constraint of the model exactly (rounding the real starts may not)."""
        timeline, start = self.timeline, {}
        rank_free = [self._ready(rank) for rank in range(len(self.tails))]
        freed = sorted(
            (timeline.start[self.where[op][0]][self.where[op][1]], rank, op)
            for rank, tail in enumerate(self.tails)
            for op in tail
        )
        ends: dict[Op, int] = {}
        for _, rank, op in freed:  # in start order every input and rank predecessor comes first
            begin = max(
                [rank_free[rank]]
                + [
                    (ends[dep] if dep in ends else self._fixed_end(dep)) + delay
                    for dep, delay in self._inputs(op)
                ]
            )
            start[op], ends[op] = begin, begin + self.duration[op]
            rank_free[rank] = ends[op]
        return start

    def _add_ops(self) -> None:
        model = self.model
        for rank, tail in enumerate(self.tails):
            intervals = []
            for op in tail:
                duration = self.duration[op]
                start = model.NewIntVar(self._ready(rank), self.horizon, f"start {op}")
                self.start[op], self.end[op] = start, start + duration
                intervals.append(model.NewFixedSizeIntervalVar(start, duration, f"{op}"))
                model.AddHint(start, self.hint[op])
            model.AddNoOverlap(intervals)
        last_of_kind: dict[tuple[Kind, int], Op] = {}
        for tail in self.tails:
            for op in tail:
                for dep, delay in self._inputs(op):
                    model.Add(self.start[op] >= self._end_of(dep) + delay)
                previous = last_of_kind.get((op.kind, op.stage))
                if previous is not None:  # keep each kind's order per stage (it removes symmetric orders)
                    model.Add(self.start[op] >= self.end[previous])
                last_of_kind[(op.kind, op.stage)] = op

    def _producer(self, role: Kind, stage: int, j: int) -> Op:
        op = Op(role, stage, j)
        if op in self.where:
            return op
        return Op(Kind.BW, stage, j)  # role B is computed by a fused BW in such schedules

    def _add_memory(self) -> None:
        timeline, costs = self.timeline, self.costs
        for rank, tail in enumerate(self.tails):
            limit = min(costs.memory_limit[rank], timeline.peak_memory[rank])
            if not tail or limit == math.inf:
                continue
            cap = memory_cap(limit)
            # an exact scale where one exists; else about _MEMORY_UNITS units, fewer where capacity
            # times horizon would come near CP-SAT's 64-bit energy sums
            scale = _exact_scale([*costs.mem_b, *costs.mem_w, limit]) or min(
                _MEMORY_UNITS / cap, 2.0**58 / (cap * max(self.horizon, 1))
            )
            held = self._held_parts(tail, scale)
            capacity = math.floor(cap * scale)
            # parts are rounded up, so the current order may sit a few units above the scaled cap:
            # let it through (the replay rejects any order whose real memory is above the limit)
            capacity = max(capacity, _peak_units([(s, e, d) for s, e, d, _ in held]))
            intervals = [interval for _, _, _, interval in held]
            self.model.AddCumulative(intervals, [d for _, _, d, _ in held], capacity)

    def _held_parts(self, tail: Sequence[Op], scale: float) -> list[tuple[int, int, int, Any]]:
        """Per freed op that frees memory: (hinted start, hinted end, units, interval) of the part it
        frees, held from its forward's start to its own end."""
        held = []
        for op in tail:
            part = -self.costs.memory_delta(op) if op.kind is not Kind.F else 0.0
            if part <= 0:
                continue
            forward = Op(Kind.F, op.stage, op.microbatch)
            start = self.start.get(forward)
            if start is None:
                start = self._ticks(self.timeline.start[self.where[forward][0]][self.where[forward][1]])
                hinted_start = start
            else:
                hinted_start = self.hint[forward]
            hinted_end = self.hint[op] + self.duration[op]
            size = self.model.NewIntVar(0, self.horizon, f"held until {op}")
            interval = self.model.NewIntervalVar(start, size, self.end[op], f"mem {op}")
            held.append((hinted_start, hinted_end, math.ceil(part * scale), interval))
        return held

    def _add_objective(self) -> None:
        model, timeline = self.model, self.timeline
        span = model.NewIntVar(0, 2 * self.horizon, "iteration time")
        hinted_span = 0
        for rank, tail in enumerate(self.tails):
            if not timeline.start[rank]:
                continue
            first = self._ticks(timeline.start[rank][0])
            if tail:
                last = model.NewIntVar(0, 2 * self.horizon, f"last end {rank}")
                model.AddMaxEquality(last, [self.end[op] for op in tail])
                model.Add(span >= last - first)
                hinted_last = max(self.hint[op] + self.duration[op] for op in tail)
            else:
                hinted_last = self._ticks(timeline.end[rank][-1])
                model.Add(span >= hinted_last - first)
            hinted_span = max(hinted_span, hinted_last - first)
        model.AddHint(span, hinted_span)
        model.Minimize(span)

    def solve(self, seconds: float, workers: int | None) -> tuple[str, list[list[Op]] | None]:
        """Run CP-SAT; the freed ops of each rank in the solver's order (None without a solution)."""
        cp_model = self.cp_model
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = workers or max(1, min(os.cpu_count() or 1, _MAX_WORKERS))
        solver.parameters.random_seed = 0
        solver.parameters.max_time_in_seconds = float(seconds)
        status = solver.Solve(self.model)
        name = solver.StatusName(status)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return name, None
        order = [sorted(tail, key=lambda op: solver.Value(self.start[op])) for tail in self.tails]
        return name, order


def _peak_units(held: Sequence[tuple[int, int, int]]) -> int:
    """The largest sum of units held at once by half-open [start, end) intervals (a sweep)."""
    events = sorted([(start, units) for start, _, units in held] + [(end, -units) for _, end, units in held])
    level = peak = 0
    for _, change in events:  # at equal times releases (negative) sort first: half-open intervals
        level += change
        peak = max(peak, level)
    return peak


def _time_scale(costs: StageCosts) -> float:
    """The exact scale of every duration and transfer time, or the one that maps the longest op to
    ``_TIME_UNITS``."""
    values = [v for v in (*costs.f, *costs.b, *costs.w, *costs.comm) if v > 0]
    if not values:
        return 1.0
    return _exact_scale(values) or _TIME_UNITS / max(values)


def _exact_scale(values: Sequence[float]) -> float | None:
    """The smallest power of two up to ``_EXACT_SCALE`` that makes every value an integer below
    2**40, or None."""
    scale = 1
    while scale <= _EXACT_SCALE:
        if all((v * scale).is_integer() for v in values) and max(values, default=0.0) * scale < 2**40:
            return float(scale)
        scale *= 2
    return None
