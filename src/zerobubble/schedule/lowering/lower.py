"""The lowering pass: a built schedule becomes each rank's full program of compute and communication.

Every op of stage ``s`` runs as the parts of ``s`` (its FSDP units or all-reduce buckets; one part
without data parallelism), forwards in layer order, backwards in reverse.  Around the parts the pass
places, per rank (``docs/communication.md`` says why each goes where it goes):

* a send right after the op that produces the message; its receive posted when the channel's
  receive two before it is waited for (the first two at the start, at the latest one op ahead of
  the consumer, in the sender's order on each channel), waited just before the consumer;
* an FSDP unit's unshard ``prefetch`` parts before the first part that reads it, waited just before
  that part; its reshard after its last gradient part, and, with ``reshard_after_forward`` (and
  ``reshard_after_backward``), after each forward (gradient) read it is not read again soon after;
* a unit's reduce-scatter, or a bucket's all-reduce, right after its last gradient part (after
  that op's send);
* the output layer's broadcast after the last stage's forward (posted by the other ranks one op
  ahead of their S) and its reduction after each S, waited before T and the last backward;
* on a grid with an ``ep`` dimension, every F's and B's expert all-to-all right after it, waited at
  once (its layer needs it), or, for the halves of an overlapped F&B pair, behind the other half's
  compute (the backward's behind the next pair's forward), before the op's sends;
* at the end the waits of the sends and the reductions, then the optimizer step.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field

from ...errors import ScheduleError
from ..channels import MessageKey, received_message, receiving_stage, sending_stage, sent_message
from ..grid import Grid
from ..ir import Kind, Op, Schedule
from ..sharding import ONCE_PER_STEP, FSDPOptions
from .actions import (
    Action,
    Comm,
    CommKind,
    Compute,
    Issue,
    LoweredSchedule,
    Step,
    Wait,
    recv,
    send,
)
from .layout import StageBytes, stage_parts

#: How many receives of a channel are posted ahead of the one being waited for (the runtime's
#: measured look-ahead: ``docs/runtime.md``).
RECEIVES_AHEAD = 2


def lower(
    schedule: Schedule,
    options: FSDPOptions | None = None,
    *,
    grid: Grid | None = None,
    model: StageBytes | None = None,
) -> LoweredSchedule:
    """``schedule`` lowered to each rank's full program under ``options`` (module docstring).

    ``grid`` says the data-parallel mode and sizes (:attr:`~..grid.Grid.dp_mode`, ``dp``, ``shard``;
    default: one replica); ``options`` how its communication is laid out (default
    :data:`~..sharding.ONCE_PER_STEP`); ``model`` each stage's per-layer bytes (needed with data
    parallelism).  Raises :class:`ScheduleError` for what does not fit.
    """
    options = ONCE_PER_STEP if options is None else options
    grid = grid or Grid()
    if not isinstance(options, FSDPOptions):
        raise ScheduleError(f"lower: options must be an FSDPOptions record, got {options!r}")
    layers, params, grads = stage_parts(schedule.num_stages, model, options, grid.dp_mode)
    channels = _channels(schedule)
    programs = tuple(
        _RankLowering(schedule, options, grid.dp_mode, layers, rank, channels, grid.ep).program()
        for rank in range(schedule.num_ranks)
    )
    return LoweredSchedule(schedule, options, programs, layers, params, grads, grid)


def _channels(schedule: Schedule) -> dict[tuple[int, int], list[MessageKey]]:
    """Every ``(src, dst)`` channel's messages in send order (as :func:`~..channels.channel_messages`),
    read in one pass over the programs: per rank it would cost ranks × ops, minutes at pp 64."""
    stages, rank_of = schedule.num_stages, schedule.placement.rank_of
    channels: dict[tuple[int, int], list[MessageKey]] = defaultdict(list)
    for src, program in enumerate(schedule.programs):
        for op in program:
            key = sent_message(op, stages)
            if key is not None and rank_of(receiving_stage(key)) != src:
                channels[(src, rank_of(receiving_stage(key)))].append(key)
    return channels


@dataclass
class _RankLowering:
    """One rank's program under construction: its compute parts, and the actions to place before
    and after each (``before[len(parts)]`` is the end of the program)."""

    schedule: Schedule
    options: FSDPOptions
    mode: str  # the grid's dp_mode
    layers: tuple[tuple[int, ...], ...]
    rank: int
    channels: dict[tuple[int, int], list[MessageKey]]  # (src, dst) -> messages in send order
    grid_ep: int = 1
    parts: list[Compute] = field(default_factory=list)
    first_part: list[int] = field(default_factory=list)  # op index -> its first part's index
    before: defaultdict[int, list[Action]] = field(default_factory=lambda: defaultdict(list))
    after: defaultdict[int, list[Action]] = field(default_factory=lambda: defaultdict(list))
    finals: list[Comm] = field(default_factory=list)  # waited at the end, in issue order

    def program(self) -> tuple[Action, ...]:
        """Place everything, then read the program out."""
        self._expand()
        self._place_messages()
        if self.schedule.vocab_shards:
            self._place_vocab()
        if self.grid_ep > 1:
            self._place_experts()
        if self.mode == "fsdp":
            self._place_units()
        if self.mode != "none":
            self._place_reductions()
        actions: list[Action] = []
        for i, part in enumerate(self.parts):
            actions += self.before[i]
            actions.append(part)
            actions += self.after[i]
        actions += self.before[len(self.parts)]
        actions += [Wait(comm) for comm in self.finals]
        actions.append(Step())
        return tuple(actions)

    def _expand(self) -> None:
        for op in self.schedule.programs[self.rank]:
            self.first_part.append(len(self.parts))
            count = 1 if op.is_vocab else len(self.layers[op.stage])
            order = range(count) if op.kind is Kind.F or op.is_vocab else range(count - 1, -1, -1)
            self.parts += [Compute(op, part, count) for part in order]

    def _last_part(self, index: int) -> int:
        ends = [*self.first_part[1:], len(self.parts)]
        return ends[index] - 1

    def _place_messages(self) -> None:
        schedule, S = self.schedule, self.schedule.num_stages
        rank_of = schedule.placement.rank_of
        consumers: dict[object, int] = {}
        for index, op in enumerate(schedule.programs[self.rank]):
            sent = sent_message(op, S)
            if sent is not None and rank_of(receiving_stage(sent)) != self.rank:
                self.after[self._last_part(index)].append(Issue(send(sent)))
                self.finals.append(send(sent))
            got = received_message(op, S)
            if got is not None and rank_of(sending_stage(got)) != self.rank:
                consumers[got] = index
                self.before[self.first_part[index]].append(Wait(recv(got)))
        for src in range(schedule.num_ranks):
            if src != self.rank:
                self._post_receives(self.channels.get((src, self.rank), []), consumers)

    def _post_receives(self, messages: list, consumers: dict[object, int]) -> None:
        """Post each receive of a channel once the one :data:`RECEIVES_AHEAD` before it is waited for
        (the first ones at the start), at the latest one op ahead of its consumer, and never after
        a later-sent message's post (a channel is FIFO: the receiver posts in the sender's order).
        A receive posted early lets the transfer start as soon as the message is sent (gloo and
        NCCL move the bytes once both sides are posted); the look-ahead bounds the buffers posted."""
        posts = [max(consumers[key] - 1, 0) for key in messages]
        for k in range(RECEIVES_AHEAD, len(posts)):
            posts[k] = min(posts[k], consumers[messages[k - RECEIVES_AHEAD]])
        for k in range(min(RECEIVES_AHEAD, len(posts))):
            posts[k] = 0
        for k in range(len(posts) - 2, -1, -1):
            posts[k] = min(posts[k], posts[k + 1])
        for key, at in zip(messages, posts):
            slot = self.before[self.first_part[at]]
            waits = next((i for i, a in enumerate(slot) if isinstance(a, Wait)), len(slot))
            slot.insert(waits, Issue(recv(key)))  # posts go ahead of the slot's waits

    def _place_vocab(self) -> None:
        schedule = self.schedule
        root = schedule.placement.rank_of(schedule.num_stages - 1)
        program = schedule.programs[self.rank]
        waited: set[Comm] = set()
        for index, op in enumerate(program):
            j = op.microbatch
            broadcast, reduction = (
                Comm(kind, -1, 0, j) for kind in (CommKind.VOCAB_BROADCAST, CommKind.VOCAB_REDUCE)
            )
            if op.kind is Kind.F and op.stage == schedule.num_stages - 1:
                self.after[self._last_part(index)].append(Issue(broadcast))
            if op.kind is Kind.S:
                if self.rank != root:  # posted one op ahead, after earlier posts, ahead of the waits
                    at = self.first_part[max(index - 1, 0)]
                    self.before[at].insert(self._issue_slot(at), Issue(broadcast))
                self.before[self.first_part[index]].append(Wait(broadcast))
                self.after[self._last_part(index)].append(Issue(reduction))
            last_backward = op.computes_input_grad and op.stage == schedule.num_stages - 1
            if (op.kind is Kind.T or last_backward) and reduction not in waited:
                waited.add(reduction)  # the last stage's rank: before the first of T and the backward
                self.before[self.first_part[index]].append(Wait(reduction))

    def _place_experts(self) -> None:
        """Each F's and B's (BW's) all-to-all on the rank's ``ep`` link, issued after the op; its
        wait and the op's sends come at once after an unpaired op, after the other half of a pair
        (a pair's backward: after the next pair's forward, when one follows at once)."""
        program = self.schedule.programs[self.rank]
        starts = set(self.schedule.pair_starts()[self.rank])
        carried: list[Action] = []  # held back for after the next op's compute
        for index, op in enumerate(program):
            if not (op.kind is Kind.F or op.computes_input_grad):
                continue
            a2a = Comm(CommKind.ALL_TO_ALL, op.stage, 0 if op.kind is Kind.F else 1, op.microbatch)
            after = self.after[self._last_part(index)]
            sends = [a for a in after if isinstance(a, Issue) and a.comm.kind is CommKind.SEND]
            rest = [a for a in after if a not in sends]
            placed: list[Action] = [Issue(a2a), *carried]
            carried = []
            held: list[Action] = [Wait(a2a), *sends]
            if index in starts or (index - 1 in starts and index + 1 in starts):
                carried = held  # a pair's forward; a pair's backward with a pair next
            else:
                placed += held
            after[:] = placed + rest

    def _readers(self) -> dict[tuple[int, int], list[int]]:
        """Each unit ``(stage, part)`` of the rank: the indices of the parts that read it."""
        readers: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, part in enumerate(self.parts):
            if not part.op.is_vocab:
                readers[(part.op.stage, part.part)].append(i)
        return readers

    def _runs(self, readers: list[int]) -> list[list[int]]:
        """The readers cut where the unit is resharded: after a forward part (``reshard_after_forward``)
        or a gradient part (``reshard_after_backward``) whose unit is not read again within the
        prefetch's reach (an unshard issued right after the reshard would undo it); never before
        the last reader otherwise."""
        options = self.options
        bridged = options.prefetch + 1
        runs: list[list[int]] = [[readers[0]]]
        for previous, i in itertools.pairwise(readers):
            forward = self.parts[previous].op.kind is Kind.F
            policy = options.reshard_after_forward if forward else options.reshard_after_backward
            if policy and i - previous > bridged:
                runs.append([])
            runs[-1].append(i)
        return runs

    def _place_units(self) -> None:
        prefetch = self.options.prefetch
        for (stage, index), readers in sorted(self._readers().items(), key=lambda item: item[1][0]):
            earliest = 0
            for round_, run in enumerate(self._runs(readers)):
                unshard = Comm(CommKind.UNSHARD, stage, index, -1, round_)
                at = max(run[0] - prefetch, earliest)
                self.before[at].insert(self._issue_slot(at), Issue(unshard))
                self.before[run[0]].append(Wait(unshard))
                self.after[run[-1]].append(Issue(Comm(CommKind.RESHARD, stage, index, -1, round_)))
                earliest = run[-1] + 1

    def _issue_slot(self, at: int) -> int:
        """Where an unshard issued before part ``at`` goes: after the other unshard issues already
        there (they are read earlier), ahead of the waits."""
        slot = self.before[at]
        return next((i for i, a in enumerate(slot) if isinstance(a, Wait)), len(slot))

    def _place_reductions(self) -> None:
        kind = CommKind.REDUCE_SCATTER if self.mode == "fsdp" else CommKind.ALL_REDUCE
        last: dict[tuple[int, int], int] = {}
        for i, part in enumerate(self.parts):
            if part.op.computes_weight_grad:
                last[(part.op.stage, part.part)] = i
        for (stage, index), i in sorted(last.items(), key=lambda item: item[1]):
            reduction = Comm(kind, stage, index)
            if self.options.reduce_after_step:  # after the last compute, in the order they are ready
                self.before[len(self.parts)].append(Issue(reduction))
            else:  # after the op's send (the next rank waits for it), ahead of the unit's reshard
                slot = self.after[i]
                sends = sum(1 for a in slot if isinstance(a, Issue) and a.comm.kind is CommKind.SEND)
                slot.insert(sends, Issue(reduction))
            self.finals.append(reduction)


def compute_ops(program: tuple[Action, ...]) -> list[Op]:
    """The compute ops of a lowered program in order (each op once, however many parts it has)."""
    return [action.op for action in program if isinstance(action, Compute) and action.first]
