"""Automatic zero-bubble scheduling under a memory limit (Qi et al., 2024, §3.1).

One stage per rank, split backward.  A greedy planner builds every rank's program round by round
while keeping the exact start and end time of every op it places (the same arithmetic as
:func:`~zerobubble.schedule.simulate.simulate`), so each decision sees the real idle gaps:

1. **Warm-up.**  Every rank runs microbatch 0's forward; then, from the last rank backwards, each
   rank adds as many forwards as fit before microbatch 0's B reaches it (and in the memory limit).
   Each rank keeps at least one forward fewer than the rank before it, so no rank runs ahead of the
   forwards it can receive.
2. **Steady state.**  Round ``i`` gives each rank one forward (skipped in some variants when the rank
   is already two forwards ahead of the next one and the B it waits for is due soon) and then
   ``B(i)``, last rank first.  Before each F and B the rank fills the wait for its input with W ops:
   every W that fits in the gap, and one more for a shorter gap when leaving it idle would make this
   rank the idlest one so far (and, in some variants, always).  W ops also run whenever the memory
   limit would otherwise be exceeded.
3. **Drain.**  When forwards and B ops are exhausted the remaining W ops run.

The binary choices (how the warm-up meets the first B, whether B may pre-empt a forward, whether
short gaps are filled) give eight greedy variants.  The handcrafted ZB-H1 and ZB-H2 and a 1F1B with
split backward and memory-capped warm-up join them as candidates when they fit the limit; the one
with the shortest simulated iteration time wins and ``Schedule.meta["variant"]`` names it.  The
capped 1F1B fits every feasible limit, so a schedule always exists once one microbatch fits on
every rank; below that the builder raises :class:`ScheduleError`.

Cost: each variant places ``3·p·m`` ops with amortised O(1) work per op, so p = 32, m = 256 takes
well under two seconds for the whole search.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ..costs import CostModel, StageCosts
from ..ir import B, F, Op, Placement, Schedule, ScheduleError, W
from ..simulate import DeadlockError, simulate
from .zb_handcrafted import rank_program as zb_h_program

_RELATIVE_TOLERANCE = 1e-9


def _fits(level: float, limit: float) -> bool:
    """Whether a memory level respects a limit, with the validator's floating-point tolerance."""
    return level <= limit * (1 + _RELATIVE_TOLERANCE) + _RELATIVE_TOLERANCE


class _NoRoom(Exception):
    """A greedy variant painted itself into a corner: memory is full and no W is pending."""


@dataclass(frozen=True)
class Variant:
    """The binary choices of the greedy planner.

    ``tight_warmup``: warm-up forwards must end before the first B arrives (else they continue until
    it has arrived, possibly delaying it a little).  ``prioritize_b``: a rank two or more forwards
    ahead of the next may skip this round's forward so its B starts on time.  ``fill_small_gaps``:
    gaps shorter than a W are filled with one even when leaving them idle would be harmless.
    """

    tight_warmup: bool
    prioritize_b: bool
    fill_small_gaps: bool

    @property
    def label(self) -> str:
        """A short name for ``Schedule.meta``."""
        return "greedy-{}-{}-{}".format(
            "tight" if self.tight_warmup else "loose",
            "bfirst" if self.prioritize_b else "ffirst",
            "fillall" if self.fill_small_gaps else "fillneeded",
        )


ALL_VARIANTS = tuple(Variant(*choice) for choice in itertools.product((True, False), repeat=3))


class _Planner:
    """Builds all ranks' programs for one :class:`Variant`, timing every op as it is placed."""

    def __init__(self, costs: StageCosts, microbatches: int, variant: Variant):
        p = costs.placement.num_ranks
        self.p, self.m, self.variant = p, microbatches, variant
        self.cost = {"F": costs.f, "B": costs.b, "W": costs.w}
        self.delta = {
            "F": costs.mem_b,
            "B": tuple(w - b for b, w in zip(costs.mem_b, costs.mem_w)),
            "W": tuple(-w for w in costs.mem_w),
        }
        self.comm = costs.comm
        self.limit = costs.memory_limit
        self.count = {"F": [0] * p, "B": [0] * p, "W": [0] * p}
        self.clock = [0.0] * p
        self.first_start = [0.0] * p
        self.memory = [0.0] * p
        self.idle = [0.0] * p
        self.max_idle = 0.0
        self.end_f: list[list[float]] = [[] for _ in range(p)]
        self.end_b: list[list[float]] = [[] for _ in range(p)]
        self.programs: list[list[Op]] = [[] for _ in range(p)]

    def plan(self) -> list[list[Op]]:
        """Run warm-up, steady rounds and drain; return one program per rank."""
        self._warm_up()
        for i in range(1, self.m):
            self._steady_round(i)
        for rank in range(self.p):
            self._drain(rank)
        return self.programs

    @property
    def iteration_time(self) -> float:
        """Max over ranks of last end − first start; equals ``simulate(...).iteration_time``."""
        return max(end - start for start, end in zip(self.first_start, self.clock))

    # -- placing one op ------------------------------------------------------------------------

    def _put(self, rank: int, kind: str, ready: float) -> None:
        """Append the next op of ``kind`` to ``rank``; its input is available at ``ready``."""
        counts = self.count[kind]
        j = counts[rank]
        start = max(self.clock[rank], ready)
        if self.programs[rank]:
            self.idle[rank] += start - self.clock[rank]
            if self.idle[rank] > self.max_idle:
                self.max_idle = self.idle[rank]
        else:
            self.first_start[rank] = start
        end = start + self.cost[kind][rank]
        self.clock[rank] = end
        self.memory[rank] += self.delta[kind][rank]
        counts[rank] = j + 1
        if kind == "F":
            self.end_f[rank].append(end)
            self.programs[rank].append(F(rank, j))
        elif kind == "B":
            self.end_b[rank].append(end)
            self.programs[rank].append(B(rank, j))
        else:
            self.programs[rank].append(W(rank, j))

    def _pending_w(self, rank: int) -> bool:
        return self.count["W"][rank] < self.count["B"][rank]

    def _put_w(self, rank: int) -> None:
        self._put(rank, "W", 0.0)

    def _make_room(self, rank: int, kind: str) -> None:
        """Run W ops until the next ``kind`` op fits in the memory limit."""
        growth = self.delta[kind][rank]
        while not _fits(self.memory[rank] + growth, self.limit[rank]):
            if not self._pending_w(rank):
                raise _NoRoom
            self._put_w(rank)

    def _fill_gap(self, rank: int, ready: float) -> None:
        """Fill the wait until ``ready`` with W ops (the paper's "W into every gap")."""
        w = self.cost["W"][rank]
        while self._pending_w(rank) and self.clock[rank] + w <= ready:
            self._put_w(rank)
        if self._pending_w(rank) and self.clock[rank] < ready:
            leaves_rank_idlest = ready - self.clock[rank] > self.max_idle - self.idle[rank]
            if leaves_rank_idlest or self.variant.fill_small_gaps:
                self._put_w(rank)

    def _forward_ready(self, rank: int) -> float:
        if rank == 0:
            return 0.0
        return self.end_f[rank - 1][self.count["F"][rank]] + self.comm[rank - 1]

    def _backward_ready(self, rank: int, microbatch: int) -> float:
        if rank == self.p - 1:
            return 0.0
        return self.end_b[rank + 1][microbatch] + self.comm[rank]

    def _place_forward(self, rank: int) -> None:
        self._make_room(rank, "F")
        ready = self._forward_ready(rank)
        if rank > 0:
            self._fill_gap(rank, ready)
        self._put(rank, "F", ready)

    def _place_backward(self, rank: int, microbatch: int) -> None:
        self._make_room(rank, "B")
        ready = self._backward_ready(rank, microbatch)
        if rank < self.p - 1:
            self._fill_gap(rank, ready)
        if rank == 0 and self.count["F"][0] == self.m:
            # Nobody waits for the first stage's B: in the cool-down its W ops may go first.
            self._drain(rank)
        self._put(rank, "B", ready)

    def _drain(self, rank: int) -> None:
        while self._pending_w(rank):
            self._put_w(rank)

    # -- phases --------------------------------------------------------------------------------

    def _warm_up(self) -> None:
        """Microbatch 0 through the pipeline, with as many forwards as fit before its B returns."""
        p = self.p
        for rank in range(p):
            self._put(rank, "F", self._forward_ready(rank))
        extra = self._warm_up_counts()
        for rank in range(p):
            for _ in range(extra[rank]):
                self._place_forward(rank)
        for rank in range(p - 1, -1, -1):
            self._place_backward(rank, 0)

    def _warm_up_counts(self) -> list[int]:
        """Extra warm-up forwards per rank, estimated from the last rank backwards."""
        p, f, b = self.p, self.cost["F"], self.cost["B"]
        extra = [0] * p
        b_done = self.clock[p - 1] + b[p - 1]
        for rank in range(p - 2, -1, -1):
            arrival = b_done + self.comm[rank]
            clock, level = self.clock[rank], self.memory[rank]
            b_growth = max(0.0, self.delta["B"][rank])
            while 1 + extra[rank] < self.m and _fits(level + self.delta["F"][rank] + b_growth, self.limit[rank]):
                if self.variant.tight_warmup and clock + f[rank] > arrival:
                    break
                if not self.variant.tight_warmup and clock >= arrival:
                    break
                clock += f[rank]
                level += self.delta["F"][rank]
                extra[rank] += 1
            b_done = max(clock, arrival) + b[rank]
        for rank in range(1, p):
            while 0 < extra[rank] >= extra[rank - 1] and 1 + extra[rank] < self.m:
                extra[rank] -= 1
        return extra

    def _steady_round(self, microbatch: int) -> None:
        p = self.p
        wants = [self.count["F"][rank] < self.m and not self._skip_forward(rank) for rank in range(p)]
        for rank in range(p - 2, -1, -1):
            wants[rank] = wants[rank] and wants[rank + 1]
        for rank in range(p):
            if wants[rank]:
                self._place_forward(rank)
        for rank in range(p - 1, -1, -1):
            self._place_backward(rank, microbatch)

    def _skip_forward(self, rank: int) -> bool:
        """Whether ``rank`` should let its B pre-empt this round's forward (``prioritize_b``)."""
        nf = self.count["F"]
        if not self.variant.prioritize_b or rank == self.p - 1 or nf[rank] < nf[rank + 1] + 2:
            return False
        nxt = rank + 1
        b_due = self.clock[nxt] + self.cost["F"][nxt] + self.cost["B"][nxt] + self.comm[rank]
        clock = self.clock[rank]
        if clock >= b_due:
            return True
        if clock + self.cost["F"][rank] + self._room_time(rank) <= b_due:
            return False
        return b_due - clock <= self.max_idle - self.idle[rank]

    def _room_time(self, rank: int) -> float:
        """Time of the W ops ``rank`` would have to run before its next forward fits in memory."""
        level = self.memory[rank] + self.delta["F"][rank]
        pending = self.count["B"][rank] - self.count["W"][rank]
        spent = 0.0
        while pending and not _fits(level, self.limit[rank]):
            level += self.delta["W"][rank]
            spent += self.cost["W"][rank]
            pending -= 1
        return spent


def _capped_1f1b_program(rank: int, stages: int, microbatches: int, warmup: int) -> list[Op]:
    """1F1B with split backward (W right after its B) and ``warmup`` forwards before the first B."""
    program = [F(rank, j) for j in range(warmup)]
    for j in range(microbatches):
        if warmup + j < microbatches:
            program.append(F(rank, warmup + j))
        program += [B(rank, j), W(rank, j)]
    return program


def _capped_1f1b(costs: StageCosts, microbatches: int) -> list[list[Op]]:
    """1F1B whose warm-up each rank's memory limit caps; fits every feasible limit."""
    p = costs.placement.num_ranks
    programs, previous = [], microbatches
    for rank in range(p):
        mem_b, mem_w, limit = costs.mem_b[rank], costs.mem_w[rank], costs.memory_limit[rank]
        room = limit - max(mem_b, mem_w)
        cap = p - 1 - rank if mem_b <= 0 or math.isinf(limit) else int(room // mem_b)
        while cap > 0 and not _fits(cap * mem_b + max(mem_b, mem_w), limit):
            cap -= 1
        # A rank may not warm up further than the rank before it, or the two wait on each other.
        warmup = max(0, min(cap, p - 1 - rank, microbatches, previous))
        previous = warmup
        programs.append(_capped_1f1b_program(rank, p, microbatches, warmup))
    return programs


def check_memory_feasible(costs: StageCosts) -> None:
    """Raise :class:`ScheduleError` when some rank's limit cannot hold even one microbatch."""
    for rank in range(costs.placement.num_ranks):
        need = max(costs.mem_b[rank], costs.mem_w[rank])
        limit = costs.memory_limit[rank]
        if not _fits(need, limit):
            raise ScheduleError(
                f"memory limit {limit:g} on rank {rank} is below the {need:g} that one microbatch needs "
                f"there (M_B of that stage); raise the memory limit to at least {need:g}"
            )


def _candidates(costs: StageCosts, microbatches: int, variants: tuple[Variant, ...]):
    """Yield ``(label, programs)`` for every greedy variant that succeeds and every fallback."""
    p = costs.placement.num_ranks
    for variant in variants:
        try:
            yield variant.label, _Planner(costs, microbatches, variant).plan()
        except _NoRoom:
            continue
    for label, depth in (("zb-h1", 1), ("zb-h2", 2)):
        yield label, [zb_h_program(rank, p, microbatches, depth) for rank in range(p)]
    yield "1f1b-split", _capped_1f1b(costs, microbatches)


def build(
    stages: int,
    microbatches: int,
    costs: CostModel,
    chunks: int = 1,
    variants: tuple[Variant, ...] = ALL_VARIANTS,
) -> Schedule:
    """The best zero-bubble schedule the §3.1 heuristic finds under ``costs.memory_limit``.

    Every candidate is simulated; the one with the shortest iteration time that respects the limit
    is returned, its label in ``meta["variant"]``.  Raises :class:`ScheduleError` when the limit
    cannot hold one microbatch on some rank.
    """
    if chunks != 1:
        raise ScheduleError(f"zb-auto runs one stage per rank; it cannot take chunks={chunks}")
    placement = Placement.loop(stages)
    stage_costs = costs.resolve(placement)
    check_memory_feasible(stage_costs)
    best: tuple[float, str, Schedule] | None = None
    tried = 0
    for label, programs in _candidates(stage_costs, microbatches, variants):
        schedule = Schedule("zb-auto", placement, microbatches, programs)
        try:
            timeline = simulate(schedule, stage_costs)
        except DeadlockError:
            continue
        tried += 1
        if not all(_fits(peak, limit) for peak, limit in zip(timeline.peak_memory, stage_costs.memory_limit)):
            continue
        if best is None or timeline.iteration_time < best[0]:
            best = (timeline.iteration_time, label, schedule)
    if best is None:  # unreachable: the capped 1F1B fits every feasible limit
        raise ScheduleError("zb-auto found no schedule within the memory limit")
    iteration_time, label, schedule = best
    limits = [None if math.isinf(limit) else limit for limit in stage_costs.memory_limit]
    meta = {"variant": label, "iteration_time": iteration_time, "candidates": tried, "memory_limit": limits}
    return Schedule("zb-auto", placement, microbatches, schedule.programs, meta)
