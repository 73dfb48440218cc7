"""The time-ordered V greedy and the V search's candidates, shared by zb-v and V-Half / V-Min.

:class:`_VGreedy` commits ops in the order of their start times, each rank choosing among its ready
op classes by one :class:`VPolicy` (preferred order, alternation, guard, gap share, reserve,
lifespan cap, pacing).  :func:`v_candidates` turns the V planners — the equalised planner
(:mod:`.v_equalised`), the round planner (:mod:`.v_rounds`) and this greedy — into candidates for
:func:`.core.search`.  Which policies and variants a schedule tries is the family's choice:
:mod:`..zb_v` and :mod:`..v_memory` keep their own tables.

How the greedy decides is described in ``docs/schedulers.md``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ...costs import StageCosts
from ...ir import ScheduleError
from .core import BuilderCandidate, Planned, PlanState
from .v_equalised import EqualisedVariant, equalised_plan
from .v_rounds import (
    _B0,
    _B1,
    _CHUNK,
    _CLASSES,
    _F0,
    _F1,
    _IS_FORWARD,
    _TOLERANCE,
    RoundPlanner,
    RoundVariant,
)


@dataclass(frozen=True)
class VPolicy:
    """One variant of the greedy's choices.

    * ``order`` — the op classes a rank prefers when several are ready (``"B1"`` is the backward of
      chunk 1, ``"F0"`` the forward of chunk 0, ...).
    * ``alternate`` — prefer a forward after a backward and a backward after a forward (1F1B-like),
      taking the other kind when the preferred one is not ready.
    * ``guard`` — wait for a preferred op that is ready (or forecast ready, from its producer's
      plan) before the op the rank could start now would end.
    * ``gap_share`` — the share of a W's time an idle gap must offer for a W to start in it
      (1: only gaps the W fits; 0: any gap).
    * ``reserve`` — chunk-1 activations each new chunk-0 forward leaves room for (at least one, which
      keeps the greedy deadlock-free).
    * ``lifespan_slack`` — when set, caps the microbatches between chunk-0 forward and backward on a
      rank at the count a full-throughput V keeps there when no op waits (the V-Min building block;
      about (2p − r)/3 on rank r for equal costs) plus this slack, spreading activations evenly
      under tight memory limits.
    * ``pace`` — when > 0, microbatch j enters no earlier than ``j · pace`` periods of rank 0 (its
      F+B+W per microbatch): the building blocks' steady rhythm instead of a warm-up burst.
    """

    order: tuple[str, ...] = (_B1, _B0, _F1, _F0)
    alternate: bool = False
    guard: bool = False
    gap_share: float = 1.0
    reserve: int = 1
    lifespan_slack: int | None = None
    pace: float = 0.0

    def __post_init__(self) -> None:
        if sorted(self.order) != sorted((_F0, _F1, _B0, _B1)):
            raise ScheduleError(f"a V policy order must list F0, F1, B0 and B1 once each; got {self.order}")
        if self.reserve < 1:
            raise ScheduleError(
                f"a V policy must reserve room for at least one chunk-1 forward, got {self.reserve}"
            )

    @property
    def label(self) -> str:
        """A short name for ``Schedule.meta["variant"]``."""
        parts = ["".join(self.order)]
        parts += [name for name, on in (("alternate", self.alternate), ("guard", self.guard)) if on]
        if self.gap_share != 1.0:
            parts.append(f"gap{self.gap_share:g}")
        if self.reserve != 1:
            parts.append(f"reserve{self.reserve}")
        if self.lifespan_slack is not None:
            parts.append(f"slack{self.lifespan_slack}")
        if self.pace:
            parts.append(f"pace{self.pace:g}")
        return "greedy-" + "-".join(parts)


class _VGreedy:
    """One run of the time-ordered V greedy for one policy (all state lives in the instance).

    Ops are committed in the order of their start times from a heap holding one proposal per rank
    (stale proposals are skipped by a version number).  A commit changes the options of at most two
    ranks, its own and the one that consumes its output, and only those re-propose.
    """

    def __init__(self, costs: StageCosts, microbatches: int, policy: VPolicy):
        placement = costs.placement
        self.costs, self.policy, self.m = costs, policy, microbatches
        self.p = p = placement.num_ranks
        self.S = placement.num_stages
        self.state = state = PlanState(costs, microbatches)
        # the state's lists, under short names (the state updates them in place)
        self.f_end, self.b_end, self.clock = state.f_end, state.b_end, state.clock
        self.pending_w = state.pending_w
        self.next_op = [[0, 0, 0, 0] for _ in range(p)]  # next microbatch per class F0, F1, B0, B1
        self.version = [0] * p
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.global_time = 0.0
        self.last_kind = [-1] * p  # 0 after a forward, 1 after a backward
        self.plan: list[tuple[float, int] | None] = [None] * p  # each rank's proposed (start, class)
        self.no_wait_until = [-math.inf] * p  # a forecast that failed at this time is not waited on again
        self.inflight_cap = [self._inflight_cap(rank) for rank in range(p)]
        # Paced policies let microbatch j enter the pipeline no earlier than j periods of rank 0.
        self.injection_interval = costs.rank_work(0, 1) * policy.pace if policy.pace else 0.0
        self.rank_of = placement.stage_ranks
        self.tables = [self._rank_table(rank) for rank in range(p)]
        base = tuple(_CLASSES.index(name) for name in policy.order)
        forwards_first = tuple(k for k in base if _IS_FORWARD[k]) + tuple(
            k for k in base if not _IS_FORWARD[k]
        )
        backwards_first = tuple(k for k in base if not _IS_FORWARD[k]) + tuple(
            k for k in base if _IS_FORWARD[k]
        )
        # Preference order indexed by last_kind + 1: none yet, after a forward, after a backward.
        self.orders = (base, backwards_first, forwards_first) if policy.alternate else (base, base, base)

    def _inflight_cap(self, rank: int) -> float:
        """Chunk-0 lifespan cap: microbatches a full-throughput V keeps in flight on ``rank``, plus slack.

        A microbatch's chunk-0 activation on rank r lives from F(r) to B(r): the forwards of stages
        r..S−1, the backwards of S−1..r+1 and their transfers, if nothing waits.  The rank starts
        one microbatch per period (its F+B+W of both chunks), so lifespan / period are in flight.
        """
        slack = self.policy.lifespan_slack
        if slack is None:
            return math.inf
        costs, S = self.costs, self.S
        rank_of = costs.placement.stage_ranks
        lifespan = sum(costs.f[s] for s in range(rank, S)) + sum(costs.b[s] for s in range(rank + 1, S))
        lifespan += 2 * sum(costs.comm[s] for s in range(rank, S - 1) if rank_of[s] != rank_of[s + 1])
        period = costs.rank_work(rank, 1)
        return max(1, math.ceil(lifespan / period - _TOLERANCE) + slack) if period > 0 else math.inf

    def _rank_table(self, rank: int) -> list[tuple[int, int, float, int, float]]:
        """Per class: (stage, dependency stage or -1, transfer time, producer rank, producer duration)."""
        costs, S = self.costs, self.S
        rank_of = costs.placement.stage_ranks
        table = []
        for k in range(4):
            stage = rank if _CHUNK[k] == 0 else S - 1 - rank
            if _IS_FORWARD[k]:
                dep, dep_duration = stage - 1, (costs.f[stage - 1] if stage > 0 else 0.0)
            else:
                dep, dep_duration = (
                    (stage + 1 if stage + 1 < S else -1),
                    (costs.b[stage + 1] if stage + 1 < S else 0.0),
                )
            crosses = dep >= 0 and rank_of[dep] != rank
            hop = costs.comm[min(stage, dep)] if crosses else 0.0
            table.append((stage, dep, hop, rank_of[dep] if dep >= 0 else rank, dep_duration))
        return table

    # -- decisions ---------------------------------------------------------------------------

    def _options(self, rank: int) -> list[tuple[int, float, float, float] | None]:
        """Per class: None (nothing to do), or (microbatch, ready time or -1 if unknown, earliest, forecast).

        For an input not computed yet, ``earliest`` is a lower bound on its arrival and ``forecast``
        the arrival if its producer runs the op it currently plans to (``inf`` if it plans another).
        """
        options: list[tuple[int, float, float, float] | None] = []
        nxt = self.next_op[rank]
        for k, (stage, dep, hop, dep_rank, dep_duration) in enumerate(self.tables[rank]):
            j = nxt[k]
            if _IS_FORWARD[k]:
                if j >= self.m:
                    options.append(None)
                    continue
                done = self.f_end[dep][j] if dep >= 0 else j * self.injection_interval
            else:
                if j >= nxt[k - 2]:
                    options.append(None)
                    continue
                done = self.b_end[dep][j] if dep >= 0 else self.f_end[stage][j]
            if done >= 0:
                options.append((j, done + hop, done + hop, done + hop))
                continue
            earliest = max(self.global_time, self.clock[dep_rank]) + dep_duration + hop
            forecast = math.inf
            planned = self.plan[dep_rank]
            if planned is not None:
                planned_start, planned_class = planned
                producer_table = self.tables[dep_rank][planned_class]
                if producer_table[0] == dep and self.next_op[dep_rank][planned_class] == j:
                    forecast = max(planned_start + dep_duration + hop, earliest)
            options.append((j, -1.0, earliest, forecast))
        return options

    def _forward_fits(self, rank: int, k: int) -> bool:
        """Whether a forward may start: memory (with the chunk-1 reservation) and the lifespan cap."""
        mem_b = self.costs.mem_b
        table, nxt = self.tables[rank], self.next_op[rank]
        need = mem_b[table[k][0]]
        if k == 0:
            if nxt[0] - nxt[2] >= self.inflight_cap[rank]:
                return False
            waiting_for_chunk1 = nxt[0] - nxt[1]
            need += min(self.policy.reserve, waiting_for_chunk1 + 1) * mem_b[table[1][0]]
        return self.state.fits(rank, need)

    def _propose(self, rank: int) -> None:
        """Push this rank's next op (at its start time) onto the heap, or nothing if it must wait."""
        self.version[rank] += 1
        self.plan[rank] = None
        now = self.clock[rank]
        options = self._options(rank)
        order = self.orders[self.last_kind[rank] + 1]
        allowed = [
            o is not None and (not _IS_FORWARD[k] or self._forward_fits(rank, k))
            for k, o in enumerate(options)
        ]
        memory_blocked = any(o is not None and not allowed[k] for k, o in enumerate(options))
        best_start, best_class = math.inf, -1
        earliest_unknown = math.inf
        for k in order:
            if not allowed[k]:
                continue
            _, ready, earliest, _ = options[k]  # type: ignore[misc]
            if ready < 0:
                earliest_unknown = min(earliest_unknown, earliest)
            elif max(ready, now) < best_start:
                best_start, best_class = max(ready, now), k
        if self.policy.guard and best_class >= 0:
            best_start, best_class = self._guarded(rank, options, allowed, order, best_start, best_class)
        if self.pending_w[rank]:
            gap = min(best_start, earliest_unknown) - now
            if gap > _TOLERANCE or best_class < 0:
                w_stage = self.pending_w[rank][0]
                fits_gap = gap >= self.costs.w[w_stage] * self.policy.gap_share * (1 - _TOLERANCE)
                frees_memory = memory_blocked and self.costs.mem_w[w_stage] > 0
                if fits_gap or frees_memory:
                    heapq.heappush(self.heap, (now, 0, rank, self.version[rank], -1))
                    return
        if best_class >= 0:
            priority = 1 + order.index(best_class)
            heapq.heappush(self.heap, (best_start, priority, rank, self.version[rank], best_class))
            self.plan[rank] = (best_start, best_class)

    def _guarded(
        self,
        rank: int,
        options: list[tuple[int, float, float, float] | None],
        allowed: list[bool],
        order: tuple[int, ...],
        best_start: float,
        best_class: int,
    ) -> tuple[float, int]:
        """Wait for a preferred op due (known or forecast) before ``best_class`` would end, if any."""
        finish = best_start + self._duration(rank, best_class)
        for k in order[: order.index(best_class)]:
            if not allowed[k]:
                continue
            _, ready, _, forecast = options[k]  # type: ignore[misc]
            due = ready if ready >= 0 else forecast
            if due < finish - _TOLERANCE and (ready >= 0 or due > self.no_wait_until[rank]):
                return max(due, self.clock[rank]), k
        return best_start, best_class

    def _ready_by(self, rank: int, k: int, start: float) -> bool:
        """Whether class ``k``'s next op has its input by ``start`` (a forecast may have failed)."""
        option = self._options(rank)[k]
        return option is not None and 0 <= option[1] <= start + _TOLERANCE

    def _duration(self, rank: int, k: int) -> float:
        """Compute time of class ``k``'s op on ``rank``."""
        stage = self.tables[rank][k][0]
        return self.costs.f[stage] if _IS_FORWARD[k] else self.costs.b[stage]

    def _commit(self, rank: int, k: int, start: float) -> tuple[int, ...]:
        """Place class ``k`` (-1: oldest pending W) on ``rank``, decided at ``start``; return the
        ranks to re-plan.  The state times the op itself (never later than ``start``)."""
        state = self.state
        if k < 0:
            state.put_weight(rank)
            return (rank,)
        stage = self.tables[rank][k][0]
        j = self.next_op[rank][k]
        self.next_op[rank][k] = j + 1
        if _IS_FORWARD[k]:
            not_before = j * self.injection_interval if stage == 0 else 0.0
            state.put_forward(rank, stage, j, not_before)
            self.last_kind[rank] = 0
            consumer = self.rank_of[stage + 1] if stage + 1 < self.S else rank
        else:
            state.put_backward(rank, stage, j)
            self.last_kind[rank] = 1
            consumer = self.rank_of[stage - 1] if stage > 0 else rank
        self.global_time = max(self.global_time, start)
        return (rank,) if consumer == rank else (rank, consumer)

    def run(self, bound: float = math.inf) -> PlanState | None:
        """Schedule every op and return the programs.

        Returns ``None`` as soon as some rank's span is sure to exceed ``bound`` (its span so far
        plus its remaining work), so a search can drop a losing variant early.  Raises
        :class:`ScheduleError` if no op can run at all (a memory limit below one microbatch).
        """
        total = 3 * self.S * self.m
        state = self.state
        for rank in range(self.p):
            self._propose(rank)
        placed = 0
        while placed < total:
            if self.heap:
                start, _, rank, version, k = heapq.heappop(self.heap)
                if version != self.version[rank]:
                    continue
                if k >= 0 and not self._ready_by(rank, k, start):
                    self.no_wait_until[rank] = start  # waited on a forecast that did not come true
                    self._propose(rank)
                    continue
            else:
                rank = self._rank_to_force_weight_op()
                start, k = self.clock[rank], -1
            for touched in self._commit(rank, k, start):
                self._propose(touched)
            placed += 1
            if state.cannot_beat(rank, bound):
                return None
        return state

    def _rank_to_force_weight_op(self) -> int:
        """Every rank waits on another: pick the earliest-free rank with a pending W to run it."""
        waiting = [r for r in range(self.p) if self.pending_w[r]]
        if not waiting:
            raise ScheduleError(
                "the V greedy found no op to run; the memory limit is too small for this schedule "
                "(raise it to at least one microbatch on both chunks of every rank)"
            )
        return min(waiting, key=lambda r: self.clock[r])


def _greedy_candidate(costs: StageCosts, microbatches: int, policy: VPolicy) -> BuilderCandidate:
    def run(bound: float) -> Planned | None:
        plan = _VGreedy(costs, microbatches, policy).run(bound)
        return Planned.of(plan) if plan is not None else None

    return BuilderCandidate("greedy", policy.label, run)


def _round_candidate(costs: StageCosts, microbatches: int, variant: RoundVariant) -> BuilderCandidate:
    def run(bound: float) -> Planned | None:
        plan = RoundPlanner(costs, microbatches, variant).run(bound)
        return Planned.of(plan) if plan is not None else None

    return BuilderCandidate("rounds", variant.label, run)


def _equalised_candidate(
    costs: StageCosts, microbatches: int, variant: EqualisedVariant, floor: float
) -> BuilderCandidate:
    def run(bound: float) -> Planned | None:
        plan, effort = equalised_plan(costs, microbatches, variant, bound, floor=floor)
        return Planned.of(plan, effort) if plan is not None else None

    return BuilderCandidate("equalised", variant.label, run)


def v_candidates(
    costs: StageCosts,
    microbatches: int,
    policies: Sequence[VPolicy],
    round_variants: Sequence[RoundVariant] = (),
    equalised_variants: Sequence[EqualisedVariant] = (),
    *,
    floor: float = 0.0,
) -> Iterator[BuilderCandidate]:
    """The V search's candidates in the order they are tried: equalised, rounds, then greedy
    (``floor``: the search's lower bound, where the equalised planner's passes stop)."""
    for equalised in equalised_variants:
        yield _equalised_candidate(costs, microbatches, equalised, floor)
    for variant in round_variants:
        yield _round_candidate(costs, microbatches, variant)
    for policy in policies:
        yield _greedy_candidate(costs, microbatches, policy)
