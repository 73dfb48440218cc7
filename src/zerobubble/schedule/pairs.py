"""Overlapped F&B pairs in the simulator: a pair runs as one slot of its rank's program.

A schedule's :attr:`~.ir.Schedule.overlapped` pairs (DualPipe's F&B) start together, once both
halves' inputs are there, and end together after :meth:`~.costs.StageCosts.pair_duration`.  The
simulator's loop times *slots*: :func:`fuse_pairs` turns each pair's two compiled ops into one slot
(its dependencies and products those of both halves, at their own microbatches) and
:func:`expand_times` gives both ops of a pair their slot's start and end.  A schedule without pairs
never comes here, so its simulation is unchanged.  Pure Python.
"""

from __future__ import annotations

from typing import Any

from .costs import StageCosts
from .ir import Schedule

Compiled = tuple[float, tuple, tuple]


def fuse_pairs(
    schedule: Schedule,
    costs: StageCosts,
    compiled: list[list[Compiled]],
    microbatch_of: tuple[list[int], ...],
) -> tuple[list[list[Compiled]], tuple[list[int], ...], tuple[tuple[int, ...], ...]]:
    """The programs with every pair fused into one slot: the slots, each slot's microbatch (0 for a
    pair, whose keys are already its halves' own) and per rank the op index each slot starts at."""
    slots_of: list[list[Compiled]] = []
    microbatches: list[list[int]] = []
    firsts: list[tuple[int, ...]] = []
    for rank, pair_starts in enumerate(schedule.pair_starts()):
        program, mbs, ops = compiled[rank], microbatch_of[rank], schedule.programs[rank]
        paired = set(pair_starts)
        slots, slot_mbs, first = [], [], []
        i = 0
        while i < len(program):
            first.append(i)
            if i not in paired:
                slots.append(program[i])
                slot_mbs.append(mbs[i])
                i += 1
                continue
            (_, deps_a, made_a), (_, deps_b, made_b) = program[i], program[i + 1]
            j, k = mbs[i], mbs[i + 1]
            deps = tuple((key + j, delay) for key, delay in deps_a) + tuple(
                (key + k, delay) for key, delay in deps_b
            )
            made = tuple(key + j for key in made_a) + tuple(key + k for key in made_b)
            slots.append((costs.pair_duration(ops[i], ops[i + 1]), deps, made))
            slot_mbs.append(0)
            i += 2
        slots_of.append(slots)
        microbatches.append(slot_mbs)
        firsts.append(tuple(first))
    return slots_of, tuple(microbatches), tuple(firsts)


def expand_times(times: Any, firsts: tuple[tuple[int, ...], ...], schedule: Schedule) -> tuple:
    """Per-slot times (a rank's list of floats per slot) as per-op times: both ops of a pair get
    their slot's."""
    expanded = []
    for rank, slot_times in enumerate(times):
        ops = len(schedule.programs[rank])
        rank_first = firsts[rank]
        per_op: list[float] = []
        for k, value in enumerate(slot_times):
            following = rank_first[k + 1] if k + 1 < len(rank_first) else ops
            per_op += [value] * (following - rank_first[k])
        expanded.append(tuple(per_op))
    return tuple(expanded)


def op_positions(position: list[int], firsts: tuple[tuple[int, ...], ...], schedule: Schedule) -> list[int]:
    """Each rank's place in its program as an op index, from its place as a slot index."""
    return [
        firsts[rank][at] if at < len(firsts[rank]) else len(schedule.programs[rank])
        for rank, at in enumerate(position)
    ]
