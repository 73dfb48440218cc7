"""Event-driven simulation of a :class:`Schedule` under a :class:`CostModel`.

Each rank runs its program in order; an op starts as soon as its rank is free and its inputs have
arrived (a dependency between ops on different ranks costs that hop's transfer time).  The numbers a
:class:`Timeline` reports are defined in docs/concepts.md:

* ``makespan`` — first op's start to last op's end (an iteration ending in a synchronous step);
* ``iteration_time`` — max over ranks of (its last end − its first start): the period of a pipeline
  whose optimizer step is not globally synchronised (optimizer post-validation);
* ``ideal`` — the compute time of the busiest rank, ``m·(T_F+T_B+T_W)`` for uniform costs;
* ``bubble_rate = 1 − ideal / iteration_time`` and ``bubble_rate_makespan = 1 − ideal / makespan``;
* ``peak_memory`` per rank, absolute, and ``peak_memory_mb`` in the unit of one rank-stage's M_B.

The simulation is one pass over all ops (each op is looked at a bounded number of times), so
p = 32, m = 256 takes a few tens of milliseconds.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import DeadlockError
from .costs import CostModel, StageCosts
from .gcpause import collector_paused
from .ir import Kind, Op, Schedule, ScheduleError, dependencies
from .pairs import expand_times, fuse_pairs, op_positions

_ROLE = {Kind.F: 0, Kind.B: 1, Kind.W: 2, Kind.S: 3, Kind.T: 4}
_PRODUCES = {Kind.F: (0,), Kind.B: (1,), Kind.W: (2,), Kind.BW: (1, 2), Kind.S: (3,), Kind.T: (4,)}
_ROLES = len(_ROLE)


class OpTimes(Protocol):
    """Anything with op times per rank: a simulated, recorded or measured timeline.

    ``start[r][i]`` and ``end[r][i]`` belong to ``schedule.programs[r][i]``.  Render, export and the
    trace writer take any such object.
    """

    @property
    def schedule(self) -> Schedule: ...

    @property
    def start(self) -> tuple[tuple[float, ...], ...]: ...

    @property
    def end(self) -> tuple[tuple[float, ...], ...]: ...


def time_bounds(timeline: OpTimes) -> tuple[float, float]:
    """The first op's start and the last op's end over all ranks; ``(0, 0)`` when nothing ran.

    The one definition of a timeline's time origin: pictures and traces start their clocks here.
    """
    starts = [s[0] for s in timeline.start if s]
    ends = [e[-1] for e in timeline.end if e]
    if not ends:
        return 0.0, 0.0
    return min(starts), max(ends)


class SpanMetrics:
    """The figures every timeline derives from its op times, defined once for simulated and
    recorded timelines alike.

    Subclasses have ``schedule``, ``start`` and ``end`` (``start[r][i]``/``end[r][i]`` belong to
    ``schedule.programs[r][i]``) and define ``ideal``, the compute time no iteration can undercut.
    """

    schedule: Schedule
    start: tuple[tuple[float, ...], ...]
    end: tuple[tuple[float, ...], ...]

    @property
    def ideal(self) -> float:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    @property
    def rank_spans(self) -> tuple[float, ...]:
        """For each rank, end of its last op minus start of its first (0 for an empty program)."""
        return tuple(ends[-1] - starts[0] if ends else 0.0 for starts, ends in zip(self.start, self.end))

    @property
    def busy(self) -> tuple[float, ...]:
        """Compute time of each rank (an overlapped pair's two ops share one span, counted once)."""
        return tuple(_busy(starts, ends) for starts, ends in zip(self.start, self.end))

    @property
    def makespan(self) -> float:
        """First op's start to last op's end."""
        first, last = time_bounds(self)
        return last - first

    @property
    def iteration_time(self) -> float:
        """Max over ranks of its own span: the period with optimizer post-validation."""
        return max(self.rank_spans)

    @property
    def bubble_rate(self) -> float:
        """``1 − ideal / iteration_time``."""
        return _bubble(self.ideal, self.iteration_time)

    @property
    def bubble_rate_makespan(self) -> float:
        """``1 − ideal / makespan``."""
        return _bubble(self.ideal, self.makespan)


@dataclass(frozen=True)
class RecordedSpans(SpanMetrics):
    """Op times from anywhere (a recorded run, a file): the busiest rank's busy time is the ideal."""

    schedule: Schedule
    start: tuple[tuple[float, ...], ...]
    end: tuple[tuple[float, ...], ...]

    @property
    def ideal(self) -> float:
        """Measured compute time of the busiest rank."""
        return max(self.busy, default=0.0)


@dataclass(frozen=True)
class Timeline(SpanMetrics):
    """Start and end of every op of a schedule, and the figures derived from them.

    ``start[r][i]`` and ``end[r][i]`` belong to ``schedule.programs[r][i]``; ``memory[r][i]`` is
    rank ``r``'s activation memory right after that op.
    """

    schedule: Schedule
    costs: StageCosts
    start: tuple[tuple[float, ...], ...]
    end: tuple[tuple[float, ...], ...]
    memory: tuple[tuple[float, ...], ...]
    peak_memory: tuple[float, ...]

    @property
    def num_ranks(self) -> int:
        """Number of ranks."""
        return self.schedule.num_ranks

    def events(self) -> Iterator[tuple[int, Op, float, float]]:
        """Every ``(rank, op, start, end)``, rank by rank in program order."""
        for rank, program in enumerate(self.schedule.programs):
            for op, start, end in zip(program, self.start[rank], self.end[rank]):
                yield rank, op, start, end

    @property
    def idle(self) -> tuple[float, ...]:
        """Idle time of each rank within the makespan."""
        makespan = self.makespan
        return tuple(makespan - busy for busy in self.busy)

    @property
    def ideal(self) -> float:
        """Compute time of the busiest rank: no schedule's iteration is shorter."""
        m, vocab = self.schedule.microbatches, self.schedule.vocab_shards > 0
        return max(self.costs.rank_compute(r, m, vocab=vocab) for r in range(self.num_ranks))

    @property
    def peak_memory_mb(self) -> tuple[float, ...]:
        """Peak activation memory of each rank in units of one rank-stage's M_B."""
        unit = self.costs.memory_unit
        return tuple(peak / unit for peak in self.peak_memory)

    def summary(self) -> dict[str, Any]:
        """The headline numbers as a JSON-ready dict."""
        schedule = self.schedule
        return {
            "schedule": schedule.name,
            "stages": schedule.num_ranks,
            "microbatches": schedule.microbatches,
            "chunks": schedule.chunks,
            "makespan": self.makespan,
            "iteration_time": self.iteration_time,
            "ideal": self.ideal,
            "bubble_rate": self.bubble_rate,
            "bubble_rate_makespan": self.bubble_rate_makespan,
            "peak_memory": list(self.peak_memory_mb),
            "peak_memory_abs": list(self.peak_memory),
            "busy": list(self.busy),
            "idle": list(self.idle),
        }


def _busy(starts: tuple[float, ...], ends: tuple[float, ...]) -> float:
    # one rank runs one op at a time, so two consecutive ops with one span of positive length are
    # the halves of an overlapped pair
    spans = list(zip(starts, ends))
    return sum(e - s for k, (s, e) in enumerate(spans) if k == 0 or spans[k - 1] != (s, e) or e == s)


def _bubble(ideal: float, period: float) -> float:
    return 1.0 - ideal / period if period > 0 else 0.0


def simulate(
    schedule: Schedule, costs: CostModel | StageCosts | None = None, cores: int | None = None
) -> Timeline:
    """Run ``schedule`` under ``costs`` (unit costs by default) and return its :class:`Timeline`.

    ``cores`` < the number of ranks models ranks that share that many processors (several CPU ranks
    on one machine, :func:`_run_shared`); ``None`` gives every rank its own.  Raises
    :class:`DeadlockError` when the programs cannot all finish and :class:`ScheduleError` for ops
    outside the schedule's stages or microbatches.  Use :func:`validate` for the full check.
    """
    stage_costs = resolve_costs_for(schedule, costs)
    if cores is not None and cores < 1:
        raise ScheduleError(f"cores must be at least 1, got {cores}")
    with collector_paused():  # a timeline is tens of thousands of acyclic tuples (gcpause.py)
        return simulate_encoded(schedule, stage_costs, encode_programs(schedule), cores)


#: The op kinds by integer code, as :class:`EncodedPrograms`, the validator and the planners'
#: ``(kind, stage, microbatch)`` triples number them; :data:`KIND_CODE` the other way round.
KIND_OF_CODE = (Kind.F, Kind.B, Kind.W, Kind.BW, Kind.S, Kind.T)
KIND_CODE = {kind: code for code, kind in enumerate(KIND_OF_CODE)}


@dataclass(frozen=True)
class EncodedPrograms:
    """Every rank's program as integers: ``codes[r][i]`` is ``kind code · S + stage`` of op ``i``
    and ``microbatches[r][i]`` its microbatch.

    Why: tens of thousands of ops are read several times per check (timing, memory); reading
    integers from lists costs a fraction of reading three attributes of an :class:`Op` each time.
    """

    codes: tuple[list[int], ...]
    microbatches: tuple[list[int], ...]


def encode_programs(schedule: Schedule) -> EncodedPrograms:
    """``schedule``'s programs as :class:`EncodedPrograms`; raises :class:`ScheduleError` for an
    op outside the schedule's stages or microbatches."""
    S, m = schedule.num_stages, schedule.microbatches
    codes, microbatches = [], []
    for rank, program in enumerate(schedule.programs):
        stages = [op.stage for op in program]
        mbs = [op.microbatch for op in program]
        if program and (min(stages) < 0 or max(stages) >= S or min(mbs) < 0 or max(mbs) >= m):
            op = next(op for op in program if not (0 <= op.stage < S and 0 <= op.microbatch < m))
            raise ScheduleError(
                f"rank {rank}: op {op} is outside the schedule's {S} stages and {m} microbatches"
            )
        misplaced = (
            next((op for op in program if op.is_vocab and op.stage != rank), None)
            if schedule.vocab_shards
            else None
        )
        if misplaced is not None:
            raise ScheduleError(
                f"rank {rank}: {misplaced} is of vocabulary shard {misplaced.stage}, which rank "
                f"{misplaced.stage} holds (a shard's S and T run on the rank of the same number)"
            )
        codes.append([KIND_CODE[op.kind] * S + stage for op, stage in zip(program, stages)])
        microbatches.append(mbs)
    return EncodedPrograms(tuple(codes), tuple(microbatches))


def simulate_encoded(
    schedule: Schedule, costs: StageCosts, encoded: EncodedPrograms, cores: int | None = None
) -> Timeline:
    """:func:`simulate` of a schedule already encoded (:func:`encode_programs`), with resolved costs
    of its placement: the validator encodes while it checks, and so encodes only once."""
    if cores is not None and cores < schedule.num_ranks:
        starts, ends = _run_shared(schedule, costs, encoded, cores)
    else:
        starts, ends = _run(schedule, costs, encoded)
    memory, peaks = _memory(schedule, costs, encoded)
    return Timeline(schedule, costs, starts, ends, memory, peaks)


def resolve_costs_for(schedule: Schedule, costs: CostModel | StageCosts | None) -> StageCosts:
    """``costs`` resolved for ``schedule``'s placement (unit costs for None); resolved costs of
    another placement are refused."""
    if costs is None:
        costs = CostModel()
    if isinstance(costs, CostModel):
        return costs.resolve(schedule.placement)
    if costs.placement != schedule.placement:
        raise ScheduleError("the resolved costs belong to another placement; pass the CostModel instead")
    return costs


def _key(role: int, stage: int, microbatch: int, num_stages: int, microbatches: int) -> int:
    return (role * num_stages + stage) * microbatches + microbatch


def _compile(
    schedule: Schedule, costs: StageCosts, encoded: EncodedPrograms
) -> list[list[tuple[float, tuple, tuple]]]:
    """Per rank, per op: (duration, ((dep key, transfer delay), ...), produced keys), the keys
    those of microbatch 0: add the op's microbatch to get its own.

    What an op needs and produces depends on its kind and stage only: one template per code,
    shared by every op of that code.
    """
    S, m, p = schedule.num_stages, schedule.microbatches, schedule.num_ranks
    rank_of, shards = schedule.placement.stage_ranks, schedule.vocab_shards
    templates: list[Any] = [
        _template(Op(kind, stage, 0), S, m, rank_of, costs, shards)
        if not (kind is Kind.S or kind is Kind.T) or stage < p
        else None  # a shard that does not exist: encode_programs refuses such an op before this
        for kind in KIND_OF_CODE
        for stage in range(S)
    ]
    return [list(map(templates.__getitem__, codes)) for codes in encoded.codes]


def _template(
    op: Op, S: int, m: int, rank_of: tuple[int, ...], costs: StageCosts, shards: int
) -> tuple[float, tuple, tuple]:
    """``op``'s duration, its dependencies' keys at microbatch 0 with their transfer delays, and the
    keys it produces at microbatch 0."""
    deps = tuple(
        (_key(_ROLE[role], stage, 0, S, m), delay)
        for role, stage, _, delay in timed_dependencies(op, S, rank_of, costs, shards)
    )
    produced = tuple(_key(role, op.stage, 0, S, m) for role in _PRODUCES[op.kind])
    return costs.duration(op), deps, produced


def timed_dependencies(
    op: Op, num_stages: int, rank_of: tuple[int, ...], costs: StageCosts, shards: int = 0
) -> tuple[tuple[Kind, int, int, float], ...]:
    """:func:`~.ir.dependencies` of ``op``, each with the delay between its end and ``op``'s start:
    the hop's transfer time across ranks (none on one rank).  A vocabulary dependency (S needing the
    last stage's hidden states, T and the last stage's backward needing every shard's S) waits the
    collective's latency ``vocab_comm`` of the waiting rank, except S on the last stage's own rank."""
    s = op.stage
    rank = s if op.is_vocab else rank_of[s]
    timed = []
    for role, dep_stage, j in dependencies(op, num_stages, shards):
        if role is Kind.S or op.is_vocab:
            local = op.kind is Kind.S and rank_of[dep_stage] == rank
            delay = 0.0 if local else costs.vocab_comm[rank]
        else:
            delay = costs.comm[min(s, dep_stage)] if rank_of[dep_stage] != rank_of[s] else 0.0
        timed.append((role, dep_stage, j, delay))
    return tuple(timed)


def _run(
    schedule: Schedule, costs: StageCosts, encoded: EncodedPrograms
) -> tuple[tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...]]:
    compiled, microbatch_of, firsts = _slots(schedule, costs, encoded)
    p, S, m = schedule.num_ranks, schedule.num_stages, schedule.microbatches
    done = [-1.0] * (_ROLES * S * m)
    # waiting[key]: the ranks blocked on that key (a list, not a dict: indexing beats hashing here)
    waiting: list[list[int] | None] = [None] * (_ROLES * S * m)
    position = [0] * p
    clock = [0.0] * p
    starts: list[list[float]] = [[] for _ in range(p)]
    ends: list[list[float]] = [[] for _ in range(p)]
    runnable = list(range(p))
    while runnable:
        rank = runnable.pop()
        program, mbs, i, now = compiled[rank], microbatch_of[rank], position[rank], clock[rank]
        rank_starts, rank_ends = starts[rank], ends[rank]
        length = len(program)
        while i < length:
            duration, deps, produced = program[i]
            j = mbs[i]
            ready = now
            blocked = False
            for base, delay in deps:
                finished = done[base + j]
                if finished < 0:
                    blocked_on = waiting[base + j]
                    if blocked_on is None:
                        waiting[base + j] = [rank]
                    else:
                        blocked_on.append(rank)
                    blocked = True
                    break
                if finished + delay > ready:  # noqa: PLR1730 (hot path: cheaper than a max() call)
                    ready = finished + delay
            if blocked:
                break
            now = ready + duration
            rank_starts.append(ready)
            rank_ends.append(now)
            for base in produced:
                key = base + j
                done[key] = now
                woken = waiting[key]
                if woken is not None:
                    waiting[key] = None
                    runnable.extend(woken)
            i += 1
        position[rank], clock[rank] = i, now
    return _finish(schedule, compiled, firsts, position, starts, ends)


def _slots(
    schedule: Schedule, costs: StageCosts, encoded: EncodedPrograms
) -> tuple[list[list[tuple[float, tuple, tuple]]], tuple[list[int], ...], tuple | None]:
    """The compiled programs and their microbatches, each overlapped F&B pair fused into one slot
    (:mod:`.pairs`); the op index each slot starts at, or None when the schedule has no pairs."""
    compiled = _compile(schedule, costs, encoded)
    if not schedule.overlapped:
        return compiled, encoded.microbatches, None
    return fuse_pairs(schedule, costs, compiled, encoded.microbatches)


def _finish(
    schedule: Schedule, compiled: list, firsts: tuple | None, position: list[int], starts: list, ends: list
) -> tuple[tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...]]:
    """The per-op start and end times of a run over slots, or the deadlock that stopped it."""
    stuck = any(position[r] < len(compiled[r]) for r in range(schedule.num_ranks))
    if firsts is not None:
        if stuck:
            raise _deadlock(schedule, op_positions(position, firsts, schedule))
        return expand_times(starts, firsts, schedule), expand_times(ends, firsts, schedule)
    if stuck:
        raise _deadlock(schedule, position)
    return tuple(map(tuple, starts)), tuple(map(tuple, ends))


def _run_shared(
    schedule: Schedule, costs: StageCosts, encoded: EncodedPrograms, cores: int
) -> tuple[tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...]]:
    """The ranks' programs on ``cores`` shared processors (processor sharing, as an OS gives
    CPU-bound processes): while ``n`` ranks compute, each advances at ``min(1, cores / n)`` of its
    own speed.  Dependencies and transfer delays are those of :func:`_run`; with ``cores`` at least
    the number of ranks the two agree.  One event per op start or end, each costing ``O(p)``.
    """
    compiled, microbatch_of, firsts = _slots(schedule, costs, encoded)
    run = _SharedRun(schedule, compiled, microbatch_of, cores)
    run.run()
    return _finish(schedule, compiled, firsts, run.position, run.starts, run.ends)


class _SharedRun:
    """:func:`_run_shared`'s event loop: per rank its place in its program, whether it computes, the
    work left of its op and when its next op may start."""

    def __init__(
        self,
        schedule: Schedule,
        compiled: list[list[tuple[float, tuple, tuple]]],
        microbatch_of: tuple[list[int], ...],
        cores: int,
    ):
        p, S, m = schedule.num_ranks, schedule.num_stages, schedule.microbatches
        self.compiled, self.microbatch_of, self.cores, self.p = compiled, microbatch_of, cores, p
        self.done = [-1.0] * (_ROLES * S * m)
        self.position = [0] * p
        self.computing = [False] * p
        self.left = [0.0] * p  # work left of the op a rank computes
        self.ready = [
            math.inf
        ] * p  # when a rank's next op may start (inf: an input is missing, or no op left)
        self.starts: list[list[float]] = [[] for _ in range(p)]
        self.ends: list[list[float]] = [[] for _ in range(p)]
        scale = max((op[0] for program in compiled for op in program), default=0.0)
        self.tolerance = 1e-12 * scale
        self.now = 0.0

    def run(self) -> None:
        """Start and end ops, one event at a time, until no rank computes or can start an op."""
        for rank in range(self.p):
            self._arm(rank)
        while True:
            self._start_ready()
            running = [rank for rank in range(self.p) if self.computing[rank]]
            if not running and min(self.ready) == math.inf:
                return
            self._end(self._advance(running))

    def _arm(self, rank: int) -> None:
        """When the rank's next op may start (its previous op ended at ``now`` or earlier)."""
        self.ready[rank] = math.inf
        position = self.position[rank]
        if position >= len(self.compiled[rank]):
            return
        at = self.ends[rank][-1] if self.ends[rank] else 0.0
        _, deps, _ = self.compiled[rank][position]
        j = self.microbatch_of[rank][position]
        for base, delay in deps:
            if self.done[base + j] < 0:
                return
            at = max(at, self.done[base + j] + delay)
        self.ready[rank] = at

    def _start_ready(self) -> None:
        """Start every op whose inputs are there, on a rank that computes nothing."""
        now, ready = self.now, self.ready
        for rank in range(self.p):
            if not self.computing[rank] and ready[rank] <= now:
                self.starts[rank].append(now)
                self.computing[rank], self.left[rank] = True, self.compiled[rank][self.position[rank]][0]
                ready[rank] = math.inf

    def _advance(self, running: list[int]) -> list[int]:
        """Move the clock to the next event (an op ends, or one may start), every running rank advancing
        at its share of the cores; the ranks whose op has ended."""
        left, now = self.left, self.now
        rate = min(1.0, self.cores / len(running)) if running else 0.0
        finish = now + min(left[rank] for rank in running) / rate if running else math.inf
        step = min(finish, *self.ready)
        for rank in running:
            left[rank] -= (step - now) * rate
        self.now = step
        return [rank for rank in running if left[rank] <= self.tolerance]

    def _end(self, finished: list[int]) -> None:
        """End the ops of the ``finished`` ranks now; their outputs may be what another rank waits for."""
        for rank in finished:
            self.computing[rank] = False
            self.ends[rank].append(self.now)
            _, _, produced = self.compiled[rank][self.position[rank]]
            j = self.microbatch_of[rank][self.position[rank]]
            for base in produced:
                self.done[base + j] = self.now
            self.position[rank] += 1
        if finished:
            for rank in range(self.p):
                if not self.computing[rank]:
                    self._arm(rank)


def _deadlock(schedule: Schedule, position: list[int]) -> DeadlockError:
    """Describe why the stuck ranks cannot proceed, following the chain of waits to a cycle."""
    where = {op: rank for rank, op in schedule.ops()}
    executed = {op for rank, program in enumerate(schedule.programs) for op in program[: position[rank]]}
    waits: dict[int, tuple[Op, Op]] = {}
    paired = [set(starts) for starts in schedule.pair_starts()]
    for rank, program in enumerate(schedule.programs):
        if position[rank] >= len(program):
            continue
        at = position[rank]
        heads = program[at : at + (2 if at in paired[rank] else 1)]  # a pair waits for both halves
        needs = [
            (head, dep)
            for head in heads
            for dep in dependencies(head, schedule.num_stages, schedule.vocab_shards)
        ]
        for head, (role, stage, mb) in needs:
            candidates = [Op(role, stage, mb)] + ([Op(Kind.BW, stage, mb)] if role is Kind.B else [])
            if not any(c in executed for c in candidates):
                waits[rank] = (head, next((c for c in candidates if c in where), candidates[0]))
                break
    for rank, (head, dep) in waits.items():
        if dep not in where:
            return DeadlockError(
                f"rank {rank}: {head} waits for {dep}, which no rank's program contains", waits
            )
    cycle = _find_cycle(waits, where)
    text = " -> ".join(
        f"rank {r} at {waits[r][0]} waits for {waits[r][1]} (rank {where[waits[r][1]]})" for r in cycle
    )
    return DeadlockError(f"deadlock: {text}", waits)


def _find_cycle(waits: dict[int, tuple[Op, Op]], where: dict[Op, int]) -> list[int]:
    rank = next(iter(waits))
    seen: list[int] = []
    while rank not in seen and rank in waits:
        seen.append(rank)
        rank = where[waits[rank][1]]
    return seen[seen.index(rank) :] if rank in seen else seen


def _memory(
    schedule: Schedule, costs: StageCosts, encoded: EncodedPrograms
) -> tuple[tuple[tuple[float, ...], ...], tuple[float, ...]]:
    # one memory change per code (kind, stage), the same for every microbatch; the running sum in
    # C (itertools.accumulate adds left to right, as a loop would: the same floats)
    stages, p = range(schedule.num_stages), schedule.num_ranks
    deltas = [
        costs.memory_delta(Op(kind, stage, 0)) if not Op(kind, stage, 0).is_vocab or stage < p else 0.0
        for kind in KIND_OF_CODE
        for stage in stages
    ]
    memory, peaks = [], []
    for codes in encoded.codes:
        trace = tuple(itertools.accumulate(map(deltas.__getitem__, codes)))
        memory.append(trace)
        peaks.append(max(0.0, *trace) if trace else 0.0)
    return tuple(memory), tuple(peaks)
