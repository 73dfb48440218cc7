"""The IR of a lowered program: communication ops, the actions of a rank, and the lowered schedule.

A rank's lowered program is a sequence of :class:`Action`: :class:`Compute` (one part of a compute
op: an op whose stage is cut into several parts runs as consecutive parts, with communication
actions between them and no other compute), :class:`Issue` (start a communication op
asynchronously), :class:`Wait` (block the compute stream until it is done) and :class:`Step` (the
optimizer step).  A :class:`Comm` names one communication op; its group says who takes part.
``docs/communication.md`` says where the lowering puts each one and why.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..channels import MessageKey
from ..grid import Grid
from ..ir import Kind, Op, Schedule
from ..sharding import FSDPOptions


class CommKind(str, enum.Enum):
    """What a communication op does."""

    SEND = "send"
    RECV = "recv"
    UNSHARD = "unshard"
    RESHARD = "reshard"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    VOCAB_BROADCAST = "vocab_broadcast"
    VOCAB_REDUCE = "vocab_reduce"
    ALL_TO_ALL = "all_to_all"

    def __str__(self) -> str:
        return self.value


#: The group each kind runs in: ``pp`` (a point-to-point channel between pipeline ranks), ``dp`` (the
#: data-parallel replicas of one pipeline rank), ``vocab`` (every pipeline rank: the output layer) and
#: ``ep`` (a stage's expert-parallel ranks: an F's or a B's token dispatch and combine).
GROUP_OF = {
    CommKind.SEND: "pp",
    CommKind.RECV: "pp",
    CommKind.UNSHARD: "dp",
    CommKind.RESHARD: "dp",
    CommKind.REDUCE_SCATTER: "dp",
    CommKind.ALL_REDUCE: "dp",
    CommKind.VOCAB_BROADCAST: "vocab",
    CommKind.VOCAB_REDUCE: "vocab",
    CommKind.ALL_TO_ALL: "ep",
}

#: The kinds that reduce gradients (each unit or bucket exactly once per step).
REDUCTIONS = (CommKind.REDUCE_SCATTER, CommKind.ALL_REDUCE)


@dataclass(frozen=True, slots=True, order=True)
class Comm:
    """One communication op of a step.

    ``stage`` and ``index`` say what it moves: the unit ``(stage, index)`` for unshard, reshard and
    reduce-scatter, the bucket ``(stage, index)`` for an all-reduce, the message's boundary and
    direction (:data:`~..channels.ACTIVATIONS` 0, gradients 1) for send and recv, the shard's rank
    for the vocabulary ops (-1: all of them), the op's stage and 0 (F) or 1 (B, BW) for an
    all-to-all; ``microbatch`` is the message's or the vocabulary
    op's microbatch (-1 otherwise) and ``round`` counts the unshards (and reshards) of one unit:
    a unit resharded after its forwards is unsharded again before its backwards.
    """

    kind: CommKind
    stage: int
    index: int = 0
    microbatch: int = -1
    round: int = 0

    @property
    def group(self) -> str:
        """``pp``, ``dp``, ``vocab`` or ``ep`` (:data:`GROUP_OF`)."""
        return GROUP_OF[self.kind]

    @property
    def communicator(self) -> str:
        """The communicator it runs on, in whose order every member must issue: ``dp`` (FSDP's
        gathers and reductions, or replicate's all-reduces), ``vocab-hidden`` (the last stage's
        hidden states), ``vocab-reduce`` (the output layer's reductions), ``pp`` (channels)."""
        if self.kind is CommKind.VOCAB_BROADCAST:
            return "vocab-hidden"
        if self.kind is CommKind.VOCAB_REDUCE:
            return "vocab-reduce"
        return self.group

    @property
    def message(self) -> MessageKey:
        """The message a send or recv carries."""
        return MessageKey(self.index, self.stage, self.microbatch)

    def __str__(self) -> str:
        kind = self.kind.value
        if self.kind in (CommKind.SEND, CommKind.RECV):
            return f"{kind}({self.message.describe()})"
        if self.kind is CommKind.ALL_TO_ALL:
            return f"{kind}({'B' if self.index else 'F'}{self.stage}.{self.microbatch})"
        if self.kind in (CommKind.VOCAB_BROADCAST, CommKind.VOCAB_REDUCE):
            return f"{kind}(mb {self.microbatch})"
        what = "bucket" if self.kind is CommKind.ALL_REDUCE else "unit"
        again = f" #{self.round}" if self.round else ""
        return f"{kind}({what} {self.stage}.{self.index}{again})"


def send(message: MessageKey) -> Comm:
    """The send of ``message``."""
    return Comm(CommKind.SEND, message.boundary, message.direction, message.microbatch)


def recv(message: MessageKey) -> Comm:
    """The receive of ``message``."""
    return Comm(CommKind.RECV, message.boundary, message.direction, message.microbatch)


@dataclass(frozen=True, slots=True)
class Compute:
    """Part ``part`` of ``parts`` of compute op ``op``: the layers of unit/bucket ``part`` of its
    stage.  A forward reads the parts in order 0, 1, …; a backward (B, W, BW) in reverse."""

    op: Op
    part: int = 0
    parts: int = 1

    @property
    def backwards(self) -> bool:
        """True when the op reads its parts last to first (B, W, BW)."""
        return not (self.op.kind is Kind.F or self.op.is_vocab)

    @property
    def first(self) -> bool:
        """True for the op's first part (it starts the op)."""
        return self.part == (self.parts - 1 if self.backwards else 0)

    @property
    def last(self) -> bool:
        """True for the op's last part (it ends the op)."""
        return self.part == (0 if self.backwards else self.parts - 1)

    def __str__(self) -> str:
        return str(self.op) if self.parts == 1 else f"{self.op}[{self.part}]"


@dataclass(frozen=True, slots=True)
class Issue:
    """Start ``comm`` asynchronously (a reshard frees at once and has no wait)."""

    comm: Comm

    def __str__(self) -> str:
        return f"issue {self.comm}"


@dataclass(frozen=True, slots=True)
class Wait:
    """Block the compute stream until ``comm`` is done on this rank."""

    comm: Comm

    def __str__(self) -> str:
        return f"wait {self.comm}"


@dataclass(frozen=True, slots=True)
class Step:
    """The optimizer step: after every gradient reduction of the rank has been waited for."""

    def __str__(self) -> str:
        return "step"


Action = Compute | Issue | Wait | Step


@dataclass(frozen=True)
class LoweredSchedule:
    """A schedule lowered to each rank's full program.

    ``options`` is how the data-parallel communication was laid out, ``grid`` whose mode (none,
    replicated, FSDP or HSDP: :attr:`~..grid.Grid.dp_mode`) and sizes it ran under.
    ``programs[r]`` is pipeline rank ``r``'s action sequence, run alike by the grid's ``dp``
    data-parallel replicas unless ``replica_programs`` holds another for ``(replica, rank)`` (a
    lowering that differs per replica: the validator then checks their collectives agree).
    ``part_layers[s]`` are the layer counts of stage ``s``'s parts (units or buckets),
    ``part_bytes[s]`` their parameter bytes (one replica's full copy) and ``part_grad_bytes[s]``
    their gradient bytes.
    """

    source: Schedule
    options: FSDPOptions
    programs: tuple[tuple[Action, ...], ...]
    part_layers: tuple[tuple[int, ...], ...]
    part_bytes: tuple[tuple[float, ...], ...]
    part_grad_bytes: tuple[tuple[float, ...], ...]
    grid: Grid = field(default_factory=Grid)
    replica_programs: Mapping[tuple[int, int], tuple[Action, ...]] = field(default_factory=dict)

    @property
    def replicas(self) -> int:
        """The data-parallel replicas (the grid's ``dp``)."""
        return self.grid.dp

    @property
    def shard(self) -> int:
        """The ranks a parameter is cut over (the grid's ``shard``; 1: replicated)."""
        return self.grid.shard

    @property
    def data_parallel(self) -> str:
        """``"none"``, ``"replicate"`` or ``"fsdp"`` (HSDP too): the grid's :attr:`~..grid.Grid.dp_mode`."""
        return self.grid.dp_mode

    def program_of(self, rank: int, replica: int = 0) -> tuple[Action, ...]:
        """The program of pipeline rank ``rank`` in data-parallel replica ``replica``."""
        return self.replica_programs.get((replica, rank), self.programs[rank])

    def format_programs(self) -> str:
        """One line per rank listing its actions, for reading in a terminal."""
        return "\n".join(
            f"rank {rank}: " + " ; ".join(str(action) for action in program)
            for rank, program in enumerate(self.programs)
        )
