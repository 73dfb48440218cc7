"""Exact contiguous partitioning of a layer sequence into the virtual stages of a placement.

A pipeline cuts its ``n`` layers into ``S`` contiguous chunks (virtual stages); the placement puts
stage ``s`` on rank ``stage_ranks[s]``.  A rank's *load* is the compute of all its stages, and the
steady state of every schedule runs at the pace of the most loaded rank, so the partition that
minimises the largest load (the *bottleneck*) is the one to start from.

:func:`optimal_partition` finds it exactly, optionally under a per-rank memory cap in which a stage
costs ``fixed + inflight[s] · scaled`` (its parameters and optimizer state, plus the activations of
the microbatches it holds at once):

* one stage per rank (``v = 1``): a dynamic program over cut points, ``O(S·n²)``;
* several stages per rank (V-shape, interleaved): rank loads are sums of non-adjacent chunks, so the
  program does not decompose; a depth-first search over cut points with a sound bound (a partial
  assignment whose largest load already reaches the incumbent cannot improve it) enumerates every
  partition that could be better and is therefore exact as well.

Both are checked against brute force over all ``C(n−1, S−1)`` cut sets in
``tests/schedule/modelplan/test_plan.py``.
Pure Python; no torch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .ir import ScheduleError

__all__ = [
    "MemoryCap",
    "Partition",
    "bounds_of",
    "even_partition",
    "optimal_partition",
]

_NODE_BUDGET = 200_000


@dataclass(frozen=True)
class MemoryCap:
    """A per-rank memory constraint for :func:`optimal_partition`.

    Stage ``s`` spanning layers ``[a, b)`` needs ``sum(fixed[a:b]) + inflight[s] · sum(scaled[a:b])``;
    the stages of rank ``r`` together may need at most ``capacity[r]``.
    """

    fixed: Sequence[float]
    scaled: Sequence[float]
    inflight: Sequence[float]
    capacity: Sequence[float]


@dataclass(frozen=True)
class Partition:
    """Where stages ``1..S−1`` start (``cuts``) and the largest rank load it gives (``bottleneck``).

    ``proven`` is False when the search for a multi-chunk placement stopped at its node budget: the
    partition is then the best found, not necessarily the best there is.
    """

    cuts: tuple[int, ...]
    bottleneck: float
    proven: bool = True


def even_partition(count: int, chunks: int) -> list[int]:
    """Start indices of chunks 1..chunks−1 of an even split of ``count`` layers (first chunks larger)."""
    base, extra = divmod(count, chunks)
    cuts, position = [], 0
    for chunk in range(chunks - 1):
        position += base + (1 if chunk < extra else 0)
        cuts.append(position)
    return cuts


def bounds_of(cuts: Sequence[int], count: int) -> list[int]:
    """Start index of every stage plus ``count`` at the end: ``[0, *cuts, count]``."""
    return [0, *cuts, count]


def rank_loads(
    work: Sequence[float], cuts: Sequence[int], stage_ranks: Sequence[int], ranks: int
) -> list[float]:
    """The compute load of each rank for the partition ``cuts``."""
    bounds = bounds_of(cuts, len(work))
    loads = [0.0] * ranks
    for stage, rank in enumerate(stage_ranks):
        loads[rank] += math.fsum(work[bounds[stage] : bounds[stage + 1]])
    return loads


def rank_memory(
    memory: MemoryCap, cuts: Sequence[int], stage_ranks: Sequence[int], ranks: int
) -> list[float]:
    """What each rank needs under ``memory``'s model for the partition ``cuts``."""
    bounds = bounds_of(cuts, len(memory.fixed))
    needs = [0.0] * ranks
    for stage, rank in enumerate(stage_ranks):
        a, b = bounds[stage], bounds[stage + 1]
        needs[rank] += math.fsum(memory.fixed[a:b]) + memory.inflight[stage] * math.fsum(memory.scaled[a:b])
    return needs


def optimal_partition(
    work: Sequence[float],
    stage_ranks: Sequence[int],
    memory: MemoryCap | None = None,
) -> Partition | None:
    """The contiguous partition of the layers (``work[i]`` each) minimising the largest rank load.

    ``stage_ranks[s]`` is the rank of stage ``s`` (``len(stage_ranks)`` stages, at least one layer
    each).  With ``memory`` only partitions within every rank's capacity count; ``None`` when none is.
    """
    n, stages = len(work), len(stage_ranks)
    if stages < 1 or n < stages:
        raise ScheduleError(f"{n} layers cannot fill {stages} pipeline stages; give at least {stages} layers")
    if any(w < 0 or not math.isfinite(w) for w in work):
        raise ScheduleError("layer costs must be finite and non-negative")
    ranks = max(stage_ranks) + 1
    prefix = list(itertools.accumulate(work, initial=0.0))
    if len(set(stage_ranks)) == stages:  # one stage per rank: the program decomposes
        return _dynamic_program(prefix, stage_ranks, memory)
    if memory is None and _is_vshape(stage_ranks):
        return _vshape_partition(prefix, ranks)
    return _branch_and_bound(prefix, stage_ranks, ranks, memory)


class _Memory:
    """Prefix sums of a :class:`MemoryCap` for O(1) stage needs."""

    def __init__(self, memory: MemoryCap):
        self.fixed = list(itertools.accumulate(memory.fixed, initial=0.0))
        self.scaled = list(itertools.accumulate(memory.scaled, initial=0.0))
        self.inflight = memory.inflight
        self.capacity = memory.capacity

    def need(self, stage: int, a: int, b: int) -> float:
        return self.fixed[b] - self.fixed[a] + self.inflight[stage] * (self.scaled[b] - self.scaled[a])


def _dynamic_program(
    prefix: list[float], stage_ranks: Sequence[int], memory: MemoryCap | None
) -> Partition | None:
    """``best[s][i]``: the smallest bottleneck of stages ``0..s`` covering layers ``[0, i)``."""
    n, stages = len(prefix) - 1, len(stage_ranks)
    mem = _Memory(memory) if memory is not None else None
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(stages)]
    choice = [[0] * (n + 1) for _ in range(stages)]
    for i in range(1, n - stages + 2):
        if mem is None or mem.need(0, 0, i) <= mem.capacity[stage_ranks[0]]:
            best[0][i] = prefix[i]
    for s in range(1, stages):
        cap = mem.capacity[stage_ranks[s]] if mem is not None else inf
        for i in range(s + 1, n - stages + s + 2):
            value, where = inf, 0
            for j in range(s, i):
                previous = best[s - 1][j]
                if previous >= value:
                    continue
                if mem is not None and mem.need(s, j, i) > cap:
                    continue
                candidate = max(previous, prefix[i] - prefix[j])
                if candidate < value:
                    value, where = candidate, j
            best[s][i], choice[s][i] = value, where
    if best[stages - 1][n] == inf:
        return None
    cuts, position = [], n
    for s in range(stages - 1, 0, -1):
        position = choice[s][position]
        cuts.append(position)
    return Partition(tuple(reversed(cuts)), best[stages - 1][n])


def _branch_and_bound(
    prefix: list[float],
    stage_ranks: Sequence[int],
    ranks: int,
    memory: MemoryCap | None,
    node_budget: int = _NODE_BUDGET,
) -> Partition | None:
    """Depth-first over the end of each stage; prunes partial assignments that cannot beat the incumbent.

    Two sound bounds prune: a rank already at the incumbent's bottleneck, and remaining work that
    no longer fits below the incumbent on the ranks that still get a stage.  After ``node_budget``
    visited nodes the best partition found so far is returned with ``proven=False``.
    """
    search = _BranchAndBound(prefix, stage_ranks, ranks, memory, node_budget)
    proven = search.explore(0, 0, 0.0)
    if search.best_cuts is None:
        return None
    return Partition(search.best_cuts, search.best_value, proven)


class _BranchAndBound:
    """:func:`_branch_and_bound`'s search: the partial assignment being extended and the incumbent."""

    def __init__(
        self,
        prefix: list[float],
        stage_ranks: Sequence[int],
        ranks: int,
        memory: MemoryCap | None,
        node_budget: int,
    ):
        self.prefix, self.stage_ranks, self.node_budget = prefix, stage_ranks, node_budget
        self.n, self.stages = len(prefix) - 1, len(stage_ranks)
        self.mem = _Memory(memory) if memory is not None else None
        self.total = prefix[self.n]
        self.floor = self.total / ranks  # no partition's bottleneck is below the mean load
        # ranks that still get a stage after stage s: they alone can take the work behind stage s
        self.later = [sorted(set(stage_ranks[s + 1 :])) for s in range(self.stages)]
        self.loads = [0.0] * ranks
        self.needs = [0.0] * ranks
        self.cuts: list[int] = []
        self.best_value = math.inf
        self.best_cuts: tuple[int, ...] | None = None
        self.visited = 0

    def explore(self, stage: int, start: int, worst: float) -> bool:
        """Explore every completion of stages ``stage..``; False once the node budget is spent."""
        prefix, loads, mem = self.prefix, self.loads, self.mem
        rank = self.stage_ranks[stage]
        for end in self._ends(stage, start):
            self.visited += 1
            if self.visited > self.node_budget:
                return False
            added = prefix[end] - prefix[start]
            load = loads[rank] + added
            if max(worst, load) >= self.best_value:
                continue
            need = mem.need(stage, start, end) if mem is not None else 0.0
            if mem is not None and self.needs[rank] + need > mem.capacity[rank]:
                continue
            if stage == self.stages - 1:
                self.best_value, self.best_cuts = max(worst, load), tuple(self.cuts)
                continue
            loads[rank] = load
            finished = self._descend(stage, end, need, max(worst, load))
            loads[rank] -= added
            if not finished:
                return False
            if self.best_value <= self.floor:
                return True
        return True

    def _ends(self, stage: int, start: int) -> Sequence[int]:
        """Where stage ``stage``, starting at layer ``start``, may end, in the order to try them."""
        if stage == self.stages - 1:
            return (self.n,)
        # the end closest to an even share of the remaining work first: good incumbents early
        prefix = self.prefix
        share = (self.total - prefix[start]) / (self.stages - stage)
        return sorted(
            range(start + 1, self.n - (self.stages - stage - 1) + 1),
            key=lambda end: abs(prefix[end] - prefix[start] - share),
        )

    def _descend(self, stage: int, end: int, need: float, worst: float) -> bool:
        """Extend the assignment by stage ``stage`` ending at ``end`` and explore the next stage, unless
        the work left cannot fit below the incumbent on the ranks left; False once the budget is spent."""
        room = sum(self.best_value - self.loads[r] for r in self.later[stage])
        if not (self.total - self.prefix[end] < room or self.best_value == math.inf):
            return True  # pruned: nothing below this end can beat the incumbent
        rank = self.stage_ranks[stage]
        self.needs[rank] += need
        self.cuts.append(end)
        finished = self.explore(stage + 1, end, worst)
        self.cuts.pop()
        self.needs[rank] -= need
        return finished


def _is_vshape(stage_ranks: Sequence[int]) -> bool:
    ranks = len(stage_ranks) // 2
    return len(stage_ranks) == 2 * ranks and list(stage_ranks) == [*range(ranks), *range(ranks - 1, -1, -1)]


def _vshape_partition(prefix: list[float], ranks: int) -> Partition:
    """The V-shape: rank ``r`` holds stage ``r`` ``[a_r, a_{r+1})`` and stage ``S−1−r`` ``[b_{r+1}, b_r)``.

    Working from the outside in, a state is ``(a_r, b_r)``.  For a threshold ``T`` the next state
    ``(a', b')`` is reachable from ``(a, b)`` when ``P[a'] − P[b'] ≤ T + P[a] − P[b]`` (``P`` the
    prefix sums): one 2-D running maximum of ``P[a] − P[b]`` over the reachable states with
    ``a < a'`` and ``b > b'`` decides every next state, so a feasibility test is ``O(p·n²)``.
    Bisection on ``T`` then finds the smallest bottleneck to a relative ``1e-12``.
    """
    total = prefix[-1]
    low, high = total / ranks, total
    cuts = _vshape_feasible(prefix, ranks, high)
    assert cuts is not None  # any partition has every load ≤ total
    while high - low > 1e-12 * max(high, 1e-300):
        middle = (low + high) / 2
        found = _vshape_feasible(prefix, ranks, middle)
        if found is None:
            low = middle
        else:
            high, cuts = middle, found
    loads = [0.0] * ranks
    bounds = [0, *cuts, len(prefix) - 1]
    for stage in range(2 * ranks):
        rank = stage if stage < ranks else 2 * ranks - 1 - stage
        loads[rank] += prefix[bounds[stage + 1]] - prefix[bounds[stage]]
    return Partition(tuple(cuts), max(loads))


def _vshape_feasible(prefix: list[float], ranks: int, limit: float) -> list[int] | None:
    """Cut points of a V partition with every rank load ≤ ``limit``, or None (:func:`_vshape_partition`)."""
    n = len(prefix) - 1
    slack = limit + 1e-12 * max(abs(limit), 1.0)
    none = -math.inf
    # value[a][b] = P[a] − P[b] where (a, b) is reachable at the current level, else −inf
    value = [[none] * (n + 1) for _ in range(n + 1)]
    value[0][n] = prefix[0] - prefix[n]
    parents: list[dict[tuple[int, int], tuple[int, int]]] = []
    for level in range(1, ranks + 1):
        # best[a'][b'] = max value[a][b] over a < a', b > b' (and where it came from)
        best = [[none] * (n + 2) for _ in range(n + 1)]
        where: list[list[tuple[int, int] | None]] = [[None] * (n + 2) for _ in range(n + 1)]
        for a2 in range(1, n + 1):
            row, above = best[a2], best[a2 - 1]
            wrow, wabove = where[a2], where[a2 - 1]
            source = value[a2 - 1]
            for b2 in range(n - 1, -1, -1):
                candidate, origin = above[b2], wabove[b2]
                if row[b2 + 1] > candidate:
                    candidate, origin = row[b2 + 1], wrow[b2 + 1]
                if source[b2 + 1] > candidate:
                    candidate, origin = source[b2 + 1], (a2 - 1, b2 + 1)
                row[b2], wrow[b2] = candidate, origin
        value = [[none] * (n + 1) for _ in range(n + 1)]
        chosen: dict[tuple[int, int], tuple[int, int]] = {}
        for a2 in range(level, n + 1):
            row, wrow = best[a2], where[a2]
            # the last level closes the V: both middle stages meet at one cut (a' = b')
            b_range = range(a2, a2 + 1) if level == ranks else range(a2, n - level + 1)
            for b2 in b_range:
                if row[b2] != none and prefix[a2] - prefix[b2] <= slack + row[b2]:
                    value[a2][b2] = prefix[a2] - prefix[b2]
                    chosen[(a2, b2)] = wrow[b2]  # type: ignore[assignment]
        parents.append(chosen)
        if not chosen:
            return None
    finish = next((state for state in parents[-1] if 0 < state[0] < n), None)
    if finish is None:
        return None
    left, right = [finish[0]], [finish[1]]
    state = finish
    for level in range(ranks - 1, 0, -1):
        state = parents[level][state]
        left.append(state[0])
        right.append(state[1])
    # left holds a_p (= middle), a_{p−1}, …, a_1; right holds b_p (= middle), …, b_1
    return [*reversed(left), *right[1:]]


def brute_force_partition(
    work: Sequence[float], stage_ranks: Sequence[int], memory: MemoryCap | None = None
) -> Partition | None:
    """Every cut set in turn (``C(n−1, S−1)`` of them): the reference the tests hold the solvers to."""
    n, stages = len(work), len(stage_ranks)
    ranks = max(stage_ranks) + 1
    best: Partition | None = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        if memory is not None:
            needs = rank_memory(memory, cuts, stage_ranks, ranks)
            if any(need > cap for need, cap in zip(needs, memory.capacity)):
                continue
        value = max(rank_loads(work, cuts, stage_ranks, ranks))
        if best is None or value < best.bottleneck:
            best = Partition(tuple(cuts), value)
    return best
