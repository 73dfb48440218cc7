"""Checks a lowered program before anything runs it.

:func:`validate_lowered` raises :class:`LoweringError` (a :class:`~...errors.ValidationError`)
naming the rank, the action and the reason when: the compute ops differ from the source schedule's
or an op's parts are split up; a part reads an FSDP unit that is not unsharded and waited for; an
op runs before the message, broadcast or reduction it needs has been waited for; an issue has no
wait (or a wait no issue); a unit's or bucket's gradient is reduced zero or two times, before its
last gradient part, after the optimizer step, or never waited for; a channel's receives are posted
in another order than its sends; the members of one communicator issue its collectives in different
orders (the replicas of a pipeline rank for ``dp``, every pipeline rank for the output layer's);
or the programs wait on each other forever.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from ...errors import LoweredDeadlock, LoweringError
from ..channels import received_message, receiving_stage, sending_stage
from ..ir import Kind
from ..validate import validate_schedule
from .actions import REDUCTIONS, Action, Comm, CommKind, Compute, Issue, LoweredSchedule, Step, Wait, recv
from .lower import compute_ops
from .overlap import simulate_lowered


def validate_lowered(lowered: LoweredSchedule) -> None:
    """Check ``lowered`` completely (module docstring); raises :class:`LoweringError`."""
    validate_schedule(lowered.source)
    _check_collective_order(lowered)  # first: a mismatch here is what would hang
    for replica, rank, program in _programs(lowered):
        where = f"rank {rank}" + (f" (replica {replica})" if replica else "")
        _check_compute(lowered, rank, program, where)
        _check_needs(lowered, rank, program, where)
        if lowered.data_parallel == "fsdp":
            _check_units(rank, program, where)
        _check_issues_and_waits(rank, program, where)
        if lowered.data_parallel != "none":
            _check_reductions(lowered, rank, program, where)
    _check_channels(lowered)
    try:
        simulate_lowered(lowered)
    except LoweredDeadlock as error:
        raise LoweringError(str(error), error.rank) from None


def _programs(lowered: LoweredSchedule) -> Iterator[tuple[int, int, tuple[Action, ...]]]:
    for rank in range(lowered.source.num_ranks):
        yield 0, rank, lowered.programs[rank]
    for (replica, rank), program in sorted(lowered.replica_programs.items()):
        yield replica, rank, program


def _fail(where: str, rank: int, action: Action | None, reason: str) -> LoweringError:
    at = f" at {action}" if action is not None else ""
    return LoweringError(f"{where}{at}: {reason}", rank, action)


def _check_compute(lowered: LoweredSchedule, rank: int, program: tuple[Action, ...], where: str) -> None:
    """The source's ops in its order; each op's parts in reading order, with no other compute between."""
    if list(compute_ops(program)) != list(lowered.source.programs[rank]):
        raise _fail(where, rank, None, "its compute ops differ from the source schedule's program")
    parts = [action for action in program if isinstance(action, Compute)]
    expected: list[Compute] = []
    for op in lowered.source.programs[rank]:
        count = 1 if op.is_vocab else len(lowered.part_layers[op.stage])
        order = range(count) if op.kind is Kind.F or op.is_vocab else range(count - 1, -1, -1)
        expected += [Compute(op, part, count) for part in order]
    for got, want in zip(parts, expected):
        if got != want:
            raise _fail(
                where, rank, got, f"expected {want}: an op runs its parts in order, without other compute"
            )
    if len(parts) != len(expected):
        raise _fail(where, rank, None, f"has {len(parts)} compute parts, expected {len(expected)}")
    steps = [i for i, action in enumerate(program) if isinstance(action, Step)]
    if steps != [len(program) - 1]:
        raise _fail(where, rank, None, "needs exactly one optimizer step, as its last action")


def _check_issues_and_waits(rank: int, program: tuple[Action, ...], where: str) -> None:
    """Each comm issued once (a reshard aside), and waited once after its issue."""
    issued: set[Comm] = set()
    waited: set[Comm] = set()
    for action in program:
        if isinstance(action, Issue):
            if action.comm in issued:
                raise _fail(where, rank, action, f"{action.comm} is issued twice")
            issued.add(action.comm)
        elif isinstance(action, Wait):
            if action.comm not in issued:
                raise _fail(where, rank, action, f"waits for {action.comm} before issuing it")
            if action.comm in waited:
                raise _fail(where, rank, action, f"waits twice for {action.comm}")
            waited.add(action.comm)
    missing = sorted(comm for comm in issued - waited if comm.kind is not CommKind.RESHARD)
    if missing:
        raise _fail(where, rank, Issue(missing[0]), f"{missing[0]} is issued but never waited for")


def _needed(lowered: LoweredSchedule, rank: int, part: Compute) -> list[Comm]:
    """What the op of ``part`` (its first part) must have waited for: its message from another
    rank, the hidden states (S), the output layer's reduction (T, the last stage's backward)."""
    source, op = lowered.source, part.op
    S, j = source.num_stages, op.microbatch
    needs = []
    message = None if op.is_vocab else received_message(op, S)
    if message is not None and source.placement.rank_of(sending_stage(message)) != rank:
        needs.append(recv(message))
    if op.kind is Kind.S:
        needs.append(Comm(CommKind.VOCAB_BROADCAST, -1, 0, j))
    if source.vocab_shards and (op.kind is Kind.T or (op.computes_input_grad and op.stage == S - 1)):
        needs.append(Comm(CommKind.VOCAB_REDUCE, -1, 0, j))
    return needs


def _check_needs(lowered: LoweredSchedule, rank: int, program: tuple[Action, ...], where: str) -> None:
    waited: set[Comm] = set()
    for action in program:
        if isinstance(action, Wait):
            waited.add(action.comm)
        elif isinstance(action, Compute) and action.first:
            for comm in _needed(lowered, rank, action):
                if comm not in waited:
                    raise _fail(where, rank, action, f"runs before {comm} is waited for, which it needs")


def _check_units(rank: int, program: tuple[Action, ...], where: str) -> None:
    """A unit is read only while unsharded and waited for; unshard and reshard alternate."""
    state: dict[tuple[int, int], str] = {}  # "issued", "ready"; absent: resharded
    for action in program:
        if isinstance(action, Issue) and action.comm.kind in (CommKind.UNSHARD, CommKind.RESHARD):
            unit = (action.comm.stage, action.comm.index)
            if action.comm.kind is CommKind.UNSHARD:
                if unit in state:
                    raise _fail(
                        where, rank, action, f"unit {unit[0]}.{unit[1]} is unsharded again before a reshard"
                    )
                state[unit] = "issued"
            elif state.pop(unit, None) is None:
                raise _fail(where, rank, action, f"unit {unit[0]}.{unit[1]} is resharded but not unsharded")
        elif isinstance(action, Wait) and action.comm.kind is CommKind.UNSHARD:
            unit = (action.comm.stage, action.comm.index)
            if state.get(unit) == "issued":
                state[unit] = "ready"
        elif isinstance(action, Compute) and not action.op.is_vocab:
            unit = (action.op.stage, action.part)
            if state.get(unit) != "ready":
                how = "before its unshard is waited for" if unit in state else "while it is resharded"
                raise _fail(where, rank, action, f"reads unit {unit[0]}.{unit[1]} {how}")


def _check_reductions(lowered: LoweredSchedule, rank: int, program: tuple[Action, ...], where: str) -> None:
    """Every unit or bucket of the rank reduced once, after its last gradient part, waited before the step."""
    kind = CommKind.REDUCE_SCATTER if lowered.data_parallel == "fsdp" else CommKind.ALL_REDUCE
    last_grad: dict[tuple[int, int], int] = {}
    issued: Counter[tuple[int, int]] = Counter()
    issue_at: dict[tuple[int, int], int] = {}
    for i, action in enumerate(program):
        if isinstance(action, Compute) and action.op.computes_weight_grad:
            last_grad[(action.op.stage, action.part)] = i
        elif isinstance(action, Issue) and action.comm.kind in REDUCTIONS:
            part = (action.comm.stage, action.comm.index)
            if action.comm.kind is not kind:
                raise _fail(where, rank, action, f"a {lowered.data_parallel} lowering reduces with {kind}")
            issued[part] += 1
            issue_at[part] = i
    for stage in lowered.source.placement.stages_of(rank):
        for index in range(len(lowered.part_layers[stage])):
            part, name = (stage, index), f"the gradient of {stage}.{index}"
            if issued[part] != 1:
                raise _fail(
                    where, rank, None, f"{name} is reduced {issued[part]} times; it must be exactly once"
                )
            if issue_at[part] < last_grad.get(part, -1):
                raise _fail(
                    where, rank, program[issue_at[part]], f"{name} is reduced before its last gradient part"
                )
    step = len(program) - 1
    for at in issue_at.values():
        comm = program[at].comm  # type: ignore[union-attr]
        if Wait(comm) not in program[at:step]:
            raise _fail(where, rank, program[at], f"{comm} is not waited for before the optimizer step")


def _check_channels(lowered: LoweredSchedule) -> None:
    """On every channel the receiver posts its receives in the order the sender sends."""
    source = lowered.source
    placement = source.placement
    for replica, rank, program in _programs(lowered):
        sends: dict[int, list] = {}
        for action in program:
            if isinstance(action, Issue) and action.comm.kind is CommKind.SEND:
                dst = placement.rank_of(receiving_stage(action.comm.message))
                sends.setdefault(dst, []).append(action.comm.message)
        for dst, messages in sends.items():
            posted = [
                action.comm.message
                for action in lowered.program_of(dst, replica)
                if isinstance(action, Issue)
                and action.comm.kind is CommKind.RECV
                and placement.rank_of(sending_stage(action.comm.message)) == rank
            ]
            if posted != messages:
                first = next(
                    (i for i, (a, b) in enumerate(zip(posted, messages)) if a != b),
                    min(len(posted), len(messages)),
                )
                got = posted[first].describe() if first < len(posted) else "nothing"
                want = messages[first].describe() if first < len(messages) else "nothing"
                raise LoweringError(
                    f"rank {dst}: receive {first} from rank {rank} is {got}, but rank {rank} sends {want} "
                    "there (a channel is FIFO: receives are posted in the sender's order)",
                    dst,
                )


def _collectives(program: tuple[Action, ...], communicator: str) -> list[Comm]:
    return [
        action.comm
        for action in program
        if isinstance(action, Issue)
        and action.comm.communicator == communicator
        and action.comm.kind is not CommKind.RESHARD
    ]


def _check_collective_order(lowered: LoweredSchedule) -> None:
    """The replicas of a pipeline rank issue their dp collectives in one order; every pipeline rank
    issues the output layer's in one order (a mismatch would hang NCCL)."""
    p = lowered.source.num_ranks
    for rank in range(p):
        reference = _collectives(lowered.programs[rank], "dp")
        for (replica, other_rank), program in lowered.replica_programs.items():
            if other_rank == rank:
                _compare(
                    reference,
                    _collectives(program, "dp"),
                    f"rank {rank} (replica {replica})",
                    rank,
                    "dp",
                    "replica 0",
                )
    for communicator in ("vocab-hidden", "vocab-reduce"):
        reference = _collectives(lowered.programs[0], communicator)
        for rank in range(1, p):
            _compare(
                reference,
                _collectives(lowered.programs[rank], communicator),
                f"rank {rank}",
                rank,
                communicator,
                "rank 0",
            )


def _compare(
    reference: list[Comm], got: list[Comm], where: str, rank: int, communicator: str, against: str
) -> None:
    if got == reference:
        return
    i = next((i for i, (a, b) in enumerate(zip(got, reference)) if a != b), min(len(got), len(reference)))
    mine = str(got[i]) if i < len(got) else "nothing"
    theirs = str(reference[i]) if i < len(reference) else "nothing"
    raise LoweringError(
        f"{where}: collective {i} on the {communicator} communicator is {mine}, but {against} issues "
        f"{theirs} there; the members of a communicator must issue its collectives in one order",
        rank,
        Issue(got[i]) if i < len(got) else None,
    )
