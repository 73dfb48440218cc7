"""ZB-V (Qi et al., 2024, the V-schedule of arXiv 2401.10241): two chunks per rank in a V, split backward.

Rank ``r`` holds virtual stage ``r`` (chunk 0, on the way down) and stage ``2p−1−r`` (chunk 1, on the
way back), so rank 0 computes both the first and the last chunk and the loss is on rank 0.  Every
chunk costs half a rank-stage's time and memory.  With equal F, B and W times and no transfer time
the V reaches zero bubble under p·M_B once m ≥ 2p.

The schedule is found by search, as the authors do, rather than written out as one fixed pattern,
so unequal F/B/W times, per-stage costs and transfer time are all handled on their own terms.  The
search runs a **time-ordered greedy list scheduler** once per :class:`VPolicy` and keeps the
programs with the shortest iteration time (the greedy's clock is the simulator's arithmetic):

* Ops are committed in the order of their start times; each rank knows exactly which of its F and
  B ops are ready, a lower bound for the others and a forecast from their producer's plan, so it
  sees the true idle gaps.  Among ready ops the policy's preference order decides.
* A W fills an idle gap when it fits (some variants: when most of it fits), and runs whenever memory
  blocks a forward.  W only frees memory and feeds nobody, so a W may be placed back into a gap
  that became known only later.
* A forward of chunk 0 admits a new microbatch into the rank; it is allowed only while the memory
  limit keeps room for the chunk-1 forward of at least one more microbatch (``reserve``).  That
  reservation makes the greedy deadlock-free for every limit that holds one microbatch on both
  chunks: the oldest unfinished microbatch can always make its next step.

A second planner, :class:`_RoundPlanner` (variants :data:`ZB_V_ROUND_VARIANTS`), builds the
schedule in rounds of one backward and one forward per rank after a memory-capped chunk-0 warm-up;
its steady 1F1B-like rhythm on both chunks hides transfer time and wins with realistic costs on
deep pipelines (the paper's 28.3B rows at p = 32: bubble 0.117 / 0.091 / 0.051 instead of
0.141 / 0.128 / 0.098).  ZB-V runs both planners and keeps the best.

A variant is dropped as soon as one rank's span so far plus its remaining work exceeds the best
iteration time found, and large problems try only the first few policies (an op budget), so
p = 32, m = 256 builds in about a second or two.  :mod:`.v_memory` reuses :func:`search_v_schedule`
with smaller limits for V-Half and V-Min.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..costs import CostModel, StageCosts
from ..ir import B, F, Op, Placement, Schedule, ScheduleError, W
from ..simulate import simulate

_TOLERANCE = 1e-9

# Op classes a rank chooses between; chunk 0 is stage r, chunk 1 is stage 2p-1-r.
_F0, _F1, _B0, _B1 = "F0", "F1", "B0", "B1"


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


_BACKWARD_FIRST = (_B1, _B0, _F1, _F0)
_CHUNK1_FORWARD_FIRST = (_F1, _B1, _B0, _F0)
_CHUNK1_FIRST = (_B1, _F1, _B0, _F0)

# ZB-V candidates, most often best first (a search under an op budget tries a prefix of them).
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

# Placements of one op per search: past this many, the search stops trying further policies.
_OP_BUDGET = 90_000


def _fits(level: float, limit: float) -> bool:
    return level <= limit * (1 + _TOLERANCE) + _TOLERANCE


# Op classes by index: the forward and backward of chunk 0 (stage r) and chunk 1 (stage 2p-1-r).
_CLASSES = (_F0, _F1, _B0, _B1)
_CHUNK = (0, 1, 0, 1)
_IS_FORWARD = (True, True, False, False)


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
        self.S = S = placement.num_stages
        self.f_end = [[-1.0] * microbatches for _ in range(S)]
        self.b_end = [[-1.0] * microbatches for _ in range(S)]
        self.next_op = [[0, 0, 0, 0] for _ in range(p)]  # next microbatch per class F0, F1, B0, B1
        self.pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
        self.pending_head = [0] * p
        self.clock = [0.0] * p
        self.first_start = [math.inf] * p
        self.memory = [0.0] * p
        self.peak = [0.0] * p
        self.limit = costs.memory_limit
        self.programs: list[list[Op]] = [[] for _ in range(p)]
        self.version = [0] * p
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.global_time = 0.0
        self.last_kind = [-1] * p  # 0 after a forward, 1 after a backward
        self.plan: list[tuple[float, int] | None] = [None] * p  # each rank's proposed (start, class)
        self.no_wait_until = [-math.inf] * p  # a forecast that failed at this time is not waited on again
        self.remaining_work = [costs.rank_work(rank, microbatches) for rank in range(p)]
        self.inflight_cap = [self._inflight_cap(rank) for rank in range(p)]
        # Paced policies let microbatch j enter the pipeline no earlier than j periods of rank 0.
        self.injection_interval = costs.rank_work(0, 1) * policy.pace if policy.pace else 0.0
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

    def _rank_table(self, rank: int) -> list[tuple]:
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

    def _options(self, rank: int) -> list:
        """Per class: None (nothing to do), or (microbatch, ready time or -1 if unknown, earliest, forecast).

        For an input not computed yet, ``earliest`` is a lower bound on its arrival and ``forecast``
        the arrival if its producer runs the op it currently plans to (``inf`` if it plans another).
        """
        options = []
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
        return _fits(self.memory[rank] + need, self.limit[rank])

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
            _, ready, earliest, _ = options[k]
            if ready < 0:
                earliest_unknown = min(earliest_unknown, earliest)
            elif max(ready, now) < best_start:
                best_start, best_class = max(ready, now), k
        if self.policy.guard and best_class >= 0:
            best_start, best_class = self._guarded(rank, options, allowed, order, best_start, best_class)
        if self.pending_head[rank] < len(self.pending_w[rank]):
            gap = min(best_start, earliest_unknown) - now
            if gap > _TOLERANCE or best_class < 0:
                w_stage = self.pending_w[rank][self.pending_head[rank]][0]
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
        self, rank: int, options, allowed, order, best_start: float, best_class: int
    ) -> tuple[float, int]:
        """Wait for a preferred op due (known or forecast) before ``best_class`` would end, if any."""
        finish = best_start + self._duration(rank, best_class)
        for k in order[: order.index(best_class)]:
            if not allowed[k]:
                continue
            _, ready, _, forecast = options[k]
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
        """Place class ``k`` (-1: oldest pending W) on ``rank`` at ``start``; return the ranks to re-plan."""
        costs = self.costs
        if k < 0:
            head = self.pending_head[rank]
            stage, j = self.pending_w[rank][head]
            self.pending_head[rank] = head + 1
            op = W(stage, j)
        else:
            stage = self.tables[rank][k][0]
            j = self.next_op[rank][k]
            self.next_op[rank][k] = j + 1
            op = (F if _IS_FORWARD[k] else B)(stage, j)
        duration = costs.duration(op)
        end = start + duration
        self.remaining_work[rank] -= duration
        self.clock[rank] = end
        self.first_start[rank] = min(self.first_start[rank], start)
        self.memory[rank] += costs.memory_delta(op)
        self.peak[rank] = max(self.peak[rank], self.memory[rank])
        self.programs[rank].append(op)
        if k < 0:
            return (rank,)
        self.global_time = max(self.global_time, start)
        rank_of = costs.placement.stage_ranks
        if _IS_FORWARD[k]:
            self.last_kind[rank] = 0
            self.f_end[stage][j] = end
            consumer = rank_of[stage + 1] if stage + 1 < self.S else rank
        else:
            self.last_kind[rank] = 1
            self.b_end[stage][j] = end
            self.pending_w[rank].append((stage, j))
            consumer = rank_of[stage - 1] if stage > 0 else rank
        return (rank,) if consumer == rank else (rank, consumer)

    def run(self, bound: float = math.inf) -> list[list[Op]] | None:
        """Schedule every op and return the programs.

        Returns ``None`` as soon as some rank's span is sure to exceed ``bound`` (its span so far
        plus its remaining work), so a search can drop a losing variant early.  Raises
        :class:`ScheduleError` if no op can run at all (a memory limit below one microbatch).
        """
        total = 3 * self.S * self.m
        limit = bound * (1 + _TOLERANCE) + _TOLERANCE
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
            if self.clock[rank] - self.first_start[rank] + self.remaining_work[rank] > limit:
                return None
        return self.programs

    def _rank_to_force_weight_op(self) -> int:
        """Every rank waits on another: pick the earliest-free rank with a pending W to run it."""
        waiting = [r for r in range(self.p) if self.pending_head[r] < len(self.pending_w[r])]
        if not waiting:
            raise ScheduleError(
                "the V greedy found no op to run; the memory limit is too small for this schedule "
                "(raise it to at least one microbatch on both chunks of every rank)"
            )
        return min(waiting, key=lambda r: self.clock[r])

    def iteration_time(self) -> float:
        """Max over ranks of (end of its last op − start of its first op)."""
        return max(self.clock[r] - self.first_start[r] for r in range(self.p))


@dataclass(frozen=True)
class RoundVariant:
    """One variant of the round-based V planner (:class:`_RoundPlanner`).

    * ``warmup_share`` — warm-up forwards of chunk 0 stop once a rank's memory would pass this share
      of its limit, leaving the rest for chunk-1 activations and for W ops kept for the cool-down.
    * ``b0_first`` — when both backwards are ready in a round, run chunk 0's (else chunk 1's).
    * ``reserve`` — chunk-1 activations a new chunk-0 forward leaves room for.
    """

    warmup_share: float = 0.5
    b0_first: bool = False
    reserve: int = 1


# Round-planner candidates for ZB-V, most often best first.
ZB_V_ROUND_VARIANTS: tuple[RoundVariant, ...] = (
    RoundVariant(0.5, False, 1),
    RoundVariant(0.5, True, 2),
    RoundVariant(0.6, True, 1),
)


class _Stuck(Exception):
    """A round-planner variant cannot continue within the memory limit."""


class _RoundPlanner:
    """Round-based V planner: every round each rank takes one backward, then one forward.

    A 1F1B-like rhythm on both chunks keeps independent work on every rank, which hides transfer
    time.  Choices in a phase see only ops placed in earlier phases, so an input chain advances one
    hop per round instead of making ranks wait for a whole chain.  The warm-up runs chunk-0 forwards
    on ranks ``0..r`` until rank ``r``'s chunk-1 input arrives (within ``warmup_share`` of memory).
    W ops fill every gap they fit, shorter gaps only when waiting would make the rank the idlest
    (always before a chunk-1 backward and on rank 0), and run whenever memory requires.  Every op is
    timed as the simulator times it, so the iteration time is exact.
    """

    def __init__(self, costs: StageCosts, microbatches: int, variant: RoundVariant):
        self.costs, self.m, self.variant = costs, microbatches, variant
        self.p = p = costs.placement.num_ranks
        self.S = S = costs.placement.num_stages
        self.f_end = [[-1.0] * microbatches for _ in range(S)]
        self.b_end = [[-1.0] * microbatches for _ in range(S)]
        self.count = [[0, 0, 0, 0] for _ in range(p)]  # ops placed per class F0, F1, B0, B1
        self.pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
        self.pending_head = [0] * p
        self.releasable = [0.0] * p  # memory the pending W ops of each rank would free
        self.clock = [0.0] * p
        self.first_start: list[float | None] = [None] * p
        self.idle = [0.0] * p
        self.max_idle = 0.0
        self.memory = [0.0] * p
        self.peak = [0.0] * p
        self.limit = costs.memory_limit
        self.programs: list[list[Op]] = [[] for _ in range(p)]
        rank_of = costs.placement.stage_ranks
        self.hop = [costs.comm[s] if s + 1 < S and rank_of[s] != rank_of[s + 1] else 0.0 for s in range(S)]

    def _stage(self, rank: int, k: int) -> int:
        return rank if _CHUNK[k] == 0 else self.S - 1 - rank

    def _ready(self, rank: int, k: int) -> float | None:
        """Arrival of class ``k``'s next input, or None when nothing is due or it is not placed yet."""
        done = self.count[rank]
        j, s = done[k], self._stage(rank, k)
        if _IS_FORWARD[k]:
            if j >= self.m or (k == 1 and j >= done[0]):
                return None
            if s == 0:
                return 0.0
            end = self.f_end[s - 1][j]
            return end + self.hop[s - 1] if end >= 0 else None
        if j >= done[k - 2]:
            return None
        if s == self.S - 1:
            return self.f_end[s][j]
        end = self.b_end[s + 1][j]
        return end + self.hop[s] if end >= 0 else None

    def _place(self, rank: int, op: Op, ready: float) -> float:
        start = max(self.clock[rank], ready)
        if self.first_start[rank] is None:
            self.first_start[rank] = start
        else:
            self.idle[rank] += start - self.clock[rank]
            self.max_idle = max(self.max_idle, self.idle[rank])
        end = start + self.costs.duration(op)
        self.clock[rank] = end
        self.memory[rank] += self.costs.memory_delta(op)
        self.peak[rank] = max(self.peak[rank], self.memory[rank])
        if not _fits(self.memory[rank], self.limit[rank]):
            raise _Stuck
        self.programs[rank].append(op)
        return end

    def _has_w(self, rank: int) -> bool:
        return self.pending_head[rank] < len(self.pending_w[rank])

    def _put_w(self, rank: int) -> None:
        stage, j = self.pending_w[rank][self.pending_head[rank]]
        self.pending_head[rank] += 1
        self.releasable[rank] -= self.costs.mem_w[stage]
        self._place(rank, W(stage, j), 0.0)

    def _put(self, rank: int, k: int) -> None:
        j, stage = self.count[rank][k], self._stage(rank, k)
        ready = self._ready(rank, k)
        if _IS_FORWARD[k]:
            self.f_end[stage][j] = self._place(rank, F(stage, j), ready)
        else:
            self.b_end[stage][j] = self._place(rank, B(stage, j), ready)
            self.pending_w[rank].append((stage, j))
            self.releasable[rank] += self.costs.mem_w[stage]
        self.count[rank][k] = j + 1

    def _make_room(self, rank: int, need: float) -> None:
        while not _fits(self.memory[rank] + need, self.limit[rank]):
            if not self._has_w(rank):
                raise _Stuck
            self._put_w(rank)

    def _can_make_room(self, rank: int, need: float) -> bool:
        return _fits(self.memory[rank] + need - self.releasable[rank], self.limit[rank])

    def _fill_gap(self, rank: int, ready: float, fill_short: bool) -> None:
        w = self.costs.w
        while self._has_w(rank):
            stage = self.pending_w[rank][self.pending_head[rank]][0]
            if ready < self.clock[rank] + w[stage] * (1 - _TOLERANCE):
                break
            self._put_w(rank)
        gap = ready - self.clock[rank]
        if fill_short and self._has_w(rank) and gap > _TOLERANCE and gap > self.max_idle - self.idle[rank]:
            self._put_w(rank)

    def _warm_up(self) -> None:
        p, mem_b, f = self.p, self.costs.mem_b, self.costs.f
        share = self.variant.warmup_share
        for rank in range(p):
            self._put(rank, 0)
        for rank in range(p - 1, -1, -1):
            arrival = self._ready(rank, 1) if rank < p - 1 else None
            while arrival is not None and self.clock[rank] + f[rank] <= arrival * (1 + _TOLERANCE):
                upstream = range(rank + 1)
                if any(self.count[q][0] >= self.m for q in upstream):
                    break
                room = (self.memory[q] + mem_b[q] + mem_b[self._stage(q, 1)] for q in upstream)
                if not all(_fits(level, share * self.limit[q]) for level, q in zip(room, upstream)):
                    break
                for q in upstream:
                    self._put(q, 0)
            self._make_room(rank, mem_b[self._stage(rank, 1)])
            self._put(rank, 1)

    def _backward_round(self) -> int:
        order = (2, 3) if self.variant.b0_first else (3, 2)
        choices = []
        for rank in range(self.p):
            for k in order:
                ready = self._ready(rank, k)
                if ready is not None:
                    choices.append((rank, k, ready))
                    break
        for rank, k, ready in choices:
            stage = self._stage(rank, k)
            growth = self.costs.mem_w[stage] - self.costs.mem_b[stage]
            if growth > 0:
                self._make_room(rank, growth)
            self._fill_gap(rank, ready, fill_short=True)
            self._put(rank, k)
        return len(choices)

    def _forward_round(self) -> int:
        mem_b = self.costs.mem_b
        choices = []
        for rank in range(self.p):
            k = 1 if self._ready(rank, 1) is not None else 0
            ready = self._ready(rank, k)
            if ready is None:
                continue
            need = mem_b[self._stage(rank, k)]
            if k == 0:
                done = self.count[rank]
                need += min(self.variant.reserve, done[0] + 1 - done[1]) * mem_b[self._stage(rank, 1)]
            if self._can_make_room(rank, need):
                choices.append((rank, k, need, ready))
        for rank, k, need, ready in choices:
            self._make_room(rank, need)
            self._fill_gap(rank, ready, fill_short=False)
            self._put(rank, k)
        return len(choices)

    def run(self) -> list[list[Op]] | None:
        """The programs, or None when this variant gets stuck within the memory limit."""
        try:
            self._warm_up()
            remaining = 4 * self.m * self.p - sum(map(sum, self.count))
            while remaining:
                placed = self._backward_round() + self._forward_round()
                if not placed:
                    raise _Stuck
                remaining -= placed
            for rank in range(self.p):
                while self._has_w(rank):
                    self._put_w(rank)
        except _Stuck:
            return None
        return self.programs

    def iteration_time(self) -> float:
        """Max over ranks of (end of its last op − start of its first op)."""
        return max(self.clock[r] - (self.first_start[r] or 0.0) for r in range(self.p))


def check_memory_feasible(costs: StageCosts) -> None:
    """Raise :class:`ScheduleError` unless every rank can hold one microbatch on both its chunks."""
    placement = costs.placement
    for rank in range(placement.num_ranks):
        need = sum(costs.mem_b[s] for s in placement.stages_of(rank))
        if not _fits(need, costs.memory_limit[rank]):
            raise ScheduleError(
                f"memory limit {costs.memory_limit[rank]:g} on rank {rank} is below the {need:g} one "
                f"microbatch needs on its two V chunks; raise the limit to at least {need:g}"
            )


def _better(key: tuple[float, float], best: tuple[float, float]) -> bool:
    """Shorter iteration time wins; on a tie, lower peak memory."""
    return key[0] < best[0] * (1 - _TOLERANCE) or (
        key[0] <= best[0] * (1 + _TOLERANCE) and key[1] < best[1] * (1 - _TOLERANCE)
    )


def search_v_schedule(
    name: str,
    stages: int,
    microbatches: int,
    costs: CostModel,
    policies: Sequence[VPolicy] = ZB_V_POLICIES,
    meta: Mapping[str, Any] | None = None,
    round_variants: Sequence[RoundVariant] = (),
) -> Schedule:
    """Run the V greedy once per policy and keep the shortest iteration time (ties: lower peak memory).

    Policies are tried in order; once ``_OP_BUDGET`` op placements are spent (large p·m) the
    remaining ones are skipped, so the search stays within a couple of seconds at p = 32, m = 256.
    ``Schedule.meta`` records the memory limit planned for (absolute and in units of one
    rank-stage's M_B), the chosen policy and the iteration time, plus ``meta``.
    """
    if not policies:
        raise ScheduleError("the V search needs at least one policy")
    placement = Placement.vshape(stages)
    resolved = costs.resolve(placement)
    check_memory_feasible(resolved)
    ops_per_run = 3 * placement.num_stages * microbatches
    best: tuple | None = None
    spent = 0
    for variant in round_variants:
        if best is not None and spent >= _OP_BUDGET:
            break
        spent += ops_per_run
        planner = _RoundPlanner(resolved, microbatches, variant)
        programs = planner.run()
        if programs is not None:
            key = (planner.iteration_time(), max(planner.peak))
            if best is None or _better(key, best[0]):
                best = (key, programs, {"planner": "rounds", **asdict(variant)})
    tried = 0
    for policy in policies:
        if tried and spent >= _OP_BUDGET:
            break
        tried += 1
        spent += ops_per_run
        greedy = _VGreedy(resolved, microbatches, policy)
        programs = greedy.run(bound=best[0][0] if best is not None else math.inf)
        if programs is None:
            continue
        key = (greedy.iteration_time(), max(greedy.peak))
        if best is None or _better(key, best[0]):
            best = (key, programs, {"planner": "greedy", **asdict(policy), "order": list(policy.order)})
    if best is None:
        raise ScheduleError("the V search found no schedule; no candidate fits the memory limit")
    _, programs, chosen = best
    # the planners may hold an op back a little longer than needed: the simulator has the true time
    iteration = simulate(Schedule(name, placement, microbatches, programs), resolved).iteration_time
    limit = max(resolved.memory_limit)
    info: dict[str, Any] = {
        "memory_limit": limit if math.isfinite(limit) else None,
        "memory_limit_mb": limit / resolved.memory_unit if math.isfinite(limit) else None,
        "policy": chosen,
        "iteration_time": iteration,
        "policies_tried": tried,
    }
    info.update(meta or {})
    return Schedule(name, placement, microbatches, programs, info)


def build(stages: int, microbatches: int, costs: CostModel, chunks: int = 2) -> Schedule:
    """ZB-V for ``stages`` ranks (two chunks each) under ``costs.memory_limit`` (p·M_B by default)."""
    if chunks != 2:
        raise ScheduleError(f"zb-v runs exactly 2 chunks per rank (the V); got chunks={chunks}")
    return search_v_schedule("zb-v", stages, microbatches, costs, round_variants=ZB_V_ROUND_VARIANTS)
