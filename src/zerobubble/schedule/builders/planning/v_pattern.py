"""The authors' V-Half and V-Min orders (arXiv 2405.15362), as search candidates.

The paper's V-Half and V-Min are one fixed *pattern* each: in unit time slots with a period of six
(F, F, B, B, W, W of one microbatch on each rank), rank ``r`` runs its down forward, up forward, up
backward and down backward at fixed slots, and microbatch ``j`` repeats them ``6j`` slots later.
The authors then *squeeze* the pattern: in the warm-up and the cool-down every op moves to the
earliest free slot after its inputs, as long as no rank's peak memory grows; the repeated steady
state is left as it is.  The op order per rank follows the slots.  This module rebuilds those
orders (from the facts of the paper and the authors' public code; the code here is ours), so the
V-Half / V-Min search always contains them and is never slower than the authors' orders.

Kinds in this module: 0 down forward, 1 up forward, 2 up backward, 3 down backward (the V's up
stage ``2p−1−r`` runs its backward first), 4 W (one stream, or 4/5 = W of the up/down stage).
"""

from __future__ import annotations

import itertools
import math
import operator

from ...costs import StageCosts
from .core import BACKWARD, FORWARD, WEIGHT, BuilderCandidate, PlanOp, fixed_candidate

_PERIOD = 6
Slots = list[list[list[int]]]  # [rank][kind][microbatch] -> unit time slot


def pattern_slots(name: str, p: int, microbatches: int) -> Slots:
    """Unit-time slots of every F and B op of the repeated V-Half or V-Min pattern."""
    if name == "v-half":
        gap = 3 if p % 2 == 0 else 0
        offsets = [(2 * i, 3 * p - i - 2, 3 * p + gap + 2 * i - 1, 6 * p + gap - i - 2) for i in range(p)]
    else:
        gap = 2 if p % 3 == 0 else 0
        offsets = [(i, 2 * p - i - 1, 2 * p + gap + i, 4 * p + gap - i - 1) for i in range(p)]
    return [
        [[offset + _PERIOD * j for j in range(microbatches)] for offset in rank_offsets]
        for rank_offsets in offsets
    ]


def with_weights(rank_slots: list[list[int]], split: bool) -> list[list[int]]:
    """Add W slots to one rank's four F/B streams: each free slot takes the oldest pending W.

    ``split`` keeps two W streams (of the up and the down stage, the up one served first);
    otherwise one stream.  W ops still pending after the last op follow it.
    """
    ops = sorted((slot, kind) for kind, stream in enumerate(rank_slots) for slot in stream)
    up_weights: list[int] = []  # every W when not split
    down_weights: list[int] = []
    up = down = 0  # pending W ops of the up and the down stage
    cursor = 0
    for slot, kind in ops:
        while cursor < slot and (up or down):  # a free slot takes a pending W, the up stage's first
            if up:
                up -= 1
                up_weights.append(cursor)
            else:
                down -= 1
                down_weights.append(cursor)
            cursor += 1
        if cursor <= slot:
            cursor = slot + 1
        if kind == 2 or (kind == 3 and not split):
            up += 1
        elif kind == 3:
            down += 1
    up_weights.extend(range(cursor, cursor + up))
    down_weights.extend(range(cursor + up, cursor + up + down))
    weights = [up_weights, down_weights] if split else [up_weights]
    return [list(stream) for stream in rank_slots] + weights


class _UnitMemory:
    """One rank's unit memory per slot: forwards add one, W ops free one.

    With ``explicit_w`` W ops are in the slots; otherwise each free slot runs one owed W (of a
    backward already run), as the pattern would place them.  ``level[t]`` is the memory after slot
    ``t``; moving an op earlier changes nothing before its new slot, so a trial recomputes only the
    slots from there until the level and the owed W ops are those stored again (from then on
    nothing differs): a move is a local change, and so is its trial.
    """

    def __init__(self, rank_slots: list[list[int]], explicit_w: bool, horizon: int) -> None:
        self.explicit_w = explicit_w
        self.delta = delta = [0] * horizon
        self.busy = busy = [0] * horizon
        self.backward = backward = [0] * horizon
        for kind, stream in enumerate(rank_slots):
            change = delta if kind < 2 or kind >= 4 else backward if not explicit_w else None
            sign = -1 if kind >= 4 else 1
            for slot in stream:
                busy[slot] += 1
                if change is not None:
                    change[slot] += sign
        # the whole walk: nothing stored yet to agree with (settled at the horizon), no limit
        self.level: list[int] = []
        self.owed: list[int] = []
        walk = self._changed_suffix(0, horizon, math.inf)
        if walk is not None:  # always, with no limit
            self.level, self.owed = walk
        #: the rank's peak unit memory (of the pattern as given; moves keep every level within the
        #: limit they are tried with)
        self.peak = max(0, max(self.level, default=0))

    def _add(self, kind: int, slot: int, sign: int) -> None:
        self.busy[slot] += sign
        if kind < 2:
            self.delta[slot] += sign
        elif kind >= 4:
            self.delta[slot] -= sign
        elif not self.explicit_w:
            self.backward[slot] += sign

    def _changed_suffix(self, start: int, settled: int, limit: float) -> tuple[list[int], list[int]] | None:
        """The levels and owed W ops from ``start`` on, as far as they differ from the stored ones
        (at ``settled`` or later, the first slot where both agree again ends the walk); None when a
        level passes ``limit``.  Every stored level is within the limit already."""
        level = self.level[start - 1] if start else 0
        owed = self.owed[start - 1] if start else 0
        delta, busy, backward, explicit_w = self.delta, self.busy, self.backward, self.explicit_w
        stored_levels, stored_owed = self.level, self.owed
        levels: list[int] = []
        owes: list[int] = []
        for slot in range(start, len(delta)):
            level += delta[slot]
            if not explicit_w:
                if busy[slot]:
                    owed += backward[slot]
                elif owed:
                    owed -= 1
                    level -= 1
            if level > limit:
                return None
            if slot >= settled and level == stored_levels[slot] and owed == stored_owed[slot]:
                break
            levels.append(level)
            owes.append(owed)
        return levels, owes

    def try_move(self, kind: int, original: int, candidate: int, limit: int) -> bool:
        """Move the op from ``original`` to ``candidate`` if the peak stays within ``limit``."""
        if self.explicit_w:
            # only a forward raises memory: by one, from its new slot up to its old one
            level = self.level
            if kind < 2:
                if max(level[candidate:original]) + 1 > limit:
                    return False
                for slot in range(candidate, original):
                    level[slot] += 1
            elif kind >= 4:
                for slot in range(candidate, original):
                    level[slot] -= 1
            return True
        self._add(kind, original, -1)
        self._add(kind, candidate, 1)
        changed = self._changed_suffix(candidate, original, limit)
        if changed is None:
            self._add(kind, candidate, -1)
            self._add(kind, original, 1)
            return False
        levels, owes = changed
        self.level[candidate : candidate + len(levels)] = levels
        self.owed[candidate : candidate + len(owes)] = owes
        return True


def _kth_smallest(first: list[int], second: list[int], k: int) -> int:
    """``sorted(first + second)[k]`` of two sorted lists, by bisecting how many come from ``first``."""
    low, high = max(0, k + 1 - len(second)), min(k + 1, len(first))
    while low < high:
        taken = (low + high) // 2
        if second[k - taken] > first[taken]:
            low = taken + 1
        else:
            high = taken
    rest = k + 1 - low
    if low == 0:
        return second[rest - 1]
    return first[low - 1] if rest == 0 else max(first[low - 1], second[rest - 1])


def _dependency_slot(slots: Slots, rank: int, kind: int, j: int, p: int) -> int:
    """Latest slot among the op's inputs (−1 when none)."""
    latest = -1
    if kind in (0, 2) and rank > 0:
        latest = slots[rank - 1][kind][j]
    elif kind in (1, 3) and rank + 1 < p:
        latest = slots[rank + 1][kind][j]
    if 0 < kind < 4:
        latest = max(latest, slots[rank][kind - 1][j])
    if kind == 4:
        latest = max(latest, _kth_smallest(slots[rank][2], slots[rank][3], j))
    if j > 0:
        latest = max(latest, slots[rank][kind][j - 1])
    return latest


class _FlatOps:
    """Every op of a :data:`Slots` at one flat index, and the ops in slot order.

    Rank by rank, stream by stream, op ``j`` of a stream sits at the stream's base index plus
    ``j``, so the flat index orders ops by (rank, kind, microbatch) and sorting the integers
    ``slot · n + index`` orders them by slot first: what the bucket per slot gave, built and
    sorted in C instead of a Python loop per op.
    """

    def __init__(self, slots: Slots) -> None:
        self.bases: list[list[int]] = []
        ranks: list[int] = []
        kinds: list[int] = []
        microbatches: list[int] = []
        flat_slots: list[int] = []
        for rank, rank_slots in enumerate(slots):
            rank_bases = []
            for kind, stream in enumerate(rank_slots):
                rank_bases.append(len(ranks))
                ranks.extend(itertools.repeat(rank, len(stream)))
                kinds.extend(itertools.repeat(kind, len(stream)))
                microbatches.extend(range(len(stream)))
                flat_slots.extend(stream)
            self.bases.append(rank_bases)
        self.ranks, self.kinds, self.microbatches, self.slots = ranks, kinds, microbatches, flat_slots
        n = self.size = len(ranks)
        keys = list(map(operator.add, map(operator.mul, flat_slots, itertools.repeat(n)), range(n)))
        keys.sort()
        #: the flat indices in slot order (ties in rank, kind and microbatch order)
        self.order = [key % n for key in keys]

    def tuples(self) -> list[tuple[int, int, int, int]]:
        """Every op as ``(slot, rank, kind, microbatch)``, in slot order."""
        order = self.order
        return list(
            zip(
                map(self.slots.__getitem__, order),
                map(self.ranks.__getitem__, order),
                map(self.kinds.__getitem__, order),
                map(self.microbatches.__getitem__, order),
            )
        )

    def unflatten(self, values: list[int], slots: Slots) -> Slots:
        """``values`` (one per flat index) in the nesting of ``slots``."""
        return [
            [values[base : base + len(stream)] for base, stream in zip(rank_bases, rank_slots)]
            for rank_bases, rank_slots in zip(self.bases, slots)
        ]


def squeeze(slots: Slots, explicit_w: bool, p: int) -> Slots:
    """Move warm-up (``explicit_w`` only) and cool-down ops to the earliest free slot after their
    inputs that keeps every rank's peak unit memory at most the pattern's."""
    horizon = max(max(stream) for rank_slots in slots for stream in rank_slots if stream) + 2
    memories = [_UnitMemory(rank_slots, explicit_w, horizon) for rank_slots in slots]
    peak = max(memory.peak for memory in memories)
    order = _FlatOps(slots).tuples()
    occupied = [bytearray(horizon) for _ in range(p)]
    last_forward = len(slots[0][0]) - 1
    phase = 0
    for original, rank, kind, j in order:
        if kind == 3 and rank == 0 and phase == 0:
            phase = 1
        movable = phase == 2 or (phase == 0 and explicit_w)
        if phase == 1 and kind == 0 and j == last_forward:
            phase = 2
        if movable:
            earliest = _dependency_slot(slots, rank, kind, j, p) + 1
            for candidate in range(earliest, original):
                if not occupied[rank][candidate] and memories[rank].try_move(kind, original, candidate, peak):
                    slots[rank][kind][j] = candidate
                    break
        occupied[rank][slots[rank][kind][j]] = 1
    return slots


def eager_unit_slots(slots: Slots, p: int) -> Slots:
    """Start slots when every op runs as early as its inputs and its rank allow (unit times),
    keeping each rank's order by slot."""
    ops = _FlatOps(slots)
    n = ops.size
    # per flat index, the flat indices of its inputs: the neighbour's op of the same kind
    # (forwards and up backwards from rank - 1, up forwards and down backwards from rank + 1),
    # its own op of the previous kind, its previous microbatch; n (a slot ending at 0) for none
    neighbour, previous_kind, previous = [n] * n, [n] * n, [n] * n
    for rank, (rank_bases, rank_slots) in enumerate(zip(ops.bases, slots)):
        for kind, (base, stream) in enumerate(zip(rank_bases, rank_slots)):
            length = len(stream)
            other = rank - 1 if kind in (0, 2) else rank + 1 if kind in (1, 3) else -1
            if 0 <= other < p:
                neighbour[base : base + length] = range(
                    ops.bases[other][kind], ops.bases[other][kind] + length
                )
            if 0 < kind < 4:
                own = rank_bases[kind - 1]
                previous_kind[base : base + length] = range(own, own + length)
            previous[base + 1 : base + length] = range(base, base + length - 1)
    end = [0] * (n + 1)
    start = [0] * n
    rank_free = [0] * p
    op_rank = ops.ranks
    for index in ops.order:
        rank = op_rank[index]
        ready = rank_free[rank]
        before = end[neighbour[index]]
        if before > ready:  # noqa: PLR1730 (hot path: cheaper than a max() call)
            ready = before
        before = end[previous_kind[index]]
        if before > ready:  # noqa: PLR1730
            ready = before
        before = end[previous[index]]
        if before > ready:  # noqa: PLR1730
            ready = before
        start[index] = ready
        end[index] = rank_free[rank] = ready + 1
    return ops.unflatten(start, slots)


def squeezed_programs(name: str, p: int, microbatches: int) -> list[list[PlanOp]]:
    """The authors' squeezed V-Half / V-Min order for ``p`` ranks and ``microbatches`` microbatches."""
    slots = pattern_slots(name, p, microbatches)
    first = squeeze([with_weights(rank_slots, split=False) for rank_slots in slots], True, p)
    first = eager_unit_slots(first, p)
    second = squeeze([rank_slots[:4] for rank_slots in first], False, p)
    second = eager_unit_slots([with_weights(rank_slots, split=False) for rank_slots in second], p)
    final = [with_weights(rank_slots[:4], split=True) for rank_slots in second]
    return _programs(final, p)


def _programs(slots: Slots, p: int) -> list[list[PlanOp]]:
    S = 2 * p
    kinds = (FORWARD, FORWARD, BACKWARD, BACKWARD, WEIGHT, WEIGHT)
    programs = []
    for rank, rank_slots in enumerate(slots):
        stage_of = (rank, S - 1 - rank, S - 1 - rank, rank, S - 1 - rank, rank)
        timed = sorted(
            (slot, kind, j) for kind, stream in enumerate(rank_slots) for j, slot in enumerate(stream)
        )
        programs.append([(kinds[kind], stage_of[kind], j) for _, kind, j in timed])
    return programs


def pattern_candidates(costs: StageCosts, microbatches: int, name: str) -> list[BuilderCandidate]:
    """The authors' order for ``name`` ("v-half" or "v-min") as a search candidate."""
    if name not in ("v-half", "v-min"):
        return []
    p = costs.placement.num_ranks

    return [
        fixed_candidate(
            "pattern",
            f"{name}-squeezed",
            costs,
            microbatches,
            lambda: squeezed_programs(name, p, microbatches),
        )
    ]
