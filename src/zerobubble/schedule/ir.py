"""The one intermediate representation every builder emits and every consumer reads.

A :class:`Schedule` is a :class:`Placement` (which rank holds which virtual stage) plus one ordered
*program* of :class:`Op` per rank.  The simulator, the validator, the renderer, the exporters and the
runtime all read this and nothing else, so a new schedule is one new builder and nothing more:
:func:`~zerobubble.schedule.builders.register_schedule` adds one defined outside the package.

This module is pure Python (no torch) so planners, CI jobs and notebooks can use it anywhere.
"""

from __future__ import annotations

import enum
import itertools
import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ScheduleError


class Kind(str, enum.Enum):
    """What an op computes for one (stage, microbatch).

    ``B`` is the gradient w.r.t. the stage input (someone waits for it), ``W`` the gradient w.r.t.
    the stage weights (nobody waits for it), ``BW`` both fused, as in 1F1B and GPipe.

    ``S`` and ``T`` are the two passes of a vocabulary-parallel output layer (every rank holds a
    slice of the vocabulary, docs/schedulers.md "Vocabulary parallelism"): ``S`` computes the slice's
    logits and its share of the loss and of the last stage's input gradient, ``T`` the slice's weight
    gradient (deferrable, as W).  Their ``stage`` is the vocabulary shard, held by the rank of the
    same number.
    """

    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    S = "S"
    T = "T"

    def __str__(self) -> str:
        return self.value


_OP_PATTERN = re.compile(r"^\s*(BW|F|B|W|S|T)\s*(\d+)\s*\.\s*(\d+)\s*$")


@dataclass(frozen=True, slots=True, order=True)
class Op:
    """One unit of work: ``kind`` of virtual ``stage`` for ``microbatch``.

    ``str(op)`` is ``"<kind><stage>.<microbatch>"`` (``F0.3`` is the forward of stage 0 for
    microbatch 3); :meth:`parse` reads it back.
    """

    kind: Kind
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            object.__setattr__(self, "kind", Kind(self.kind))

    def __str__(self) -> str:
        return f"{self.kind.value}{self.stage}.{self.microbatch}"

    def __repr__(self) -> str:
        return f"Op({self})"

    @classmethod
    def parse(cls, text: str) -> Op:
        """Read an op from its string form, e.g. ``"B3.7"``."""
        match = _OP_PATTERN.match(text)
        if match is None:
            raise ScheduleError(
                f"cannot read op {text!r}: expected <kind><stage>.<microbatch> such as 'F0.3' "
                "with kind one of F, B, W, BW, S, T"
            )
        return cls(Kind(match.group(1)), int(match.group(2)), int(match.group(3)))

    @property
    def computes_input_grad(self) -> bool:
        """True for B and BW: the op that the previous stage's backward waits for."""
        return self.kind is Kind.B or self.kind is Kind.BW

    @property
    def computes_weight_grad(self) -> bool:
        """True for W and BW."""
        return self.kind is Kind.W or self.kind is Kind.BW

    @property
    def is_vocab(self) -> bool:
        """True for the vocabulary-parallel passes S and T (``stage`` is then the shard)."""
        return self.kind is Kind.S or self.kind is Kind.T


def F(stage: int, microbatch: int) -> Op:
    """Shorthand for a forward op."""
    return Op(Kind.F, stage, microbatch)


def B(stage: int, microbatch: int) -> Op:
    """Shorthand for an input-gradient op."""
    return Op(Kind.B, stage, microbatch)


def W(stage: int, microbatch: int) -> Op:
    """Shorthand for a weight-gradient op."""
    return Op(Kind.W, stage, microbatch)


def BW(stage: int, microbatch: int) -> Op:
    """Shorthand for a fused backward op."""
    return Op(Kind.BW, stage, microbatch)


# Op's slots are member descriptors: setting them directly skips the generated __init__ (frozen
# only guards __setattr__) and __post_init__, whose only work is turning a string into a Kind.
_NEW_OP = object.__new__
_SET_KIND, _SET_STAGE, _SET_MICROBATCH = (
    Op.__dict__[name].__set__ for name in ("kind", "stage", "microbatch")
)


def coded_ops(program: Iterable[tuple[int, int, int]], kinds: Sequence[Kind]) -> list[Op]:
    """The ops of ``(kind code, stage, microbatch)`` triples, ``kinds[code]`` being each one's
    :class:`Kind`: equal to ``Op(kinds[code], stage, microbatch)`` but about twice as fast to make
    (a builder emits tens of thousands of ops per schedule)."""
    ops: list[Op] = []
    append = ops.append
    for code, stage, microbatch in program:
        op = _NEW_OP(Op)
        _SET_KIND(op, kinds[code])
        _SET_STAGE(op, stage)
        _SET_MICROBATCH(op, microbatch)
        append(op)
    return ops


@dataclass(frozen=True)
class Placement:
    """Which rank holds each virtual stage.

    ``stage_ranks[s]`` is the rank of virtual stage ``s``; ``num_ranks`` ranks in all.  Build one with
    :meth:`loop` (stage ``s`` on rank ``s % p``), :meth:`vshape` (the V: rank 0 holds the first and
    the last chunk) or :meth:`explicit`.
    """

    stage_ranks: tuple[int, ...]
    num_ranks: int
    style: str = "explicit"

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_ranks", tuple(int(r) for r in self.stage_ranks))
        if self.num_ranks < 1:
            raise ScheduleError(f"a placement needs at least one rank, got {self.num_ranks}")
        if not self.stage_ranks:
            raise ScheduleError("a placement needs at least one stage")
        for stage, rank in enumerate(self.stage_ranks):
            if not 0 <= rank < self.num_ranks:
                raise ScheduleError(
                    f"stage {stage} is placed on rank {rank}, outside 0..{self.num_ranks - 1}"
                )
        counts = [0] * self.num_ranks
        for rank in self.stage_ranks:
            counts[rank] += 1
        if len(set(counts)) != 1:
            raise ScheduleError(
                f"every rank must hold the same number of stages; per-rank counts are {counts}"
            )
        object.__setattr__(
            self,
            "_rank_stages",
            tuple(
                tuple(s for s, r in enumerate(self.stage_ranks) if r == rank)
                for rank in range(self.num_ranks)
            ),
        )

    @classmethod
    def loop(cls, num_ranks: int, chunks: int = 1) -> Placement:
        """Interleaved ("looping") placement: stage ``s`` on rank ``s % p``."""
        check_positive(num_ranks=num_ranks, chunks=chunks)
        return cls(tuple(s % num_ranks for s in range(num_ranks * chunks)), num_ranks, "loop")

    @classmethod
    def vshape(cls, num_ranks: int) -> Placement:
        """V-shape: stage ``s < p`` on rank ``s``, stage ``s >= p`` on rank ``2p-1-s``."""
        check_positive(num_ranks=num_ranks)
        p = num_ranks
        return cls(tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p)), p, "vshape")

    @classmethod
    def explicit(cls, stage_ranks: Sequence[int], num_ranks: int | None = None) -> Placement:
        """Any mapping, given as the rank of each virtual stage in model order."""
        ranks = tuple(int(r) for r in stage_ranks)
        return cls(ranks, num_ranks if num_ranks is not None else max(ranks) + 1, "explicit")

    @property
    def num_stages(self) -> int:
        """Number of virtual stages ``S = p * v``."""
        return len(self.stage_ranks)

    @property
    def chunks(self) -> int:
        """Number of virtual stages per rank, ``v``."""
        return len(self.stage_ranks) // self.num_ranks

    def rank_of(self, stage: int) -> int:
        """The rank that holds virtual stage ``stage``."""
        return self.stage_ranks[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The virtual stages rank ``rank`` holds, in model order."""
        return self._rank_stages[rank]  # type: ignore[attr-defined]

    def chunk_index(self, stage: int) -> int:
        """Position of ``stage`` among its rank's stages (0 = earliest in model order)."""
        return self.stages_of(self.rank_of(stage)).index(stage)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"style": self.style, "num_ranks": self.num_ranks, "stage_ranks": list(self.stage_ranks)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Placement:
        """Inverse of :meth:`to_dict`."""
        return cls(tuple(data["stage_ranks"]), int(data["num_ranks"]), str(data.get("style", "explicit")))


@dataclass(frozen=True, init=False)
class Schedule:
    """A placement plus one ordered program of ops per rank.

    ``programs[r]`` is what rank ``r`` executes, in order.  ``meta`` carries builder details worth
    keeping (the memory limit it planned for, the variant a search chose); it must be JSON-ready.
    Builders may pass any sequences of ops; the schedule keeps frozen tuples.

    ``overlapped`` lists the *overlapped F&B pairs* (DualPipe's F&B): each ``(forward, backward)``
    names an F and a B or BW of another microbatch or stage, adjacent in one rank's program in that
    order, that run as one unit, each hiding the other's expert all-to-all (docs/schedulers.md,
    "DualPipeV").  Empty for every other schedule.
    """

    name: str
    placement: Placement
    microbatches: int
    programs: tuple[tuple[Op, ...], ...]
    meta: Mapping[str, Any]
    overlapped: tuple[tuple[Op, Op], ...]

    def __init__(
        self,
        name: str,
        placement: Placement,
        microbatches: int,
        programs: Sequence[Sequence[Op]],
        meta: Mapping[str, Any] | None = None,
        overlapped: Iterable[tuple[Op, Op]] = (),
    ) -> None:
        # A frozen dataclass with its own __init__: the constructor takes lists, the object holds tuples.
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "placement", placement)
        object.__setattr__(self, "microbatches", microbatches)
        object.__setattr__(self, "programs", tuple(tuple(program) for program in programs))
        object.__setattr__(self, "meta", dict(meta or {}))
        object.__setattr__(self, "overlapped", tuple((first, second) for first, second in overlapped))
        # read by every simulation and validation: found once, not per read
        has_vocab = any(op.kind is Kind.S or op.kind is Kind.T for program in self.programs for op in program)
        object.__setattr__(self, "_vocab_shards", placement.num_ranks if has_vocab else 0)
        if len(self.programs) != self.placement.num_ranks:
            raise ScheduleError(
                f"schedule {self.name!r} has {len(self.programs)} programs for "
                f"{self.placement.num_ranks} ranks; it needs one program per rank"
            )
        if self.microbatches < 1:
            raise ScheduleError(f"schedule {self.name!r} needs at least one microbatch")

    @property
    def num_ranks(self) -> int:
        """``p``, the number of ranks."""
        return self.placement.num_ranks

    @property
    def num_stages(self) -> int:
        """``S = p * v``, the number of virtual stages."""
        return self.placement.num_stages

    @property
    def chunks(self) -> int:
        """``v``, virtual stages per rank."""
        return self.placement.chunks

    @property
    def num_ops(self) -> int:
        """Total number of ops over all ranks."""
        return sum(len(program) for program in self.programs)

    @property
    def vocab_shards(self) -> int:
        """The number of vocabulary shards (``p``) when the schedule has S and T ops, else 0."""
        return self._vocab_shards  # type: ignore[attr-defined]

    @property
    def splits_backward(self) -> bool:
        """True when the schedule uses separate B and W ops (so the runtime must defer W)."""
        return any(op.kind is Kind.W for program in self.programs for op in program)

    def pair_starts(self) -> tuple[tuple[int, ...], ...]:
        """Per rank, the program positions ``i`` whose op and op ``i + 1`` form an overlapped pair
        (:attr:`overlapped`); raises :class:`ScheduleError` for a pair that is not two adjacent ops,
        forward first, of one rank's program, or an op in two pairs."""
        if not self.overlapped:
            return ((),) * self.num_ranks
        where = {op: (rank, i) for rank, program in enumerate(self.programs) for i, op in enumerate(program)}
        starts: list[list[int]] = [[] for _ in self.programs]
        for first, second in self.overlapped:
            if first.kind is not Kind.F or not second.computes_input_grad:
                raise ScheduleError(f"overlapped pair {first}&{second}: an F and then a B or BW are paired")
            rank, i = where.get(first, (-1, -1))
            if rank < 0 or where.get(second) != (rank, i + 1):
                raise ScheduleError(
                    f"overlapped pair {first}&{second}: the two must be adjacent in one rank's program, "
                    f"{first} first"
                )
            starts[rank].append(i)
        for rank, positions in enumerate(starts):
            positions.sort()
            if any(b - a < 2 for a, b in itertools.pairwise(positions)):
                raise ScheduleError(f"rank {rank}: an op belongs to two overlapped pairs")
        return tuple(map(tuple, starts))

    def ops(self) -> Iterator[tuple[int, Op]]:
        """Every ``(rank, op)`` in rank order, then program order."""
        for rank, program in enumerate(self.programs):
            for op in program:
                yield rank, op

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; ops are written as their strings (``"F0.3"``)."""
        data = {
            "format": "zerobubble-schedule/1",
            "name": self.name,
            "microbatches": self.microbatches,
            "placement": self.placement.to_dict(),
            "programs": [[str(op) for op in program] for program in self.programs],
            "meta": dict(self.meta),
        }
        if self.overlapped:  # written only when present: other schedules' files stay as they were
            data["overlapped"] = [f"{first}&{second}" for first, second in self.overlapped]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Schedule:
        """Inverse of :meth:`to_dict`."""
        try:
            return cls(
                name=str(data["name"]),
                placement=Placement.from_dict(data["placement"]),
                microbatches=int(data["microbatches"]),
                programs=tuple(tuple(Op.parse(text) for text in program) for program in data["programs"]),
                meta=dict(data.get("meta", {})),
                overlapped=tuple(_parse_pair(text) for text in data.get("overlapped", ())),
            )
        except KeyError as missing:
            raise ScheduleError(f"schedule JSON lacks the field {missing}") from None

    def to_json(self, indent: int | None = None) -> str:
        """Serialise to a JSON string."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        """Read a schedule written by :meth:`to_json`."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ScheduleError(f"schedule file is not valid JSON: {error}") from None
        return cls.from_dict(data)

    def format_programs(self) -> str:
        """One line per rank listing its ops, for reading in a terminal (an overlapped pair as
        ``F0.3&BW7.1``)."""
        lines = []
        for rank, (program, starts) in enumerate(zip(self.programs, self.pair_starts())):
            words = [str(op) for op in program]
            for i in reversed(starts):
                words[i : i + 2] = [f"{words[i]}&{words[i + 1]}"]
            lines.append(f"rank {rank}: " + " ".join(words))
        return "\n".join(lines)


def _parse_pair(text: str) -> tuple[Op, Op]:
    """An overlapped pair from its string form ``"F0.3&BW7.1"``."""
    first, sep, second = str(text).partition("&")
    if not sep:
        raise ScheduleError(f"cannot read overlapped pair {text!r}: expected <F op>&<B or BW op>")
    return Op.parse(first), Op.parse(second)


def dependencies(op: Op, num_stages: int, vocab_shards: int = 0) -> tuple[tuple[Kind, int, int], ...]:
    """What ``op`` waits for, as ``(role, stage, microbatch)`` with role F, B or S.

    Role ``B`` means "the op that computes the input gradient of that stage" (a B or a BW), so
    schedules may mix fused and split backwards.  F(s,j) needs F(s-1,j); B/BW(s,j) needs F(s,j) and
    the input gradient of stage s+1 (the last stage's backward needs only its own F, which computes
    the loss); W(s,j) needs B(s,j).

    With ``vocab_shards`` = p (a schedule with S and T ops), the loss is the output layer's: S(r,j)
    needs the last stage's F(S-1,j) (its hidden states, broadcast), and both T(r,j) and the last
    stage's backward need S(r',j) of every shard r' (the one reduction of microbatch j).
    """
    s, j = op.stage, op.microbatch
    kind = op.kind
    if kind is Kind.F:
        return ((Kind.F, s - 1, j),) if s > 0 else ()
    if kind is Kind.W:
        return ((Kind.B, s, j),)
    if kind is Kind.S:
        return ((Kind.F, num_stages - 1, j),)
    if kind is Kind.T:
        return tuple((Kind.S, shard, j) for shard in range(vocab_shards))
    if s + 1 < num_stages:
        return ((Kind.F, s, j), (Kind.B, s + 1, j))
    return ((Kind.F, s, j), *((Kind.S, shard, j) for shard in range(vocab_shards)))


def check_positive(**values: int) -> None:
    """Raise :class:`ScheduleError` unless every given value is an integer ≥ 1."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {value!r}")
