"""Point-to-point transfers between pipeline ranks.

Every ordered pair of ranks that exchanges tensors is a channel used in one direction (two groups
carry them all, one per direction of travel), so a channel is a FIFO: the receiver posts receives in
the sender's program order, which the schedule layer predicts
(:mod:`~zerobubble.schedule.channels`), so no tags are needed and an early receive never blocks the
other direction.  A message is the tuple of tensors crossing one stage boundary for
one microbatch (a :class:`~zerobubble.schedule.channels.MessageKey`).  The executor's program says
when (:mod:`.transfers`): :meth:`Comm.send`, :meth:`Comm.post`, :meth:`Comm.recv` and
:meth:`Comm.wait_send` are the work of the lowered ``issue``/``wait`` of each send and receive.  The
first step sends shape headers; afterwards shapes are cached and a receive is posted where the
lowering issues it, so the transfer overlaps compute.
Every wait goes through a :class:`~..failures.PeerMonitor`: it ends at completion, at a peer's error
notice or at the timeout — never a hang.

Headers, look-ahead and forward-only steps: ``docs/runtime.md``.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from ...schedule.channels import GRADIENTS, MessageKey, channel_messages, delivered_before, directed_pairs
from ...schedule.ir import Schedule
from .. import PipelineError
from ..failures import PeerMonitor
from ..observe import ranges
from ..observe.recorder import Recorder
from ..parallel.groups import local_group

logger = logging.getLogger(__name__)

_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}
HEADER_LENGTH = 64
_SETUP_TIMEOUT = 120.0  # connecting a channel may wait for a peer still finishing other work

TensorSpec = tuple[tuple[int, ...], torch.dtype]


def encode_header(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The header of a message: ``[count, (dtype code, ndim, *shape) per tensor]``, zero-padded."""
    header = [len(tensors)]
    for tensor in tensors:
        if tensor.dtype not in _DTYPE_CODE:
            raise PipelineError(f"cannot send a tensor of dtype {tensor.dtype} between stages")
        header += [_DTYPE_CODE[tensor.dtype], tensor.dim(), *tensor.shape]
    if len(header) > HEADER_LENGTH:
        raise PipelineError(
            f"a stage passes {len(tensors)} tensors with {len(header)} header entries in all; "
            f"at most {HEADER_LENGTH} fit — pass fewer or lower-dimensional tensors"
        )
    return header + [0] * (HEADER_LENGTH - len(header))


def decode_header(header: Sequence[int]) -> list[TensorSpec]:
    """Inverse of :func:`encode_header`."""
    specs, position = [], 1
    for _ in range(header[0]):
        dtype, ndim = _DTYPES[header[position]], header[position + 1]
        specs.append((tuple(header[position + 2 : position + 2 + ndim]), dtype))
        position += 2 + ndim
    return specs


class _Pending:
    """One message whose receive is posted: its works and the buffers they fill."""

    __slots__ = ("tensors", "works")

    def __init__(self, works: list, tensors: list[torch.Tensor]):
        self.works = works
        self.tensors = tensors


class Comm:
    """The point-to-point channels of one rank for one schedule.

    ``group`` is the pipeline's process group (its rank ``i`` runs ``schedule.programs[i]``).
    Creating a Comm is collective over ``group``: each of its ranks creates one for the same
    schedule, in the same order as its other groups (:mod:`..parallel.groups`).  ``monitor`` carries every
    wait (deadline and peers' error notices).
    """

    def __init__(
        self,
        schedule: Schedule,
        group: dist.ProcessGroup | None,
        device: torch.device,
        timeout: float,
        static_shapes: bool = True,
        monitor: PeerMonitor | None = None,
    ):
        self.rank = dist.get_rank(group)
        self.monitor = monitor or PeerMonitor(None, self.rank, timeout)  # no notices: deadlines only
        self.device = device
        self.timeout = timeout
        self.static_shapes = static_shapes
        self.recorder: Recorder | None = None
        self._groups = self._connect(directed_pairs(schedule), group)
        self._handshake(sorted(self._groups))
        self._incoming = {
            src: channel_messages(schedule, src, self.rank) for src, dst in self._groups if dst == self.rank
        }
        logger.debug(
            "rank %d: channels to %s and from %s connected (%d messages in per step)",
            self.rank,
            sorted(dst for src, dst in self._groups if src == self.rank),
            sorted(self._incoming),
            sum(len(keys) for keys in self._incoming.values()),
        )
        self._source = {key: src for src, keys in self._incoming.items() for key in keys}
        # per incoming message: its place on its channel and the sends its arrival proves delivered
        self._position = {key: i for keys in self._incoming.values() for i, key in enumerate(keys)}
        self._proves: dict[MessageKey, list[MessageKey]] = {}
        for src in self._incoming:
            self._proves.update(delivered_before(schedule, self.rank, src))
        self._proven: dict[int, int] = {}  # per source: how many of its messages' proofs were used
        self._shapes: dict[tuple[int, int], list[TensorSpec]] = {}  # (direction, boundary) -> specs
        self._queues: dict[int, deque[MessageKey]] = {}
        self._posted: dict[MessageKey, _Pending] = {}
        self._sends: dict[MessageKey, tuple[list, tuple[torch.Tensor, ...]]] = {}  # in sending order
        # the sends are posted by an overlapped pair's forward half, on a worker thread, while the
        # backward half's receives release them (execute/pairs.py, ThreadedOverlap)
        self._sends_lock = threading.Lock()
        self._headers = True
        self._keep_shapes = True  # False in forward-only steps: evaluation shapes are not cached
        self._profiling = False  # a torch profiler records this step: transfers get ranges (.ranges)

    def _connect(
        self, pairs: list[tuple[int, int]], group
    ) -> dict[tuple[int, int], tuple[dist.ProcessGroup, int]]:
        """This rank's channels as ``(src, dst) -> (group, global peer)``.

        Two groups over the pipeline's ranks carry every channel: one the transfers to a higher rank,
        one those to a lower rank.  So a group holds at most one channel per rank pair, each a FIFO
        in one direction, and a posted receive never holds up a send the other way (NCCL runs a
        pair's transfers in one stream per communicator).  Both are created by the pipeline's ranks
        only, every rank creating both (:mod:`..parallel.groups`).  NCCL enforces the pipeline timeout
        through its watchdog; gloo gets a longer one for connecting (a peer may still be busy) and
        each wait carries the pipeline timeout.
        """
        if not pairs:
            return {}
        nccl = dist.get_backend(group) == "nccl"
        setup = timedelta(seconds=self.timeout if nccl else max(self.timeout, _SETUP_TIMEOUT))
        ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
        upward = local_group(ranks, timeout=setup)
        downward = local_group(ranks, timeout=setup)
        to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        return {
            (src, dst): (upward if dst > src else downward, to_global(dst if self.rank == src else src))
            for src, dst in pairs
            if self.rank in (src, dst)
        }

    def _handshake(self, pairs: list[tuple[int, int]]) -> None:
        """Exchange one tiny message per channel, pair by pair in one global order.

        This connects every channel up front (NCCL creates point-to-point communicators lazily and
        blockingly, which could otherwise interlock two ranks' first sends) and proves each peer is
        alive before the first step.  A fixed global order of pairwise exchanges cannot deadlock.
        """
        token = torch.zeros(1, device=self.device)
        for src, dst in pairs:
            if self.rank not in (src, dst):
                continue
            group, peer = self._groups[(src, dst)]
            operation = dist.isend if self.rank == src else dist.irecv
            try:
                work = operation(token, peer, group=group)
            except RuntimeError as error:
                raise self._failure(f"connecting to rank {peer}", error) from error
            self._wait(work, f"rank {peer} to connect")

    # -- one step ------------------------------------------------------------------------------

    def start_step(self, first: bool, forward_only: bool = False) -> None:
        """Prepare the channels for a step.

        A ``forward_only`` step (evaluation) carries only the activations, each with its header,
        and does not touch the shapes cached for training.
        """
        self._headers = first or not self.static_shapes or forward_only
        self._keep_shapes = not forward_only
        self._profiling = ranges.profiling()
        self._queues = {
            src: deque(key for key in keys if not (forward_only and key.direction == GRADIENTS))
            for src, keys in self._incoming.items()
        }
        self._posted.clear()
        self._proven = dict.fromkeys(self._incoming, 0)

    def finish_step(self) -> None:
        """Wait until every send of the step has left; check every message was received."""
        if self._profiling:
            with record_function(ranges.WAIT_SENDS):
                self._wait_sends()
        else:
            self._wait_sends()
        unread = [key for queue in self._queues.values() for key in queue] + list(self._posted)
        if unread:
            raise PipelineError(f"rank {self.rank}: messages {unread[:4]} were never consumed this step")

    def wait_send(self, key: MessageKey) -> None:
        """Wait until the send of message ``key`` is over (at once when it was already released)."""
        with self._sends_lock:
            entry = self._sends.pop(key, None)
        if entry is not None:
            for work in entry[0]:
                self._wait(work, "a send to finish")

    def _wait_sends(self) -> None:
        with self._sends_lock:
            sends = list(self._sends.values())
            self._sends.clear()
        for works, _ in sends:
            for work in works:
                self._wait(work, "a send to finish")

    def abort_step(self) -> None:
        """Forget the step's state after a failure (the pipeline is unusable afterwards)."""
        self._sends.clear()
        self._posted.clear()
        self._queues.clear()

    # -- sending ---------------------------------------------------------------------------------

    def send(self, key: MessageKey, dst: int, tensors: tuple[torch.Tensor, ...]) -> None:
        """Post the transfer of ``tensors`` (message ``key``) to rank ``dst``; returns at once."""
        if self._profiling:
            with record_function(ranges.send_range(key)):
                self._send(key, dst, tensors)
        else:
            self._send(key, dst, tensors)

    def _send(self, key: MessageKey, dst: int, tensors: tuple[torch.Tensor, ...]) -> None:
        group, peer = self._groups[(self.rank, dst)]
        tensors = tuple(t.contiguous() for t in tensors)
        if self._headers:
            if self._keep_shapes:
                self._shapes[key.direction, key.boundary] = [(tuple(t.shape), t.dtype) for t in tensors]
            header = torch.tensor(encode_header(tensors), dtype=torch.int64, device=self.device)
            tensors = (header, *tensors)
        else:
            self._check_shapes(key, tensors)
        try:
            works = [dist.isend(t, peer, group=group) for t in tensors]
        except RuntimeError as error:
            raise self._failure(f"sending message {key} to rank {dst}", error) from error
        with self._sends_lock:
            self._release_sent()
            self._sends[key] = (works, tensors)

    def _release_sent(self) -> None:
        """Drop the oldest sends whose works report completion (NCCL's do; gloo's only after a wait)."""
        sends = self._sends
        while sends:
            oldest = next(iter(sends))
            if not all(work.is_completed() for work in sends[oldest][0]):
                break
            del sends[oldest]

    def _release_delivered(self, src: int, key: MessageKey) -> None:
        """Wait for (and drop) the sends that message ``key`` of ``src``, just received, proves
        delivered: those ``src`` received before sending it or any earlier message of its channel
        (:func:`~zerobubble.schedule.channels.delivered_before`).  Their waits return at once, and
        the sent tensors, often the only reference left (a B's input gradient), are freed now rather
        than at the end of the step."""
        messages, done, upto = self._incoming[src], self._proven[src], self._position[key] + 1
        if upto <= done:
            return
        self._proven[src] = upto
        with self._sends_lock:
            proven = [
                self._sends.pop(sent, None) for a in messages[done:upto] for sent in self._proves.get(a, ())
            ]
        for entry in proven:
            if entry is not None:
                for work in entry[0]:
                    self._wait(work, "a delivered send to finish")

    def _check_shapes(self, key: MessageKey, tensors: tuple[torch.Tensor, ...]) -> None:
        expected = self._shapes.get((key.direction, key.boundary))
        actual = [(tuple(t.shape), t.dtype) for t in tensors]
        if expected != actual:
            s, j = key.boundary, key.microbatch
            what = "activations" if key.direction != GRADIENTS else "input gradients"
            raise PipelineError(
                f"the {what} passed between stages {s} and {s + 1} (microbatch {j}) changed from "
                f"{_describe(expected)} on the first step to {_describe(actual)}; the pipeline caches "
                "shapes after the first step — keep batch shapes fixed or pass static_shapes=False"
            )

    # -- receiving -------------------------------------------------------------------------------

    def post(self, key: MessageKey) -> None:
        """Post the receive of message ``key`` (and of any earlier message of its channel not yet
        posted: a channel is FIFO); returns at once.  A step with shape headers posts nothing here:
        a message's header must arrive before its buffers can be made, so its receive is posted,
        header first, when it is waited for (:meth:`recv`) — never blocking ahead of the consumer.
        """
        if not self._headers:
            self._post_through(key, self._source[key])

    def recv(self, key: MessageKey) -> tuple[torch.Tensor, ...]:
        """The tensors of message ``key``, waiting for them if needed (up to the timeout)."""
        if self._profiling:
            with record_function(ranges.recv_range(key)):
                return self._recv(key)
        return self._recv(key)

    def _recv(self, key: MessageKey) -> tuple[torch.Tensor, ...]:
        src = self._source[key]
        self._post_through(key, src)
        pending = self._posted.pop(key)
        recorder = self.recorder
        if recorder is None:
            for work in pending.works:
                self._wait(work, lambda: _describe_key(key, src))
        else:
            clock = recorder.clock
            started = clock()
            for work in pending.works:
                self._wait(work, lambda: _describe_key(key, src))
            recorder.wait(key, started, clock())
        self._release_delivered(src, key)
        return tuple(pending.tensors)

    def _post_through(self, key: MessageKey, src: int) -> None:
        """Post the receives of ``src``'s channel up to message ``key`` (none when it is posted)."""
        while key not in self._posted:
            if not self._queues[src]:
                raise PipelineError(f"rank {self.rank}: message {key} from rank {src} was already consumed")
            self._post_next(src)

    def _post_next(self, src: int) -> None:
        """Post the receive of the next message of ``src``'s channel (its queue is not empty)."""
        group, peer = self._groups[(src, self.rank)]
        key = self._queues[src].popleft()
        if self._headers:
            specs = self._receive_header(key, src, group, peer)
        else:
            specs = self._shapes[key.direction, key.boundary]
        buffers = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in specs]
        try:
            works = [dist.irecv(b, peer, group=group) for b in buffers]
        except RuntimeError as error:
            raise self._failure(f"posting the receive of {_describe_key(key, src)}", error) from error
        self._posted[key] = _Pending(works, buffers)

    def _receive_header(self, key: MessageKey, src: int, group, peer: int) -> list[TensorSpec]:
        header = torch.empty(HEADER_LENGTH, dtype=torch.int64, device=self.device)
        what = _describe_key(key, src) + " (its shape header)"
        try:
            work = dist.irecv(header, peer, group=group)
        except RuntimeError as error:
            raise self._failure(f"posting the receive of {what}", error) from error
        self._wait(work, what)
        specs = decode_header(header.tolist())
        if self._keep_shapes:
            self._shapes[key.direction, key.boundary] = specs
        return specs

    def _wait(self, work, what: str | Callable[[], str]) -> None:
        """Wait for ``work`` (see :class:`~..failures.PeerMonitor`); ``what`` names it in the error."""
        self.monitor.wait(work, what)

    def _failure(self, what: str, error: Exception) -> PipelineError:
        self.monitor.explain()  # a peer's error notice says more than a closed channel
        return PipelineError(
            f"rank {self.rank}: {what} failed (timeout {self.timeout:g} s) — "
            f"a peer rank probably died or stopped with an error ({type(error).__name__}: {error})"
        )


def _describe(specs: list[TensorSpec] | None) -> str:
    if specs is None:
        return "nothing"
    return ", ".join(f"{list(shape)} {str(dtype).replace('torch.', '')}" for shape, dtype in specs)


def _describe_key(key: MessageKey, src: int) -> str:
    s, j = key.boundary, key.microbatch
    if key.direction != GRADIENTS:
        return f"the activations of stage {s} for stage {s + 1} (microbatch {j}) from rank {src}"
    return f"the input gradient of stage {s + 1} for stage {s} (microbatch {j}) from rank {src}"
