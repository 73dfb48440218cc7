"""Timing a lowered program: a compute stream per rank and communication links that overlap with it.

Each rank runs its actions in order on its compute stream: a compute part takes its op's time times
its share of the stage's layers, an issue hands a communication op to a link and goes on, a wait
blocks until that op is done on this rank.  A communication op starts once every member whose issue
gates it has issued it (the sender of a message; the last stage's rank for the hidden states'
broadcast; every rank for the output layer's reduction; the rank itself for its data-parallel
collectives, its replicas running the same program at the same times) and once the op before it
on each of its links is over: a link carries one op at a time, in issue order (a channel per pair
of ranks, ``dp`` and ``ep`` per rank, one per vocabulary communicator).  Durations: a message's hop
time (``CostModel.comm``), ``vocab_comm`` per member, an all-to-all's ``CostModel.a2a`` (on a grid
with ``ep``, whose compute parts then leave it out), the data-parallel ones from
:class:`~.collectives.CollectiveCosts`.  ``docs/communication.md`` gives the model and its limits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ...errors import LoweredDeadlock, ScheduleError
from ..costs import CostModel, StageCosts
from ..gcpause import collector_paused
from ..ir import Kind
from ..simulate import resolve_costs_for
from .actions import Comm, CommKind, Compute, Issue, LoweredSchedule, Step, Wait, send
from .collectives import CollectiveCosts
from .memory import ParameterMemory, memory_levels
from .spans import CommTimeline


@dataclass(eq=False)
class _Transfer:
    """One communication op in flight: who gates it, its links, when it starts and ends per member."""

    comm: Comm
    gating: frozenset[int]
    links: tuple[tuple[int, str], ...]
    duration: Callable[[int], float]
    issued: dict[int, float] = field(default_factory=dict)
    before: list[_Transfer] = field(default_factory=list)
    after: list[_Transfer] = field(default_factory=list)
    waiters: list[int] = field(default_factory=list)
    start: float | None = None
    busy: float = 0.0

    def end_for(self, rank: int) -> float:
        assert self.start is not None
        return self.start + self.duration(rank)


class _Run:
    """The event loop: ranks advance until they wait on an op not yet started, and are woken when
    it resolves."""

    def __init__(
        self, lowered: LoweredSchedule, costs: StageCosts, collectives: CollectiveCosts, overlap: bool
    ):
        self.lowered, self.costs, self.collectives, self.overlap = lowered, costs, collectives, overlap
        schedule = lowered.source
        self.p = schedule.num_ranks
        self.root = schedule.placement.rank_of(schedule.num_stages - 1)
        self.transfers: dict[tuple, _Transfer] = {}
        self.last_on_link: dict[tuple[int, str], _Transfer] = {}
        self.clock = [0.0] * self.p
        self.position = [0] * self.p
        self.starts: list[list[float]] = [[] for _ in range(self.p)]
        self.ends: list[list[float]] = [[] for _ in range(self.p)]
        # on an ep grid the all-to-all is a communication op of its own, not part of the compute
        self.a2a_apart = lowered.grid.ep > 1
        groups = ("pp", "dp", "vocab", "ep") if self.a2a_apart else ("pp", "dp", "vocab")
        self.exposed: list[dict[str, float]] = [dict.fromkeys(groups, 0.0) for _ in range(self.p)]
        self.span_start = [float("inf")] * self.p
        self.runnable = list(range(self.p))

    # -- which transfer an action names, and how long it takes ------------------------------------

    def transfer(self, rank: int, comm: Comm) -> _Transfer:
        kind, schedule = comm.kind, self.lowered.source
        if kind in (CommKind.SEND, CommKind.RECV):
            key: tuple = ("pp", comm.message)
        elif comm.group == "vocab":
            key = ("vocab", comm)
        elif kind is CommKind.ALL_TO_ALL:
            key = ("ep", rank, comm)
        else:
            key = ("dp", rank, comm)
        found = self.transfers.get(key)
        if found is not None:
            return found
        if key[0] == "pp":
            message = comm.message
            sender = schedule.placement.rank_of(message.boundary + message.direction)
            receiver = schedule.placement.rank_of(message.boundary + 1 - message.direction)
            hop = self.costs.comm[message.boundary]
            link = ((sender, f"pp->{receiver}"),)
            made = _Transfer(send(message), frozenset({sender}), link, lambda _: hop)
        elif kind is CommKind.VOCAB_BROADCAST:
            vocab, root = self.costs.vocab_comm, self.root
            made = _Transfer(
                comm, frozenset({root}), ((root, "vocab-hidden"),), lambda r: 0.0 if r == root else vocab[r]
            )
        elif kind is CommKind.VOCAB_REDUCE:
            vocab = self.costs.vocab_comm
            links = tuple((r, "vocab-reduce") for r in range(self.p))
            made = _Transfer(comm, frozenset(range(self.p)), links, vocab.__getitem__)
        elif kind is CommKind.ALL_TO_ALL:
            seconds = self.costs.a2a[comm.stage]
            made = _Transfer(comm, frozenset({rank}), ((rank, "ep"),), lambda _: seconds)
        else:
            seconds = self.collectives.time(kind, self._volume(comm))
            made = _Transfer(comm, frozenset({rank}), ((rank, "dp"),), lambda _: seconds)
        self.transfers[key] = made
        return made

    def _volume(self, comm: Comm) -> float:
        table = self.lowered.part_bytes if comm.kind is CommKind.UNSHARD else self.lowered.part_grad_bytes
        return table[comm.stage][comm.index]

    def part_time(self, part: Compute) -> float:
        op = part.op
        duration = self.costs.duration(op)
        if self.a2a_apart and (op.kind is Kind.F or op.computes_input_grad):
            duration -= self.costs.a2a[op.stage]
        if part.parts == 1:
            return duration
        layers = self.lowered.part_layers[op.stage]
        return duration * layers[part.part] / sum(layers)

    # -- the loop --------------------------------------------------------------------------------------

    def run(self) -> None:
        programs = [self.lowered.program_of(rank) for rank in range(self.p)]
        while self.runnable:
            rank = self.runnable.pop()
            program = programs[rank]
            while self.position[rank] < len(program):
                if not self._advance(rank, program[self.position[rank]]):
                    break
                self.position[rank] += 1
        stuck = [rank for rank in range(self.p) if self.position[rank] < len(programs[rank])]
        if stuck:
            raise self._deadlock(stuck[0], programs[stuck[0]][self.position[stuck[0]]])

    def _advance(self, rank: int, action: object) -> bool:
        """Carry out ``action`` on ``rank``; False when it must wait for a transfer not yet started."""
        now = self.clock[rank]
        if isinstance(action, Compute):
            self.span_start[rank] = min(self.span_start[rank], now)
            return self._record(rank, now, now + self.part_time(action))
        if isinstance(action, Step):
            return self._record(rank, now, now)
        if isinstance(action, Issue):
            if action.comm.kind is CommKind.RESHARD:
                return self._record(rank, now, now)
            transfer = self.transfer(rank, action.comm)
            if transfer.issued.get(rank) is None:  # a blocking re-entry must not issue twice
                self._issue(rank, transfer, now)
            if not self.overlap and action.comm.group == "dp":
                return self._wait(rank, transfer, now, record_start=now)
            return self._record(rank, now, now)
        if isinstance(action, Wait):
            return self._wait(rank, self.transfer(rank, action.comm), now, record_start=now)
        raise ScheduleError(f"rank {rank}: {action!r} is not an action of a lowered program")

    def _record(self, rank: int, start: float, end: float) -> bool:
        self.starts[rank].append(start)
        self.ends[rank].append(end)
        self.clock[rank] = end
        return True

    def _issue(self, rank: int, transfer: _Transfer, now: float) -> None:
        transfer.issued[rank] = now
        if rank not in transfer.gating:
            return
        self.span_start[rank] = min(self.span_start[rank], now)
        for link in transfer.links:
            if link[0] == rank:
                previous = self.last_on_link.get(link)
                if previous is not None:
                    transfer.before.append(previous)
                    previous.after.append(transfer)
                self.last_on_link[link] = transfer
        self._resolve(transfer)

    def _wait(self, rank: int, transfer: _Transfer, now: float, *, record_start: float) -> bool:
        if transfer.start is None:
            transfer.waiters.append(rank)
            return False
        end = max(now, transfer.end_for(rank))
        self.exposed[rank][transfer.comm.group] += end - now
        return self._record(rank, record_start, end)

    def _resolve(self, first: _Transfer) -> None:
        """Start every transfer that can start now, ``first`` and those queued behind it."""
        pending = [first]
        while pending:
            transfer = pending.pop()
            if transfer.start is not None or not transfer.gating <= transfer.issued.keys():
                continue
            if any(before.start is None for before in transfer.before):
                continue
            issued = max(transfer.issued[rank] for rank in transfer.gating)
            free = max((before.start + before.busy for before in transfer.before), default=0.0)  # type: ignore[operator]
            transfer.start = max(issued, free)
            transfer.busy = max(transfer.duration(rank) for rank, _ in transfer.links)
            self.runnable += transfer.waiters
            transfer.waiters = []
            pending += transfer.after

    def _deadlock(self, rank: int, action: object) -> LoweredDeadlock:
        reason = "cannot proceed"
        if isinstance(action, (Wait, Issue)):
            transfer = self.transfer(rank, action.comm)
            missing = sorted(transfer.gating - transfer.issued.keys())
            if missing:
                reason = f"waits for {action.comm}, which rank(s) {missing} never issue before they block"
            else:
                behind = next((b.comm for b in transfer.before if b.start is None), None)
                reason = f"waits for {action.comm}, queued on its link behind {behind}, which never starts"
        return LoweredDeadlock(
            f"deadlock in the lowered programs: rank {rank} at action {self.position[rank]} "
            f"({action}) {reason}",
            rank,
            action,
        )


def simulate_lowered(
    lowered: LoweredSchedule,
    costs: CostModel | StageCosts | None = None,
    collectives: CollectiveCosts | None = None,
    *,
    overlap: bool = True,
) -> CommTimeline:
    """Time ``lowered`` under ``costs`` (the source schedule's compute, hop and vocabulary costs) and
    ``collectives`` (the data-parallel ones; none take time without).  ``overlap=False`` makes every
    data-parallel collective block the compute stream from its issue to its end, as a synchronous
    call would.  Raises :class:`LoweredDeadlock` when the programs cannot finish."""
    stage_costs = resolve_costs_for(lowered.source, costs)
    collectives = collectives or CollectiveCosts(dp=lowered.replicas, shard=lowered.shard)
    with collector_paused():
        run = _Run(lowered, stage_costs, collectives, overlap)
        run.run()
    spans = _comm_spans(run)
    memory: ParameterMemory = memory_levels(lowered, stage_costs)
    return CommTimeline(
        lowered=lowered,
        costs=stage_costs,
        start=tuple(map(tuple, run.starts)),
        end=tuple(map(tuple, run.ends)),
        span_start=tuple(0.0 if s == float("inf") else s for s in run.span_start),
        comm_spans=spans,
        exposed=tuple(run.exposed),
        memory=memory,
    )


def _comm_spans(run: _Run) -> tuple[tuple[tuple[Comm, str, float, float], ...], ...]:
    """Per rank, ``(comm, lane, start, end)`` of every transfer on one of its links, by start."""
    spans: list[list[tuple[Comm, str, float, float]]] = [[] for _ in range(run.p)]
    for transfer in run.transfers.values():
        if transfer.start is None:
            continue
        for rank, _link in transfer.links:
            spans[rank].append((transfer.comm, transfer.comm.group, transfer.start, transfer.end_for(rank)))
    return tuple(tuple(sorted(rank_spans, key=lambda span: (span[2], span[3]))) for rank_spans in spans)
