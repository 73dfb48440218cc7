"""Checks a schedule before anything runs it.

:func:`validate_schedule` raises :class:`ValidationError` naming the rank, the op and the reason for:
an op of a stage its rank does not hold, an op outside the microbatches, a missing or duplicated op,
an order on one rank that contradicts a dependency, a cross-rank order that can never make progress
(reporting the cycle of waits), and activation memory above the limit.  A vocabulary-parallel schedule
(S and T ops) must hold every shard's S and T of every microbatch on the shard's rank, and issue its
collectives in one order on every rank: S ops, and the last stage's forwards, in microbatch order.
"""

from __future__ import annotations

import itertools
from collections import Counter

from ..errors import ValidationError
from .costs import CostModel, StageCosts, within_limit
from .gcpause import collector_paused
from .ir import Kind, Op, Schedule, ScheduleError, dependencies
from .simulate import (
    KIND_CODE,
    KIND_OF_CODE,
    DeadlockError,
    EncodedPrograms,
    Timeline,
    resolve_costs_for,
    simulate_encoded,
)


def validate_schedule(schedule: Schedule, costs: CostModel | StageCosts | None = None) -> Timeline:
    """Check ``schedule`` completely and return its simulated :class:`Timeline`.

    Memory is checked against ``costs.memory_limit`` when costs are given (unit costs otherwise).
    """
    with collector_paused():  # tens of thousands of acyclic tuples (gcpause.py)
        return _validate(schedule, costs)


def _validate(schedule: Schedule, costs: CostModel | StageCosts | None) -> Timeline:
    table = _OpTable(schedule)  # placement: every op's stage, microbatch and rank
    table.check_complete()
    if schedule.overlapped:
        _check_pairs(schedule)
    try:
        timeline = simulate_encoded(schedule, resolve_costs_for(schedule, costs), table.encoded)
    except DeadlockError as error:
        # An op before its own dependency on one rank always deadlocks (that rank can never pass
        # it), so the order check runs only here, to name the op instead of a cycle of waits.
        table.check_local_order()
        rank = next(iter(error.waits), None)
        raise ValidationError(str(error), rank, error.waits[rank][0] if rank is not None else None) from None
    _check_memory(timeline)
    return timeline


class _OpTable:
    """Every op of a schedule by an integer key ``(kind code · S + stage) · m + microbatch``: the rank
    holding it and its position in that rank's program; and the programs encoded for the simulator.

    Why integers: a schedule at p = 32, m = 256 has tens of thousands of ops, and hashing ``Op``
    dataclasses (and building the ones looked up) made validation cost more than building the
    schedule.  Building the table checks each op's stage, microbatch and rank (in program order,
    so the first bad op is the one reported).
    """

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        S, m = schedule.num_stages, schedule.microbatches
        self.size = size = S * m
        self.rank = rank_at = [-1] * (len(KIND_OF_CODE) * size)
        self.position = position_at = [-1] * (len(KIND_OF_CODE) * size)
        self.duplicated = False
        owners = schedule.placement.stage_ranks
        self.vocab = False
        codes, microbatches = [], []
        for rank, program in enumerate(schedule.programs):
            rank_codes, rank_mbs = [], []
            for i, op in enumerate(program):
                stage, mb = op.stage, op.microbatch
                if op.is_vocab:
                    self.vocab = True
                    if stage != rank or not 0 <= mb < m:
                        _raise_vocab_placement(schedule, rank, op)
                elif not (0 <= stage < S and 0 <= mb < m) or owners[stage] != rank:
                    _raise_placement(schedule, rank, op)
                code = KIND_CODE[op.kind] * S + stage
                rank_codes.append(code)
                rank_mbs.append(mb)
                key = code * m + mb
                if rank_at[key] >= 0:
                    self.duplicated = True
                rank_at[key], position_at[key] = rank, i
            codes.append(rank_codes)
            microbatches.append(rank_mbs)
        #: The programs as the simulator reads them (:func:`~.simulate.encode_programs`).
        self.encoded = EncodedPrograms(tuple(codes), tuple(microbatches))

    def has(self, kind: Kind, stage: int, microbatch: int) -> bool:
        return self.rank[KIND_CODE[kind] * self.size + stage * self.schedule.microbatches + microbatch] >= 0

    def check_complete(self) -> None:
        """Every op once; each (stage, microbatch) with an F and either a BW or a B and a W."""
        schedule = self.schedule
        if self.duplicated:
            _check_duplicates(schedule)
        S, m, size, rank_at = schedule.num_stages, schedule.microbatches, self.size, self.rank
        owners = schedule.placement.stage_ranks
        for stage in range(S):
            for j in range(m):
                key = stage * m + j
                if (
                    rank_at[key] >= 0
                    and rank_at[3 * size + key] < 0
                    and rank_at[size + key] >= 0
                    and rank_at[2 * size + key] >= 0
                ):
                    continue  # the common case of a split schedule: F, B and W
                _check_backwards(owners[stage], stage, j, self)
        if self.vocab:
            self._check_vocab()

    def _check_vocab(self) -> None:
        """Every shard's S and T of every microbatch; S ops and the last stage's forwards in
        microbatch order (each issues a collective, which every rank must issue in one order)."""
        schedule = self.schedule
        for rank in range(schedule.num_ranks):
            for kind in (Kind.S, Kind.T):
                for j in range(schedule.microbatches):
                    if not self.has(kind, rank, j):
                        op = Op(kind, rank, j)
                        raise ValidationError(
                            f"rank {rank}: {op} is missing (a vocabulary-parallel schedule runs S and T "
                            f"of every shard for every microbatch)",
                            rank,
                            op,
                        )
        last = schedule.num_stages - 1
        for rank, program in enumerate(schedule.programs):
            for kind, stage in ((Kind.S, rank), (Kind.F, last)):
                order = [op for op in program if op.kind is kind and op.stage == stage]
                for before, after in itertools.pairwise(order):
                    if after.microbatch < before.microbatch:
                        raise ValidationError(
                            f"rank {rank}: {after} comes after {before}; a vocabulary-parallel schedule "
                            f"runs its {kind.value} ops of stage/shard {stage} in microbatch order (each "
                            "starts a collective that every rank starts in the same order)",
                            rank,
                            after,
                        )

    def check_local_order(self) -> None:
        """No op before one of its dependencies on the same rank."""
        schedule = self.schedule
        S, m, size = schedule.num_stages, schedule.microbatches, self.size
        rank_at, position_at = self.rank, self.position
        F, W = Kind.F, Kind.W
        vocab_s = KIND_CODE[Kind.S] * size
        for rank, program in enumerate(schedule.programs):
            for i, op in enumerate(program):
                stage, mb, kind = op.stage, op.microbatch, op.kind
                needed: tuple[int, ...]
                if kind is Kind.S:
                    needed = ((S - 1) * m + mb,)
                elif kind is Kind.T:
                    needed = (vocab_s + rank * m + mb,)
                elif kind is F:
                    needed = ((stage - 1) * m + mb,) if stage > 0 else ()
                elif kind is W:  # its B, or a BW
                    needed = (size + stage * m + mb, 3 * size + stage * m + mb)
                else:  # B or BW: its F and the input gradient of the next stage (a B or a BW)
                    needed = (stage * m + mb,)
                    if stage + 1 < S:
                        needed += (size + (stage + 1) * m + mb, 3 * size + (stage + 1) * m + mb)
                    elif self.vocab:
                        needed += (vocab_s + rank * m + mb,)
                for key in needed:
                    if rank_at[key] == rank and position_at[key] > i:
                        kind_code, rest = divmod(key, size)
                        candidate = Op(KIND_OF_CODE[kind_code], rest // m, rest % m)
                        raise ValidationError(
                            f"rank {rank}: {op} (position {i}) comes before {candidate} "
                            f"(position {position_at[key]}), which it depends on",
                            rank,
                            op,
                        )


def _raise_placement(schedule: Schedule, rank: int, op: Op) -> None:
    S, m = schedule.num_stages, schedule.microbatches
    if not 0 <= op.stage < S:
        raise ValidationError(
            f"rank {rank}: {op} names stage {op.stage}, but there are stages 0..{S - 1}", rank, op
        )
    if not 0 <= op.microbatch < m:
        raise ValidationError(
            f"rank {rank}: {op} names microbatch {op.microbatch}, but there are microbatches 0..{m - 1}",
            rank,
            op,
        )
    owner = schedule.placement.rank_of(op.stage)
    raise ValidationError(f"rank {rank}: {op} is of stage {op.stage}, which rank {owner} holds", rank, op)


def _raise_vocab_placement(schedule: Schedule, rank: int, op: Op) -> None:
    m = schedule.microbatches
    if not 0 <= op.microbatch < m:
        raise ValidationError(
            f"rank {rank}: {op} names microbatch {op.microbatch}, but there are microbatches 0..{m - 1}",
            rank,
            op,
        )
    raise ValidationError(
        f"rank {rank}: {op} is of vocabulary shard {op.stage}, which rank {op.stage} holds (shards are "
        f"0..{schedule.num_ranks - 1}, one per rank)",
        rank,
        op,
    )


def _check_duplicates(schedule: Schedule) -> None:
    """The first op (in rank and program order) that appears more than once, with its count."""
    counts = Counter(op for _, op in schedule.ops())
    location = {op: rank for rank, op in schedule.ops()}
    for op, count in counts.items():
        if count > 1:
            rank = location[op]
            raise ValidationError(
                f"rank {rank}: {op} appears {count} times; every op runs exactly once", rank, op
            )


def _check_backwards(rank: int, stage: int, j: int, table: _OpTable) -> None:
    """Stage ``stage``, microbatch ``j`` has its F and either one BW or a B and a W."""
    fused, split_b, split_w = (table.has(k, stage, j) for k in (Kind.BW, Kind.B, Kind.W))
    if not table.has(Kind.F, stage, j):
        raise ValidationError(f"rank {rank}: {Op(Kind.F, stage, j)} is missing", rank, Op(Kind.F, stage, j))
    if fused and (split_b or split_w):
        raise ValidationError(
            f"rank {rank}: stage {stage} microbatch {j} has both a fused BW and a split B/W",
            rank,
            Op(Kind.BW, stage, j),
        )
    if not fused and not (split_b and split_w):
        missing = Op(Kind.W, stage, j) if split_b else Op(Kind.B, stage, j)
        if not split_b and not split_w:
            missing = Op(Kind.BW, stage, j)
        raise ValidationError(
            f"rank {rank}: {missing} is missing (no backward for stage {stage} microbatch {j})",
            rank,
            missing,
        )


def _check_pairs(schedule: Schedule) -> None:
    """Every overlapped F&B pair is an F and then a B or BW, adjacent on one rank, each op in one
    pair at most, and neither half needs the other (both start at once)."""
    where = {op: rank for rank, op in schedule.ops()}
    for forward, backward in schedule.overlapped:
        rank = where.get(forward, where.get(backward))
        if rank is None:
            raise ValidationError(f"overlapped pair {forward}&{backward}: neither op is in any program")
        needed = dependencies(backward, schedule.num_stages, schedule.vocab_shards)
        if (Kind.F, forward.stage, forward.microbatch) in needed:
            raise ValidationError(
                f"rank {rank}: overlapped pair {forward}&{backward}: {backward} needs {forward}, but the "
                "two halves of a pair start together; pair a backward with another microbatch's forward",
                rank,
                backward,
            )
    try:
        schedule.pair_starts()
    except ScheduleError as error:  # the message names the pair (or the rank)
        raise ValidationError(str(error)) from None


def _check_memory(timeline: Timeline) -> None:
    limits = timeline.costs.memory_limit
    for rank, trace in enumerate(timeline.memory):
        limit = limits[rank]
        if within_limit(timeline.peak_memory[rank], limit):
            continue  # the peak is within the limit, so is every level (the common case)
        for i, level in enumerate(trace):
            if not within_limit(level, limit):
                op = timeline.schedule.programs[rank][i]
                raise ValidationError(
                    f"rank {rank}: activation memory reaches {level:g} after {op}, above the limit {limit:g}",
                    rank,
                    op,
                )
