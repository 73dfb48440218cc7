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

import math

from ..costs import StageCosts
from .planning import BACKWARD, FORWARD, WEIGHT, BuilderCandidate, PlanOp, fixed_candidate

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
    weights: list[list[int]] = [[], []] if split else [[]]
    pending = [0, 0]
    cursor = 0
    for slot, kind in ops:
        while cursor < slot and (pending[0] or pending[1]):
            which = 0 if pending[0] else 1
            pending[which] -= 1
            weights[which if split else 0].append(cursor)
            cursor += 1
        cursor = max(cursor, slot + 1)
        if kind >= 2:
            pending[kind - 2 if split else 0] += 1
    for which in (0, 1):
        for _ in range(pending[which]):
            weights[which if split else 0].append(cursor)
            cursor += 1
    return [list(stream) for stream in rank_slots] + weights


class _UnitMemory:
    """One rank's unit memory per slot: forwards add one, W ops free one.

    With ``explicit_w`` W ops are in the slots; otherwise each free slot runs one owed W (of a
    backward already run), as the pattern would place them.  ``level[t]`` is the memory after slot
    ``t``; moving an op earlier changes nothing before its new slot, so a trial recomputes only the
    suffix from there.
    """

    def __init__(self, rank_slots: list[list[int]], explicit_w: bool, horizon: int) -> None:
        self.explicit_w = explicit_w
        self.delta = [0] * horizon
        self.busy = [0] * horizon
        self.backward = [0] * horizon
        for kind, stream in enumerate(rank_slots):
            for slot in stream:
                self._add(kind, slot, 1)
        self.level = [0] * horizon
        self.owed = [0] * horizon
        self.prefix_peak = [0] * horizon
        self._recompute(0, commit=True)

    def _add(self, kind: int, slot: int, sign: int) -> None:
        self.busy[slot] += sign
        if kind < 2:
            self.delta[slot] += sign
        elif kind >= 4:
            self.delta[slot] -= sign
        elif not self.explicit_w:
            self.backward[slot] += sign

    def _recompute(self, start: int, commit: bool, limit: float = math.inf) -> float:
        """Peak from ``start`` on (stored when ``commit``); a trial stops once it passes ``limit``."""
        level = self.level[start - 1] if start else 0
        owed = self.owed[start - 1] if start else 0
        peak: float = self.prefix_peak[start - 1] if start else 0
        delta, busy, backward, explicit_w = self.delta, self.busy, self.backward, self.explicit_w
        levels, owes, peaks = self.level, self.owed, self.prefix_peak
        for slot in range(start, len(delta)):
            level += delta[slot]
            if not explicit_w:
                if busy[slot]:
                    owed += backward[slot]
                elif owed:
                    owed -= 1
                    level -= 1
            if level > peak:
                peak = level
                if peak > limit:
                    return peak
            if commit:
                levels[slot], owes[slot], peaks[slot] = level, owed, int(peak)
        return peak

    @property
    def peak(self) -> int:
        """The rank's peak unit memory."""
        return self.prefix_peak[-1]

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
        if self._recompute(candidate, commit=False, limit=limit) <= limit:
            self._recompute(candidate, commit=True)
            return True
        self._add(kind, candidate, -1)
        self._add(kind, original, 1)
        return False


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
        latest = max(latest, sorted(slots[rank][2] + slots[rank][3])[j])
    if j > 0:
        latest = max(latest, slots[rank][kind][j - 1])
    return latest


def _slot_order(slots: Slots, p: int) -> list[tuple[int, int, int, int]]:
    """Every op as ``(slot, rank, kind, microbatch)``, sorted: a bucket per slot, filled in rank,
    kind and microbatch order (the same order as sorting the tuples, in linear time)."""
    horizon = max(slot for rank_slots in slots for stream in rank_slots for slot in stream) + 1
    buckets: list[list[tuple[int, int, int, int]]] = [[] for _ in range(horizon)]
    for rank in range(p):
        for kind, stream in enumerate(slots[rank]):
            for j, slot in enumerate(stream):
                buckets[slot].append((slot, rank, kind, j))
    return [op for bucket in buckets for op in bucket]


def squeeze(slots: Slots, explicit_w: bool, p: int) -> Slots:
    """Move warm-up (``explicit_w`` only) and cool-down ops to the earliest free slot after their
    inputs that keeps every rank's peak unit memory at most the pattern's."""
    horizon = max(slot for rank_slots in slots for stream in rank_slots for slot in stream) + 2
    memories = [_UnitMemory(rank_slots, explicit_w, horizon) for rank_slots in slots]
    peak = max(memory.peak for memory in memories)
    order = _slot_order(slots, p)
    occupied: list[set[int]] = [set() for _ in range(p)]
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
                if candidate not in occupied[rank] and memories[rank].try_move(
                    kind, original, candidate, peak
                ):
                    slots[rank][kind][j] = candidate
                    break
        occupied[rank].add(slots[rank][kind][j])
    return slots


def eager_unit_slots(slots: Slots, p: int) -> Slots:
    """Start slots when every op runs as early as its inputs and its rank allow (unit times),
    keeping each rank's order by slot."""
    order = _slot_order(slots, p)
    end: Slots = [[[0] * len(stream) for stream in rank_slots] for rank_slots in slots]
    result: Slots = [[[0] * len(stream) for stream in rank_slots] for rank_slots in slots]
    rank_free = [0] * p
    for _, rank, kind, j in order:
        ready = rank_free[rank]
        if kind in (0, 2) and rank > 0:
            other = end[rank - 1][kind][j]
            ready = max(ready, other)
        elif kind in (1, 3) and rank + 1 < p:
            other = end[rank + 1][kind][j]
            ready = max(ready, other)
        own = end[rank]
        if 0 < kind < 4 and own[kind - 1][j] > ready:
            ready = own[kind - 1][j]
        if j > 0 and own[kind][j - 1] > ready:
            ready = own[kind][j - 1]
        own[kind][j] = rank_free[rank] = ready + 1
        result[rank][kind][j] = ready
    return result


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
