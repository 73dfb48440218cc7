"""Automatic zero-bubble scheduling under a memory limit (Qi et al., 2024, §3.1): zb-auto, zb-1p, zb-2p.

One stage per rank, split backward.  Candidates on the shared planning core (:mod:`.planning`,
which times every op exactly as the simulator does): the paper's round-based greedy in eight
variants (warm-up, then one F and one B per round with W ops filling the gaps and whenever memory
is full, then the drain), an event-driven list scheduler in four variants, and the handcrafted
ZB-H1/ZB-H2 and a memory-capped split 1F1B when they fit.  The shortest iteration time wins
(``Schedule.meta["variant"]``); the search stops at the analytic lower bound or its op budget.  A
schedule exists whenever one microbatch fits on every rank, else :class:`ScheduleError`.

The phases, the variants and the guarantees are described in ``docs/schedulers.md``.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

from ..bounds import lower_bound
from ..costs import CostModel, StageCosts, within_limit
from ..ir import B, F, Op, Placement, Schedule, ScheduleError, W
from .planning import (
    BuilderCandidate,
    Planned,
    PlanOp,
    PlanState,
    Stuck,
    as_plan_ops,
    check_one_microbatch_fits,
    fixed_candidate,
    search,
)
from .zb_handcrafted import rank_program as zb_h_program

#: Op placements one zb-auto search may spend before it stops trying further candidates: two
#: planner runs at p = 32, m = 256 (3·p·m = 24,576 ops each); smaller problems try every candidate.
OP_BUDGET = 50_000


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

    def planner(self, costs: StageCosts, microbatches: int) -> _Planner:
        """The round-based planner for these choices."""
        return _Planner(costs, microbatches, self)

    @property
    def label(self) -> str:
        """A short name for ``Schedule.meta``."""
        return "greedy-{}-{}-{}".format(
            "tight" if self.tight_warmup else "loose",
            "bfirst" if self.prioritize_b else "ffirst",
            "fillall" if self.fill_small_gaps else "fillneeded",
        )


# Most often best first: on the paper's Table 5 rows the first meets the lower bound at p·M_B
# (zb-1p) and the second is the best at 2p·M_B (zb-2p) on the deepest rows.
_LEADING_VARIANTS = (Variant(True, True, False), Variant(True, True, True))
GREEDY_VARIANTS = _LEADING_VARIANTS + tuple(
    variant
    for variant in (Variant(*choice) for choice in itertools.product((True, False), repeat=3))
    if variant not in _LEADING_VARIANTS
)


class _Planner:
    """Builds all ranks' programs for one :class:`Variant` on a :class:`.planning.PlanState`.

    Only the decisions live here (which op, how many warm-up forwards, when a W fills a gap); the
    state places and times the ops.
    """

    def __init__(self, costs: StageCosts, microbatches: int, variant: Variant):
        self.state = PlanState(costs, microbatches)
        self.p, self.m, self.variant = costs.placement.num_ranks, microbatches, variant
        self.forwards = [0] * self.p
        self.backwards = [0] * self.p
        #: The variant's choices that changed a decision so far.  Flipping any of the others gives
        #: the same decisions at every step, hence the same plan (see :class:`_GreedyRuns`).
        self.mattered: set[str] = set()

    def plan(self, bound: float = math.inf) -> PlanState:
        """Run warm-up, steady rounds and drain.

        Raises :class:`.planning.Stuck` when stuck, and when after some round a rank's span so far
        plus its remaining work exceeds ``bound`` (the plan cannot beat it).
        """
        self._warm_up()
        state, ranks = self.state, range(self.p)
        for i in range(1, self.m):
            self._steady_round(i)
            if bound < math.inf and any(state.cannot_beat(rank, bound) for rank in ranks):
                raise Stuck
        for rank in range(self.p):
            self.state.drain(rank)
        return self.state

    # -- placing one op ------------------------------------------------------------------------

    def _fill_gap(self, rank: int, ready: float) -> None:
        """Fill the wait until ``ready`` with W ops (the paper's "W into every gap")."""
        state = self.state
        pending = state.pending_w[rank]
        if not pending:
            return
        clock, w = state.clock, state.w
        while pending and clock[rank] + w[pending[0]] <= ready:  # PlanState.fill_gap, inlined
            state.put_weight(rank)
        if pending and clock[rank] < ready:
            if ready - clock[rank] > state.max_idle - state.idle[rank]:
                state.put_weight(rank)  # leaving the gap would make this rank the idlest
            else:
                self.mattered.add("fill_small_gaps")
                if self.variant.fill_small_gaps:
                    state.put_weight(rank)

    def _place_forward(self, rank: int) -> None:
        state = self.state
        j = self.forwards[rank]
        growth = state.mem_b[rank]
        if state.memory[rank] + growth > state.capacity[rank]:
            state.make_room(rank, growth)
        if rank > 0:
            self._fill_gap(rank, state.forward_arrival(rank, j))
        state.put_forward(rank, rank, j)
        self.forwards[rank] = j + 1

    def _place_backward(self, rank: int, microbatch: int) -> None:
        state = self.state
        growth = state.mem_w[rank] - state.mem_b[rank]
        if state.memory[rank] + growth > state.capacity[rank]:
            state.make_room(rank, growth)
        if rank < self.p - 1:
            self._fill_gap(rank, state.backward_arrival(rank, microbatch))
        if rank == 0 and self.forwards[0] == self.m:
            # Nobody waits for the first stage's B: in the cool-down its W ops may go first.
            state.drain(rank)
        state.put_backward(rank, rank, microbatch)
        self.backwards[rank] += 1

    # -- phases --------------------------------------------------------------------------------

    def _warm_up(self) -> None:
        """Microbatch 0 through the pipeline, with as many forwards as fit before its B returns."""
        p, state = self.p, self.state
        for rank in range(p):
            state.put_forward(rank, rank, 0)
            self.forwards[rank] = 1
        extra = self._warm_up_counts(tight=self.variant.tight_warmup)
        if extra != self._warm_up_counts(tight=not self.variant.tight_warmup):
            self.mattered.add("tight_warmup")
        for rank in range(p):
            for _ in range(extra[rank]):
                self._place_forward(rank)
        for rank in range(p - 1, -1, -1):
            self._place_backward(rank, 0)

    def _warm_up_counts(self, *, tight: bool) -> list[int]:
        """Extra warm-up forwards per rank, estimated from the last rank backwards (``tight``: the
        variant's ``tight_warmup``)."""
        p, state = self.p, self.state
        f, b, hop = state.f, state.b, state.hop
        extra = [0] * p
        b_done = state.clock[p - 1] + b[p - 1]
        for rank in range(p - 2, -1, -1):
            arrival = b_done + hop[rank]
            clock, level = state.clock[rank], state.memory[rank]
            b_growth = max(0.0, state.mem_w[rank] - state.mem_b[rank])
            f_growth = state.mem_b[rank]
            while 1 + extra[rank] < self.m and within_limit(level + f_growth + b_growth, state.limit[rank]):
                if tight and clock + f[rank] > arrival:
                    break
                if not tight and clock >= arrival:
                    break
                clock += f[rank]
                level += f_growth
                extra[rank] += 1
            b_done = max(clock, arrival) + b[rank]
        for rank in range(1, p):
            # One forward fewer than the rank before, unless that rank already holds them all.
            ahead = extra[rank - 1] if 1 + extra[rank - 1] >= self.m else extra[rank - 1] - 1
            extra[rank] = max(0, min(extra[rank], ahead))
        return extra

    def _steady_round(self, microbatch: int) -> None:
        p = self.p
        wants = [self.forwards[rank] < self.m and not self._skip_forward(rank) for rank in range(p)]
        for rank in range(p - 2, -1, -1):
            wants[rank] = wants[rank] and wants[rank + 1]
        for rank in range(p):
            if wants[rank]:
                self._place_forward(rank)
        for rank in range(p - 1, -1, -1):
            self._place_backward(rank, microbatch)

    def _skip_forward(self, rank: int) -> bool:
        """Whether ``rank`` lets its B pre-empt this round's forward (only with ``prioritize_b``)."""
        nf = self.forwards
        if rank == self.p - 1 or nf[rank] < nf[rank + 1] + 2:
            return False
        if not self.variant.prioritize_b and "prioritize_b" in self.mattered:
            return False  # known to matter: no need to ask again
        if not self._b_is_due(rank):
            return False
        self.mattered.add("prioritize_b")
        return self.variant.prioritize_b

    def _b_is_due(self, rank: int) -> bool:
        """Whether ``rank``'s next B is due so soon that ``prioritize_b`` would skip the forward."""
        state = self.state
        nxt = rank + 1
        b_due = state.clock[nxt] + state.f[nxt] + state.b[nxt] + state.hop[rank]
        clock = state.clock[rank]
        if clock >= b_due:
            return True
        if clock + state.f[rank] + self._room_time(rank) <= b_due:
            return False
        return b_due - clock <= state.max_idle - state.idle[rank]

    def _room_time(self, rank: int) -> float:
        """Time of the W ops ``rank`` would have to run before its next forward fits in memory."""
        state = self.state
        level = state.memory[rank] + state.mem_b[rank]
        pending = len(state.pending_w[rank])
        spent = 0.0
        while pending and not within_limit(level, state.limit[rank]):
            level -= state.mem_w[rank]
            spent += state.w[rank]
            pending -= 1
        return spent


@dataclass(frozen=True)
class ListVariant:
    """The choices of the event-driven list scheduler (an addition to the paper's heuristic).

    ``backward_first``: when both a B and a forward are ready, run the B.  ``fill_small_gaps``: run a
    pending W while waiting even when the next input is due before the W would end.
    """

    backward_first: bool
    fill_small_gaps: bool

    def planner(self, costs: StageCosts, microbatches: int) -> _ListScheduler:
        """The list scheduler for these choices."""
        return _ListScheduler(costs, microbatches, self)

    @property
    def label(self) -> str:
        """A short name for ``Schedule.meta``."""
        return "list-{}-{}".format(
            "bfirst" if self.backward_first else "ffirst",
            "fillall" if self.fill_small_gaps else "fillneeded",
        )


LIST_VARIANTS = tuple(ListVariant(*choice) for choice in itertools.product((True, False), repeat=2))
ALL_VARIANTS = GREEDY_VARIANTS + LIST_VARIANTS


class _ListScheduler:
    """Event-driven list scheduling: a free rank runs the most urgent op whose input has arrived.

    Ranks are visited in the order of the time they become free (a heap), so every decision knows
    all ops that started earlier.  A forward runs only when it fits the memory limit (after W ops if
    those make room); with nothing ready a pending W runs when it ends before the next input is
    expected.  Unlike the round-based planner the order adapts to the real arrival times, which
    matters most when the limit is below ``p·M_B`` and throttles the pipeline.  The ops are placed
    and timed by a :class:`.planning.PlanState`.
    """

    def __init__(self, costs: StageCosts, microbatches: int, variant: ListVariant):
        self.state = state = PlanState(costs, microbatches)
        p = self.p = costs.placement.num_ranks
        self.m, self.variant = microbatches, variant
        b_growth = tuple(w - b for b, w in zip(costs.mem_b, costs.mem_w))
        # A forward must leave room for its own B when B grows memory (M_W > M_B), or ranks can
        # fill up with forwards whose B never fits.
        self.reserve = (
            tuple(f + max(0.0, growth) for f, growth in zip(costs.mem_b, b_growth)),
            b_growth,
        )
        self.forwards = [0] * p
        self.backwards = [0] * p
        self.weights = [0] * p
        self.clock = state.clock
        self.wakeups: list[tuple[float, int]] = [(0.0, rank) for rank in range(p)]

    def plan(self) -> PlanState:
        """Schedule every op (raises :class:`.planning.Stuck` if stuck)."""
        done_w = self.weights
        while self.wakeups:
            time, rank = heapq.heappop(self.wakeups)
            if time >= self.clock[rank] and done_w[rank] < self.m:
                self._decide(rank, time)
        if any(done < self.m for done in done_w):
            raise Stuck
        return self.state

    def _forward_arrival(self, rank: int) -> float | None:
        j = self.forwards[rank]
        if j >= self.m:
            return None
        arrival = self.state.forward_arrival(rank, j)
        return arrival if arrival >= 0 else None

    def _backward_arrival(self, rank: int) -> float | None:
        j = self.backwards[rank]
        if j >= self.forwards[rank]:
            return None
        arrival = self.state.backward_arrival(rank, j)
        return arrival if arrival >= 0 else None

    def _next_arrivals(self, rank: int, now: float) -> tuple[float | None, float | None]:
        """The next known input arrival after ``now``, and the earliest one that may still come
        (known, or estimated from a neighbour's next op for inputs not yet produced)."""
        state = self.state
        known, estimated = [], []
        forward, backward = self._forward_arrival(rank), self._backward_arrival(rank)
        if forward is not None:
            known.append(forward)
        elif rank > 0 and self.forwards[rank] < self.m:
            estimated.append(max(self.clock[rank - 1], now) + state.f[rank - 1] + state.hop[rank - 1])
        if backward is not None:
            known.append(backward)
        elif rank < self.p - 1 and self.backwards[rank] < self.forwards[rank]:
            estimated.append(max(self.clock[rank + 1], now) + state.b[rank + 1] + state.hop[rank])
        later_known = [time for time in known if time > now]
        later = later_known + [time for time in estimated if time > now]
        return (min(later_known) if later_known else None), (min(later) if later else None)

    def _w_needed(self, rank: int, growth: float) -> int | None:
        """W ops to run before an op growing memory by ``growth`` fits; None when they cannot make room."""
        state = self.state
        level, limit = state.memory[rank] + growth, state.limit[rank]
        if within_limit(level, limit):
            return 0
        pending = len(state.pending_w[rank])
        release = state.mem_w[rank]
        if release <= 0:
            return None
        shortfall = (level - limit) / release
        if shortfall > pending:  # also catches an overflow to inf for a vanishing release
            return None
        needed = max(1, math.ceil(shortfall - 1e-12))
        while needed <= pending and not within_limit(level - needed * release, limit):
            needed += 1
        return needed if needed <= pending else None

    def _decide(self, rank: int, now: float) -> None:
        ready: dict[int, int] = {}  # 0 forward, 1 backward -> W ops needed first
        for kind, arrival in ((1, self._backward_arrival(rank)), (0, self._forward_arrival(rank))):
            if arrival is not None and arrival <= now:
                needed = self._w_needed(rank, self.reserve[kind][rank])
                if needed is not None:
                    ready[kind] = needed
        if ready:
            kind = 1 if 1 in ready and (self.variant.backward_first or 0 not in ready) else 0
            self._run(rank, 2 if ready[kind] else kind)
            return
        known, expected = self._next_arrivals(rank, now)
        pending_w = self.weights[rank] < self.backwards[rank]
        if pending_w and (
            expected is None or expected - now >= self.state.w[rank] or self.variant.fill_small_gaps
        ):
            self._run(rank, 2)
        elif known is not None:
            # Only known arrivals schedule a wake-up (so the loop always ends); a neighbour's op
            # wakes the rank for inputs not yet known.
            heapq.heappush(self.wakeups, (known, rank))

    def _run(self, rank: int, kind: int) -> None:
        """Run the next op of ``kind`` (0 F, 1 B, 2 W) at the simulator's time (a W decided while
        the rank idled thus fills the idle time before it), and wake the ranks it concerns."""
        state = self.state
        if kind == 0:
            end = state.put_forward(rank, rank, self.forwards[rank])
            self.forwards[rank] += 1
            if rank + 1 < self.p:
                heapq.heappush(self.wakeups, (max(end + state.hop[rank], self.clock[rank + 1]), rank + 1))
        elif kind == 1:
            end = state.put_backward(rank, rank, self.backwards[rank])
            self.backwards[rank] += 1
            if rank > 0:
                heapq.heappush(self.wakeups, (max(end + state.hop[rank - 1], self.clock[rank - 1]), rank - 1))
        else:
            end = state.put_weight(rank)
            self.weights[rank] += 1
        heapq.heappush(self.wakeups, (end, rank))


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
        while cap > 0 and not within_limit(cap * mem_b + max(mem_b, mem_w), limit):
            cap -= 1
        # A rank may not warm up further than the rank before it, or the two wait on each other.
        warmup = max(0, min(cap, p - 1 - rank, microbatches, previous))
        previous = warmup
        programs.append(_capped_1f1b_program(rank, p, microbatches, warmup))
    return programs


class _GreedyRuns:
    """Which choices mattered in the greedy variants run so far, to skip variants that repeat one.

    A variant differing from a run one only in choices that never changed a decision of that run
    makes the same decision at every step from the same state, so it builds the same plan (or
    gets stuck, or gives up on the bound, at the same round: the bound only falls during a
    search).  On the issue-29 cost grid four in five of zb-1p's variants repeat another, none of
    zb-2p's.
    """

    def __init__(self) -> None:
        self.runs: list[tuple[Variant, frozenset[str]]] = []

    def record(self, planner: _Planner) -> None:
        """Keep what ``planner``'s run decided with (call after it ended, stuck or not)."""
        self.runs.append((planner.variant, frozenset(planner.mattered)))

    def repeats(self, variant: Variant) -> bool:
        """Whether ``variant`` would repeat a run already made."""
        return any(
            all(getattr(variant, choice) == getattr(ran, choice) for choice in mattered)
            for ran, mattered in self.runs
        )


def _repeat(bound: float) -> None:
    """The run of a variant that repeats an earlier one: nothing new."""
    return None


def _planner_candidate(
    costs: StageCosts, microbatches: int, variant: Variant | ListVariant, runs: _GreedyRuns
) -> BuilderCandidate:
    def run(bound: float) -> Planned | None:
        planner = variant.planner(costs, microbatches)
        try:
            return Planned.of(planner.plan(bound) if isinstance(planner, _Planner) else planner.plan())
        except Stuck:
            return None
        finally:
            if isinstance(planner, _Planner):
                runs.record(planner)

    return BuilderCandidate("list" if isinstance(variant, ListVariant) else "greedy", variant.label, run)


def _candidates(
    costs: StageCosts, microbatches: int, variants: tuple[Variant | ListVariant, ...]
) -> Iterator[BuilderCandidate]:
    """The planners' variants (less greedy ones that would repeat a run, see :class:`_GreedyRuns`),
    then the handcrafted ZB-H1, ZB-H2 and the memory-capped 1F1B with split backward (each skipped
    when it exceeds the limit)."""
    p = costs.placement.num_ranks
    runs = _GreedyRuns()
    for variant in variants:
        # Lazy: the runs before this one have ended when the search asks for the next candidate.
        if isinstance(variant, Variant) and runs.repeats(variant):
            # It would not beat the run it repeats.  The search charges it a full run's ops, so
            # the op budget admits the same later candidates as if it had run.
            yield BuilderCandidate("greedy", variant.label, _repeat)
            continue
        yield _planner_candidate(costs, microbatches, variant, runs)
    for label, depth in (("zb-h1", 1), ("zb-h2", 2)):
        yield fixed_candidate(
            "handcrafted", label, costs, microbatches, partial(_handcrafted, p, microbatches, depth)
        )
    yield fixed_candidate(
        "handcrafted",
        "1f1b-split",
        costs,
        microbatches,
        lambda: as_plan_ops(_capped_1f1b(costs, microbatches)),
    )


def _handcrafted(p: int, microbatches: int, depth: int) -> list[list[PlanOp]]:
    return as_plan_ops([zb_h_program(rank, p, microbatches, depth) for rank in range(p)])


def build(
    stages: int,
    microbatches: int,
    costs: CostModel,
    chunks: int = 1,
    variants: tuple[Variant | ListVariant, ...] = ALL_VARIANTS,
) -> Schedule:
    """The best zero-bubble schedule the §3.1 heuristic finds under ``costs.memory_limit``.

    Among all candidates (see the module docstring) the one with the shortest iteration time wins;
    the search stops early when a candidate meets the analytic lower bound.  ``meta`` follows
    :func:`.planning.schedule_meta` (``variant`` names the winner).  ``variants`` restricts the
    planners' variants (the fallbacks always take part).  Raises :class:`ScheduleError` when the
    limit cannot hold one microbatch on some rank.
    """
    if chunks != 1:
        raise ScheduleError(f"zb-auto runs one stage per rank; it cannot take chunks={chunks}")
    placement = Placement.loop(stages)
    stage_costs = costs.resolve(placement)
    check_one_microbatch_fits(stage_costs, "zb-auto")
    floor = lower_bound(stages, microbatches, costs, placement=placement)
    # The capped 1F1B fits every feasible limit, so there is always at least one candidate.
    candidates = _candidates(stage_costs, microbatches, variants)
    # Every greedy variant runs whatever the size (they lead the candidates): their best is the
    # authors' heuristic, which zb-auto must never lose to.  The budget limits only the rest.
    greedy_runs = sum(isinstance(variant, Variant) for variant in variants)
    budget = max(OP_BUDGET, greedy_runs * 3 * stages * microbatches)
    return search("zb-auto", stage_costs, microbatches, candidates, budget, floor)
