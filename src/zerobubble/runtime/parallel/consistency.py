"""What the ranks of one Pipeline must agree on, at construction and at every call; tied parameters.

Every rank builds the Pipeline from its own copy of the layer list.  Before any channel is created
the ranks exchange a *fingerprint* — layer types, parameter names/shapes/dtypes, the schedule (name,
microbatches, stages, a digest of the programs), the cut points, the data-parallel degree and the
tied parameters — and every rank raises the same :class:`~zerobubble.runtime.PipelineError` naming
the first rank and item that differ from rank 0.  A rank that could not even build its part (a bad
argument) sends its error instead, so the others say which rank failed and why instead of waiting.

Every call: before a :meth:`~zerobubble.runtime.Pipeline.step` or ``evaluate`` sends its first
message, the ranks of the whole Pipeline (every data-parallel replica too) compare what they were
called with — the method, the loss scale, the shapes and dtypes of the inputs and of the targets —
and whether the call failed its local checks (:class:`CallCheck`: one max-reduce of ten int64
by point-to-point transfers on a gloo group of its own).  A difference or a rank's
argument error makes every rank raise the same :class:`~zerobubble.runtime.PipelineError` before any
transfer, and the Pipeline stays usable.

Tied parameters: a Parameter object used by two layers (an embedding reused by the LM head) is
detected here.  When the two layers land on different ranks each rank holds its own copy; the
Pipeline keeps them tied as Megatron keeps its embedding group: the copies start equal (broadcast
from the holder of the first layer) and their gradients are summed over the holders after every
step, so each copy takes the same optimizer step.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...schedule.ir import Schedule
from ...schedule.sharding import ONCE_PER_STEP
from .. import PipelineError
from ..tensors import local_value


def find_ties(named: Sequence[tuple[str, nn.Module]]) -> list[list[tuple[int, str]]]:
    """Parameters shared by two or more layers: per tie, ``(layer index, qualified name)`` in model order.

    The first entry is the tie's canonical name (the one a checkpoint without the aliases is read from).
    """
    users: dict[int, list[tuple[int, str]]] = {}
    for index, (layer_name, layer) in enumerate(named):
        for name, param in layer.named_parameters(remove_duplicate=False):
            users.setdefault(id(param), []).append((index, f"{layer_name}.{name}"))
    return [uses for uses in users.values() if len({index for index, _ in uses}) > 1]


def fingerprint(
    named: Sequence[tuple[str, nn.Module]],
    schedule: Schedule,
    bounds: Sequence[int],
    data_parallel: int,
    ties: Sequence[Sequence[tuple[int, str]]],
    *,
    check_calls: bool = True,
    sharding: str | None = None,
    fsdp: Any = None,
) -> dict[str, Any]:
    """The items every rank must agree on, in the order they are compared."""
    programs = hashlib.blake2b(repr(schedule.programs).encode(), digest_size=8).hexdigest()
    return {
        "number of layers": len(named),
        "layer types": [type(layer).__name__ for _, layer in named],
        "parameters": [
            (f"{layer_name}.{name}", tuple(p.shape), str(p.dtype).replace("torch.", ""))
            for layer_name, layer in named
            for name, p in layer.named_parameters()
        ],
        "tied parameters": [[name for _, name in tie] for tie in ties],
        "schedule": schedule.name,
        "microbatches": schedule.microbatches,
        "stages": schedule.num_stages,
        "layer cuts": list(bounds),
        "schedule programs": programs,
        "data_parallel": data_parallel,
        "sharding": sharding,
        # FSDP's units or the replicas' all-reduce buckets: every rank lowers the same program
        "fsdp": repr(ONCE_PER_STEP if fsdp is None else fsdp),
        "check_calls": check_calls,
    }


@dataclass(frozen=True)
class Agreement:
    """What the exchange settled: a key naming this Pipeline in the shared store, the RNG seed."""

    key: str
    seed: int


def agree(mine: dict[str, Any] | None, problem: str | None, seed: int | None, group: Any) -> Agreement:
    """Exchange fingerprints over ``group`` (collective); raise unless every rank matches rank 0.

    ``problem`` is this rank's construction error (then ``mine`` is None); ``seed`` the user's
    seed or None for rank 0's ``torch.initial_seed()``.
    """
    entry = {
        "fingerprint": mine,
        "problem": problem,
        "nonce": os.urandom(8).hex(),
        "seed": torch.initial_seed() if seed is None else seed,
    }
    entries: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(entries, entry, group=group)
    failed = [(rank, e["problem"]) for rank, e in enumerate(entries) if e["problem"] is not None]
    if failed and problem is None:
        rank, message = failed[0]
        raise PipelineError(f"rank {rank} could not build its part of the pipeline: {message}")
    if problem is None:
        _compare([e["fingerprint"] for e in entries])
    return Agreement(key=entries[0]["nonce"], seed=int(entries[0]["seed"]))


def _compare(prints: list[dict[str, Any]]) -> None:
    reference = prints[0]
    for rank, other in enumerate(prints[1:], start=1):
        for item, expected in reference.items():
            actual = other[item]
            if actual != expected:
                raise PipelineError(
                    f"rank {rank} differs from rank 0 in its {item}: {_difference(expected, actual)}; "
                    "every rank must build the Pipeline from the same layers and arguments"
                )


def _difference(expected: Any, actual: Any) -> str:
    if isinstance(expected, list) and isinstance(actual, list):
        for position, (a, b) in enumerate(zip(expected, actual)):
            if a != b:
                return f"entry {position} is {b!r} there but {a!r} on rank 0"
        return f"{len(actual)} entries there but {len(expected)} on rank 0"
    return f"{actual!r} there but {expected!r} on rank 0"


class TiedParameter:
    """One parameter shared by layers on different ranks of this pipeline, held by this rank.

    ``param`` is this rank's copy; ``holders`` the global ranks holding a copy (sorted),
    ``source`` the one holding the tie's first layer; ``group`` a group of this replica spanning
    them (the layout's ties group) and ``tag`` this tie's tag on it.  The copies exchange point to
    point, so no group of just the holders is needed (:mod:`.groups`).
    """

    def __init__(
        self, name: str, param: nn.Parameter, group: Any, holders: Sequence[int], source: int, tag: int
    ):
        self.name = name
        self.param = param
        self.group = group
        self.holders = tuple(sorted(holders))
        self.source = source
        self.tag = tag

    @torch.no_grad()
    def broadcast_value(self, wait: Callable[[Any, str], None]) -> None:
        """Make this copy equal to the first holder's (collective over the holders)."""
        me = dist.get_rank()
        if me == self.source:
            peers = [rank for rank in self.holders if rank != me]
            ops = [dist.P2POp(dist.isend, self.param.data, peer, self.group, self.tag) for peer in peers]
        else:
            ops = [dist.P2POp(dist.irecv, self.param.data, self.source, self.group, self.tag)]
        for work in dist.batch_isend_irecv(ops):
            wait(work, f"the value of the tied parameter {self.name}")

    @torch.no_grad()
    def sum_gradients(self, wait: Callable[[Any, str], None]) -> None:
        """Sum the holders' gradients (collective over the holders), in holder order on every holder
        so that the copies stay bitwise equal; ``wait`` waits for each transfer."""
        if self.param.grad is None:
            self.param.grad = torch.zeros_like(self.param)
        me, grad = dist.get_rank(), self.param.grad
        received = {rank: torch.empty_like(grad) for rank in self.holders if rank != me}
        ops = [dist.P2POp(dist.isend, grad, rank, self.group, self.tag) for rank in received]
        ops += [
            dist.P2POp(dist.irecv, buffer, rank, self.group, self.tag) for rank, buffer in received.items()
        ]
        for work in dist.batch_isend_irecv(ops):
            wait(work, f"the gradient sum of the tied parameter {self.name}")
        parts = [grad if rank == me else received[rank] for rank in self.holders]
        total = parts[0].clone()
        for part in parts[1:]:
            total.add_(part)
        grad.copy_(total)


def broadcast_replicas(
    module: nn.Module, group: Any, source: int, *, skip: Sequence[torch.Tensor] = ()
) -> None:
    """Copy replica 0's parameters and buffers to the other data-parallel replicas (as DDP does);
    of a DTensor (tensor parallelism), its shard, which each replica holds at the same coordinates.
    ``skip``: parameters the replicas do not share (expert parallelism's experts)."""
    skipped = {id(tensor) for tensor in skip}
    with torch.no_grad():
        works = [
            dist.broadcast(local_value(tensor), src=source, group=group, async_op=True)
            for tensor in [*module.parameters(), *module.buffers()]
            if id(tensor) not in skipped
        ]
        for work in works:
            work.wait()


# -- every call: the ranks' arguments to step() / evaluate() ------------------------------------------

BatchSignature = tuple[tuple[tuple[int, ...], str], ...]
"""The shape and dtype of every tensor of a batch (the inputs or the targets), in order."""

_ABSENT = -(2**63)  # an item a rank does not pass (its inputs are None): below every digest and its negation


def batch_signature(batch: Any) -> BatchSignature | None:
    """``batch``'s shapes and dtypes (a tensor or a tuple of tensors, already checked), None for None."""
    if batch is None:
        return None
    tensors = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
    return tuple((tuple(t.shape), str(t.dtype).replace("torch.", "")) for t in tensors)


KeywordSignature = tuple[tuple[str, Any], ...]
"""The keyword arguments of a call by name (sorted): a tensor's shape and dtype, a plain value's
``repr`` (None, a number, a string), another object's type."""


def keyword_signature(kwargs: Mapping[str, Any] | None) -> KeywordSignature:
    """``kwargs``'s names with what every rank must agree on for each (:data:`KeywordSignature`)."""
    if not kwargs:
        return ()

    def describe(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), str(value.dtype).replace("torch.", ""))
        if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
            return ("value", repr(value))
        return ("object", type(value).__name__)

    return tuple((name, describe(kwargs[name])) for name in sorted(kwargs))


@dataclass(frozen=True)
class CallSignature:
    """What one rank passed to ``step`` or ``evaluate``: the items every rank's call must agree on.

    ``inputs`` / ``targets`` are None where the rank passed none (they are compared only among the
    ranks that pass them); ``keywords`` (:func:`keyword_signature`) are compared on every rank:
    every rank passes the same keyword arguments; ``problem`` is the rank's own argument error (its
    call cannot run).
    """

    call: str
    loss_scale: float | None = None
    inputs: BatchSignature | None = None
    targets: BatchSignature | None = None
    problem: str | None = None
    keywords: KeywordSignature = ()

    def items(self) -> list[int]:
        """The signature as five 62-bit numbers (:data:`_ABSENT` for an item not passed)."""
        absent = self.problem is not None
        return [
            int(absent),
            _digest((self.call, self.loss_scale)),
            _ABSENT if absent or self.inputs is None else _digest(self.inputs),
            _ABSENT if absent or self.targets is None else _digest(self.targets),
            _ABSENT if absent else _digest(self.keywords),
        ]


def _digest(value: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 2


class CallCheck:
    """Compares every rank's :class:`CallSignature` before a call communicates (one exchange per call).

    ``group`` spans every rank of the Pipeline (all replicas; a gloo group the pipeline's transfers
    never use); ``monitor`` (a :class:`~..failures.PeerMonitor`) carries every wait (the Pipeline's
    deadline and error notices); ``name(r)`` names the rank of group rank ``r`` in messages.  The
    common case costs one max-reduce of ten int64 — each item and its negation, so every rank
    learns each item's largest and smallest value at once — by recursive doubling over
    point-to-point transfers (⌈log₂ N⌉ rounds of one simultaneous swap, two more hops when N is not
    a power of two).  Point-to-point rather than a gloo collective because a wait for a transfer can
    be ended when a peer posts an error notice or the deadline passes, and a collective's cannot.
    Only when the values differ, or a rank reports a problem, do the ranks exchange their full
    signatures to say
    what differs (:func:`explain_calls`).
    """

    def __init__(self, group: Any, monitor: Any, name: Callable[[int], str]):
        self.group = group
        self.monitor = monitor
        self.name = name
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.ranks = [dist.get_global_rank(group, r) for r in range(self.size)]  # group rank -> global

    def exchange(self, signature: CallSignature) -> str | None:
        """Every rank's verdict on this call: None when the ranks agree, else the message to raise."""
        items = signature.items()
        values = torch.tensor(
            [*items, *(_ABSENT if item == _ABSENT else -item for item in items)], dtype=torch.int64
        )
        values = self._max_reduce(
            values, f"every rank to call {signature.call}() (the check of its arguments)"
        )
        count = len(items)
        largest, smallest = values[:count].tolist(), [-v for v in values[count:].tolist()]
        differ = largest[0] > 0 or any(
            high != _ABSENT and high != low for high, low in zip(largest[1:], smallest[1:])
        )
        if not differ:
            return None
        signatures = share_objects(signature, self.group, self.ranks, self.monitor, tag=_SIGNATURES_TAG)
        return explain_calls(signatures, self.name)

    def _max_reduce(self, values: torch.Tensor, what: str) -> torch.Tensor:
        """The elementwise maximum of every rank's ``values``, on every rank (recursive doubling).

        The largest power of two ``q ≤ N`` of the ranks swap and combine with the rank whose group
        rank differs in one bit, bit by bit (⌈log₂ q⌉ rounds of one simultaneous exchange); each rank
        ``q + i`` first hands its values to rank ``i`` and gets the result from it at the end.
        """
        rank, size = self.rank, self.size
        q = 1 << (size.bit_length() - 1)
        if rank >= q:
            self._transfer(dist.isend, values, rank - q, what)
            self._transfer(dist.irecv, values, rank - q, what)
            return values
        incoming = torch.empty_like(values)
        if rank + q < size:
            self._transfer(dist.irecv, incoming, rank + q, what)
            torch.maximum(values, incoming, out=values)
        mask = 1
        while mask < q:
            self._swap(values, incoming, rank ^ mask, what)
            torch.maximum(values, incoming, out=values)
            mask <<= 1
        if rank + q < size:
            self._transfer(dist.isend, values, rank + q, what)
        return values

    def _transfer(self, operation: Callable[..., Any], tensor: torch.Tensor, peer: int, what: str) -> None:
        work = _post(self.monitor, operation, tensor, self.ranks[peer], self.group, _CHECK_TAG, what)
        self.monitor.wait(work, what)

    def _swap(self, mine: torch.Tensor, theirs: torch.Tensor, peer: int, what: str) -> None:
        """Send ``mine`` to ``peer`` while receiving its values into ``theirs``."""
        sent = _post(self.monitor, dist.isend, mine, self.ranks[peer], self.group, _CHECK_TAG, what)
        received = _post(self.monitor, dist.irecv, theirs, self.ranks[peer], self.group, _CHECK_TAG, what)
        self.monitor.wait(received, what)
        self.monitor.wait(sent, what)


def prepare_call(
    call: str,
    inputs: Any,
    targets: Any,
    loss_scale: float | None,
    split: Callable[[Any, Any], tuple],
    exchange: Callable[[CallSignature], str | None] | None,
    kwargs: Mapping[str, Any] | None = None,
) -> tuple:
    """Check and ``split`` a rank's arguments of ``call``, then compare the call with every rank's.

    ``split(inputs, targets)`` splits the keyword arguments ``kwargs`` too (the signature compares
    them, :func:`keyword_signature`).

    Runs before the call's first message: a rank's own argument error is raised there and named on
    every other rank, and arguments that differ between ranks raise the same error everywhere
    (``exchange``, :meth:`CallCheck.exchange`; None skips the comparison); nothing has been sent,
    so the Pipeline stays usable.
    """
    problem: Exception | None = None
    prepared: tuple = ()
    scale, verdict = None, None
    try:
        # an iterable batch is read once, here: the split and the signature both see its tensors
        inputs, targets = (
            b if b is None or isinstance(b, (torch.Tensor, Mapping)) else tuple(b) for b in (inputs, targets)
        )
        if call == "step":
            if not torch.is_grad_enabled():
                raise PipelineError(
                    "step() runs a backward, but autograd is disabled here (torch.no_grad or "
                    "inference_mode); use pipe.evaluate(inputs, targets) for a forward-only pass"
                )
            scale = float(loss_scale or 1.0)
        prepared = split(inputs, targets)
    except Exception as error:
        problem = error
    if exchange is not None:
        if problem is None:
            signature = CallSignature(
                call,
                scale,
                batch_signature(inputs),
                batch_signature(targets),
                keywords=keyword_signature(kwargs),
            )
        else:
            text = (
                str(problem) if isinstance(problem, PipelineError) else f"{type(problem).__name__}: {problem}"
            )
            signature = CallSignature(call, problem=text)
        verdict = exchange(signature)
    if problem is not None:
        raise problem
    if verdict is not None:
        raise PipelineError(verdict)
    return prepared


def _post(
    monitor: Any,
    operation: Callable[..., Any],
    tensor: torch.Tensor,
    peer: int,
    group: Any,
    tag: int,
    what: str,
) -> Any:
    """Post one transfer; a channel a peer closed becomes a PipelineError (or the peer's error notice)."""
    try:
        return operation(tensor, peer, group=group, tag=tag)
    except RuntimeError as error:
        monitor.explain()  # a peer's error notice says more than a closed channel
        raise PipelineError(
            f"rank {monitor.rank}: waiting for {what} failed — a peer rank probably died or stopped "
            f"with an error ({type(error).__name__}: {error})"
        ) from error


_CHECK_TAG, _SIGNATURES_TAG = 1, 2  # message tags on the check's group (share_objects uses tag and tag + 1)
STATE_DICT_TAG = 4
"""The tag of :meth:`~zerobubble.runtime.Pipeline.full_state_dict`'s messages on the check's group."""


def share_objects(obj: Any, group: Any, ranks: Sequence[int], monitor: Any, *, tag: int) -> list[Any]:
    """``obj`` of every rank of ``ranks`` (global ranks of ``group``, this rank among them), in that order.

    Serialised with ``torch.save`` and sent point to point to every other rank on ``group`` (a gloo
    group: CPU tensors) with tags ``tag`` (sizes) and ``tag + 1``, each wait through ``monitor`` (a
    :class:`~..failures.PeerMonitor`); every rank of ``ranks`` calls it.  Used on
    rare paths (explaining a difference, gathering a state dict), where N·(N−1) messages are fine.
    """
    me = dist.get_rank()
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    peers = [r for r in ranks if r != me]
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    sizes = {peer: torch.zeros(1, dtype=torch.int64) for peer in peers}
    what = "the other ranks' messages"
    works = [_post(monitor, dist.isend, size, peer, group, tag, what) for peer in peers]
    works += [_post(monitor, dist.irecv, sizes[peer], peer, group, tag, what) for peer in peers]
    for work in works:
        monitor.wait(work, what)
    pieces = {peer: torch.empty(int(sizes[peer].item()), dtype=torch.uint8) for peer in peers}
    works = [_post(monitor, dist.isend, payload, peer, group, tag + 1, what) for peer in peers]
    works += [_post(monitor, dist.irecv, pieces[peer], peer, group, tag + 1, what) for peer in peers]
    for work in works:
        monitor.wait(work, what)
    # the bytes come from this Pipeline's own ranks (torch.save above); they may hold extra state
    return [
        obj if peer == me else torch.load(io.BytesIO(pieces[peer].numpy().tobytes()), weights_only=False)
        for peer in ranks
    ]


def explain_calls(signatures: Sequence[CallSignature], name: Callable[[int], str] = "rank {}".format) -> str:
    """The message every rank raises when the ranks' calls differ (the first difference, by rank)."""
    for rank, signature in enumerate(signatures):
        if signature.problem is not None:
            return (
                f"{name(rank)} cannot run {signature.call}(): {signature.problem} — no rank started this "
                f"{signature.call}() (every rank raises this error) and the Pipeline stays usable; fix "
                f"the call on {name(rank)} and call {signature.call}() again on every rank"
            )
    reference = signatures[0]
    for rank, signature in enumerate(signatures[1:], start=1):
        if signature.call != reference.call:
            return (
                f"{name(rank)} called {signature.call}() while {name(0)} called {reference.call}(); every "
                "rank must make the same calls in the same order — nothing ran, the Pipeline stays usable"
            )
        if signature.loss_scale != reference.loss_scale:
            return (
                f"{name(rank)} passed loss_scale={_scale(signature.loss_scale)} to step() but {name(0)} "
                f"passed {_scale(reference.loss_scale)}; the last stage's loss scale scales every gradient "
                "and optimizer_step(unscale=) divides by it, so pass the same value on every rank — "
                "nothing ran, the Pipeline stays usable"
            )
    for what in ("inputs", "targets"):
        given = [
            (rank, getattr(s, what)) for rank, s in enumerate(signatures) if getattr(s, what) is not None
        ]
        for rank, actual in given[1:]:
            first, expected = given[0]
            if actual != expected:
                return (
                    f"the {what} passed to {reference.call}() differ between ranks: "
                    f"{_batch_difference(expected, actual, name(first), name(rank))}; every rank that "
                    f"passes {what} must pass the same batch shapes and dtypes (under data parallelism, "
                    f"equal shards) — or None where they are not needed (the {what} are used "
                    f"{'on the first stage' if what == 'inputs' else 'on the last stage'}) — nothing ran, "
                    "the Pipeline stays usable"
                )
    for rank, signature in enumerate(signatures[1:], start=1):
        if signature.keywords != reference.keywords:
            return (
                f"the keyword arguments passed to {reference.call}() differ between ranks: "
                f"{_keyword_difference(reference.keywords, signature.keywords, name(0), name(rank))}; "
                "every rank must pass the same keyword arguments (names, tensor shapes and dtypes, "
                "plain values) — they reach the layers that take them on whichever rank holds them — "
                "nothing ran, the Pipeline stays usable"
            )
    return (
        "the ranks' calls differ (their argument digests disagree); every rank must pass the same arguments"
    )


def _keyword_difference(expected: KeywordSignature, actual: KeywordSignature, first: str, other: str) -> str:
    mine, theirs = dict(expected), dict(actual)
    for key in sorted(set(mine) | set(theirs)):
        if key not in theirs:
            return f"{key!r} is passed on {first} but not on {other}"
        if key not in mine:
            return f"{key!r} is passed on {other} but not on {first}"
        if mine[key] != theirs[key]:
            mine_text, theirs_text = _keyword_value(mine[key]), _keyword_value(theirs[key])
            return f"{key!r} is {mine_text} on {first} but {theirs_text} on {other}"
    return "they differ"


def _keyword_value(described: Any) -> str:
    kind, *rest = described
    if kind == "tensor":
        shape, dtype = rest
        return f"a {list(shape)} {dtype} tensor"
    if kind == "value":
        return rest[0]
    return f"a {rest[0]}"


def _scale(scale: float | None) -> str:
    return "None" if scale is None else f"{scale:g}"


def _batch_difference(expected: BatchSignature, actual: BatchSignature, first: str, other: str) -> str:
    def show(signature: BatchSignature) -> str:
        text = ", ".join(f"{list(shape)} {dtype}" for shape, dtype in signature)
        return text if len(signature) == 1 else f"({text})"

    sizes = [{shape[0] if shape else None for shape, _ in s} for s in (expected, actual)]
    if len(expected) == len(actual) and all(len(s) == 1 for s in sizes) and sizes[0] != sizes[1]:
        (a,), (b,) = sizes
        return f"batch size {a} on {first} but {b} on {other} ({show(expected)} and {show(actual)})"
    return f"{show(expected)} on {first} but {show(actual)} on {other}"
