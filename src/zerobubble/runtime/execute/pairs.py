"""Overlapped F&B pairs (DualPipe's F&B) as single entries of an executor's program.

A schedule's :attr:`~zerobubble.schedule.Schedule.overlapped` pairs are an F and a B (or BW) of
other microbatches, adjacent in one rank's program, that the schedule starts together.  The compiled
program folds each pair into one :class:`OverlappedPair` entry: the F op's entry, the lowered
actions between the two ops, and the B op's entry.  Those actions are split by who needs them: the
forward's sends (and its units' reshards) follow the forward, everything else — the backward's
receive waits, receive posts, unshards — precedes the backward.  By default the pair runs the
forward, its sends (posted, so they are in flight while the backward computes) and then the
backward, whose input was posted ahead and arrives while the forward computes: the lowered order.

A user's own overlap is a hook ``overlap(pair)`` (``Pipeline(overlap=...)``) that runs both halves
(:class:`PairHalf`) itself, in any order or phase by phase; its contract is ``docs/runtime.md``,
"Overlapped F&B pairs".  ``overlap="threads"`` is the built-in one, :class:`ThreadedOverlap`: the
forward half on a worker thread while the backward half runs on the caller's.  A recorder sees
both halves as ops (in program order, each its own interval) and the pair as an event; under a
torch profiler a half run whole is in its op range.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.autograd.profiler import record_function

from ...schedule.ir import Kind, Op
from ...schedule.lowering import CommKind, Issue
from .. import PipelineError
from ..observe import ranges
from .program import CommAction, Hook, ProgramEntry

OverlapHook = Callable[["OverlappedPair"], None]
"""``overlap(pair)``: runs both halves of ``pair`` (:attr:`OverlappedPair.forward`,
:attr:`OverlappedPair.backward`), each exactly once, in any order or phase by phase."""

_FORWARD_TAIL = (CommKind.SEND, CommKind.RESHARD)  # an Issue of these between the halves is F's


class PairHalf:
    """One half of an overlapped pair: :attr:`op` (an F, or a B/BW), run whole by calling it, or
    phase by phase: :meth:`receive` (its inputs; the backward's waits for its input gradient),
    :meth:`compute` (the stage's forward or backward), :meth:`send` (its outputs left for the next
    stage; the forward's transfers posted).  Each phase runs once, in that order."""

    __slots__ = ("_clock", "_entry", "_phase", "_pieces", "_surround", "_value", "op", "span")

    def __init__(self, entry: ProgramEntry, surround: Sequence[ProgramEntry], pieces: tuple, forward: bool):
        self.op: Op = entry[0]  # type: ignore[assignment]
        self._entry = entry
        self._surround = (tuple(surround), forward)  # the lowered actions: after F, before B
        self._pieces = pieces  # (receive, compute, send[, checks]) of the executor, on (state, j[, value])
        self._phase = 0
        self._value: Any = None
        self._clock: Callable[[], Any] | None = None  # the recorder's, while one records
        self.span: list[Any] = [None, None]  # when it started and ended, on that clock

    def __call__(self) -> None:
        """Run the whole half through its op's handler (emulation's, when it is on)."""
        self._begin("run")
        _, handler, state, j = self._entry
        _in_op_range(self.op, handler, state, j)
        self._finish()

    def receive(self) -> None:
        """Take the half's inputs: the forward's from the mailbox, the backward's after the waits
        for its input gradient (the lowered actions before the backward)."""
        self._begin("receive")
        _, _, state, j = self._entry
        self._value, self._phase = self._pieces[0](state, j), 1

    def compute(self) -> None:
        """Compute the half (after :meth:`receive`): the stage's forward, or its backward."""
        self._enter(1, "compute")
        _, _, state, j = self._entry
        self._value, self._phase = self._pieces[1](state, j, self._value), 2

    def send(self) -> None:
        """Leave the half's outputs for the next stage (after :meth:`compute`); the forward's
        transfers are posted at once, the backward's by the send entry after the pair."""
        self._enter(2, "send")
        _, _, state, j = self._entry
        self._pieces[2](state, j, self._value)
        self._value = None
        self._finish()

    def checking(self) -> bool:
        """Whether the forward (after :meth:`receive`) runs its stage's split-guard check (a path
        not yet verified): plain and split passes, their backwards included, inside it."""
        _, _, state, j = self._entry
        return len(self._pieces) > 3 and self._pieces[3](state, j, self._value)

    @property
    def done(self) -> bool:
        """Whether the half has run to its end."""
        return self._phase == 3

    def _begin(self, what: str) -> None:
        """The half's start: timed, and the backward's lowered actions (its waits) run first."""
        self._enter(0, what)
        self._mark(0)
        entries, forward = self._surround
        if not forward:
            _run(entries)

    def _finish(self) -> None:
        """The half's end: the forward's lowered actions (its sends) run last, then it is done."""
        entries, forward = self._surround
        if forward:
            _run(entries)
        self._phase = 3
        self._mark(1)

    def _enter(self, phase: int, what: str) -> None:
        if self._phase != phase:
            names = ("receive", "compute", "send", "done")
            raise PipelineError(
                f"overlapped pair half {self.op}: {what}() called after {names[self._phase - 1]}"
                if self._phase
                else f"overlapped pair half {self.op}: {what}() called before receive()"
            )

    def reset(self, clock: Callable[[], Any] | None) -> None:
        """Ready for the next step; ``clock`` times the half (None: untimed)."""
        self._phase, self._value, self._clock = 0, None, clock

    def _mark(self, end: int) -> None:
        if self._clock is not None:
            self.span[end] = self._clock()


class OverlappedPair(Hook):
    """The program entry of one overlapped F&B pair: :attr:`forward` and :attr:`backward` (each a
    :class:`PairHalf`), run in program order or by the executor's ``overlap`` hook (module docstring).
    A recorder sees it as an event named ``overlapped pair F…&B…``, and its halves as ops."""

    __slots__ = ("_context", "backward", "entries", "forward")

    def __init__(
        self,
        forward: PairHalf,
        backward: PairHalf,
        entries: tuple[ProgramEntry, ...],
        context: Callable[[], tuple[OverlapHook | None, Any]],
    ):
        super().__init__(f"overlapped pair {forward.op}&{backward.op}", self._run_pair)
        self.forward, self.backward = forward, backward
        self.entries = entries  # the folded entries, in the lowered order (a forward-only step's)
        self._context = context  # () -> (the overlap hook, the recorder), read when the pair runs

    def _run_pair(self) -> None:
        forward, backward = self.forward, self.backward
        hook, recorder = self._context()
        clock = recorder.clock if recorder is not None else None
        forward.reset(clock)
        backward.reset(clock)
        if hook is None:
            forward()
            backward()
        else:
            hook(self)
            missing = [str(half.op) for half in (forward, backward) if not half.done]
            if missing:
                raise PipelineError(
                    f"the overlap hook returned without running {' and '.join(missing)} of the "
                    f"{self.name} to its end: call pair.forward() and pair.backward() (or each one's "
                    "receive(), compute() and send()) once each"
                )
        if recorder is not None:  # the halves in program order, each with its own interval
            for half in (forward, backward):
                recorder.op(half.op, half.span[0], half.span[1])


class ThreadedOverlap:
    """The overlap hook ``overlap="threads"``: each pair's forward half on one worker thread (made
    once, at the first pair) while its backward half runs on the calling thread, so that one half's
    collectives are in flight while the other computes (torch's kernels and gloo's waits release the
    GIL).  Exact because each half's transfers keep their channels' order (the forward's sends are
    its own; the backward's waits and posts are on other channels) and its expert all-to-alls go over
    their own group (forward's, backward's): ``docs/runtime.md``, "Overlapped F&B pairs"."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def __call__(self, pair: OverlappedPair) -> None:
        half = pair.forward
        half.receive()  # from the mailbox: its waits ran before the pair
        # one stage's W store serves one op at a time; the split guard's check of a new path runs
        # plain and split backwards (the backward group's collectives) inside the forward
        if half.op.stage == pair.backward.op.stage or half.checking():
            half.compute()
            half.send()
            pair.backward()
            return
        grad_mode = torch.is_grad_enabled()  # thread-local: the worker takes the caller's
        forward = self._worker().submit(_compute_and_send, half, grad_mode)
        try:
            pair.backward()
        except BaseException:
            _settle(forward)  # the forward's own failure, if any, is the later one: the caller's first
            raise
        forward.result()  # the forward's failure, raised on the caller

    def _worker(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerobubble-pair")
            return self._pool


def overlap_hook(overlap: OverlapHook | str | None) -> OverlapHook | None:
    """The hook that ``Pipeline(overlap=...)`` asks for: a callable as it is, ``"threads"`` a new
    :class:`ThreadedOverlap`, None the sequential run."""
    check_overlap(overlap)
    return ThreadedOverlap() if overlap == "threads" else overlap  # type: ignore[return-value]


def check_overlap(overlap: Any) -> None:
    """Refuse an ``overlap=`` that is not None, ``"threads"`` or a callable."""
    if overlap is None or overlap == "threads" or callable(overlap):
        return
    raise PipelineError(
        f'overlap={overlap!r}: pass None (the pair\'s halves one after the other), "threads" (the '
        "forward half on a worker thread) or a callable overlap(pair) running both halves"
    )


def check_threaded_grid(overlap: Any, grid: Any, vocab_parallel: bool = False) -> None:
    """Refuse ``overlap="threads"`` on a grid whose stages run collectives of their own in both
    halves over one group (tensor parallelism, FSDP), or with a vocabulary-parallel head (the
    embedding's forward and the last stage's backward both use its groups): their order would
    differ between ranks."""
    if overlap == "threads" and vocab_parallel:
        raise PipelineError(
            'overlap="threads" runs a pair\'s halves on two threads, but with a vocabulary-parallel head '
            "both halves may post the vocabulary's collectives (the embedding's in a forward, the "
            "head's in the last stage's backward), in an order that would differ between ranks: drop "
            'overlap="threads" (the halves then run one after the other)'
        )
    if overlap != "threads" or (grid.tp == 1 and grid.sharding is None):
        return
    raise PipelineError(
        f'overlap="threads" runs a pair\'s halves on two threads, but on this grid ({grid.describe()}) '
        "both halves post collectives over one group (tensor-parallel or FSDP), in an order that would "
        'differ between ranks: drop overlap="threads" (the halves then run one after the other) or '
        "keep only the pipeline, replicated data-parallel and ep dimensions"
    )


def _compute_and_send(half: PairHalf, grad_mode: bool) -> None:
    with torch.set_grad_enabled(grad_mode):
        half.compute()
        half.send()


def _settle(future: Future) -> None:
    """Wait for ``future`` (each half's collectives end, at the latest at their timeout)."""
    with contextlib.suppress(BaseException):  # the caller is raising its own error
        future.result()


def fold_pairs(program: list[ProgramEntry], executor: Any) -> list[ProgramEntry]:
    """``program`` (``executor``'s, compiled) with the entries from each pair's F op to its B op
    folded into one :class:`OverlappedPair` entry, run with ``executor``'s pieces of a handler and
    its ``overlap`` hook and recorder of the moment."""
    schedule, rank = executor.schedule, executor.rank
    forwards = {schedule.programs[rank][i] for i in schedule.pair_starts()[rank]}
    if not forwards:
        return program

    def context() -> tuple[OverlapHook | None, Any]:
        return executor.overlap, executor.recorder

    def checks(state: Any, j: int, inputs: tuple) -> bool:
        guard = state.guard
        if guard is None or not executor._keep:
            return False
        kwargs = executor._kwargs[j] if executor._kwargs else {}
        return guard.signature(inputs, kwargs) not in guard.verified

    def pieces(op: Op) -> tuple:
        """The (receive, compute, send[, split-guard check ahead]) pieces of ``op``'s handler."""
        if op.kind is Kind.F:
            return executor.receive_forward, executor.compute_forward, executor.send_forward, checks
        defer = op.kind is Kind.B
        compute = executor.compute_backward
        return (
            executor.receive_backward,
            lambda s, j, grads: compute(s, j, grads, defer),
            executor.send_backward,
        )

    folded: list[ProgramEntry] = []
    i = 0
    while i < len(program):
        entry = program[i]
        if not (isinstance(entry[0], Op) and entry[0] in forwards):
            folded.append(entry)
            i += 1
            continue
        end = next(k for k in range(i + 1, len(program)) if isinstance(program[k][0], Op))
        folded.append(_pair_entry(program[i : end + 1], pieces, context))
        i = end + 1
    return folded


def _pair_entry(
    span: list[ProgramEntry], pieces: Callable[[Op], tuple], context: Callable[[], tuple[Any, Any]]
) -> ProgramEntry:
    between = span[1:-1]
    tail = [e for e in between if isinstance(e[0], CommAction) and _forward_action(e[0])]
    head = [e for e in between if not (isinstance(e[0], CommAction) and _forward_action(e[0]))]
    first, last = span[0][0], span[-1][0]
    assert isinstance(first, Op) and isinstance(last, Op)
    forward = PairHalf(span[0], tail, pieces(first), forward=True)
    backward = PairHalf(span[-1], head, pieces(last), forward=False)
    pair = OverlappedPair(forward, backward, tuple(span), context)
    return (pair, pair.run, None, 0)


def _forward_action(action: CommAction) -> bool:
    lowered = action.lowered
    return isinstance(lowered, Issue) and lowered.comm.kind in _FORWARD_TAIL


def expand_pairs(program: Sequence[ProgramEntry]) -> list[ProgramEntry]:
    """``program`` with each pair entry replaced by the entries it folded, in the lowered order."""
    expanded: list[ProgramEntry] = []
    for entry in program:
        expanded += entry[0].entries if isinstance(entry[0], OverlappedPair) else (entry,)
    return expanded


def _run(entries: Sequence[ProgramEntry]) -> None:
    for _, handler, state, j in entries:
        handler(state, j)


def _in_op_range(op: Op, handler: Callable[[Any, int], None], state: Any, j: int) -> None:
    if ranges.profiling():
        with record_function(ranges.op_range(op)):
            handler(state, j)
    else:
        handler(state, j)
