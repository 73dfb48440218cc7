"""Measure a model layer by layer for the planner (:mod:`zerobubble.schedule.modelplan`).

:func:`profile_layers` runs every layer on one microbatch, a copy at a time (the model itself, its
gradients and the random-number state are left as they were), and records per layer:

* ``T_F``, ``T_B`` and ``T_W`` (medians over ``repeats`` sweeps through all layers, each timed run
  after a warm-up) with the runtime's own B/W
  split: B runs with the weight gradients deferred into a :class:`~..wgrad.WeightGradStore` and W
  flushes them, exactly as the executor's B and W ops do (:func:`split_backward` and
  :func:`fused_backward` are the one place that knows this API; a layer whose weight gradients are not
  deferred shows ``T_W = 0``); and the fused backward ``T_BW`` that 1F1B-style schedules run;
* the activation bytes a forward keeps for its B — every tensor autograd saves (seen by
  ``torch.autograd.graph.saved_tensors_hooks``, parameters excluded) and the layer's outputs, each
  storage counted once — and the bytes B keeps for W (what the store holds);
* parameter, gradient and optimizer-state bytes (``optimizer_bytes_per_parameter_byte`` times the
  trainable parameter bytes: 2 for Adam's two moments);
* the bytes of the layer's output, which cross a cut placed after it.

:func:`measure_transfer` times messages between ranks 0 and 1 of a process group (ping-pong, two
sizes) and fits ``T_comm = latency + bytes / bandwidth``.  Timing is wall-clock around each piece,
synchronising the device on a GPU.
"""

from __future__ import annotations

import copy
import statistics
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...schedule.modelplan import LayerProfile, ModelProfile, median_profile
from ..tensors import storage_bytes
from ..wgrad import WeightGradStore, install_deferral
from .staging import layer_keywords

__all__ = [
    "measure_transfer",
    "profile_layers",
]

Loss = Callable[[Any, Any], torch.Tensor]


def profile_layers(
    layers: Sequence[tuple[str, nn.Module]] | Sequence[nn.Module] | nn.Sequential,
    inputs: Any,
    targets: Any = None,
    loss_fn: Loss | None = None,
    device: torch.device | str | None = None,
    repeats: int = 5,
    optimizer_bytes_per_parameter_byte: float = 2.0,
    comm: tuple[float, float] = (0.0, 0.0),
    evict_bytes: int = 0,
    *,
    kwargs: Mapping[str, Any] | None = None,
) -> ModelProfile:
    """Per-layer costs of ``layers`` on the microbatch ``inputs`` (a tensor or tuple of tensors).

    ``loss_fn(output, targets)`` is timed with the last layer (its F computes the loss, its B starts
    from it, as on the pipeline's last stage); without it the last layer's B starts from a gradient of
    ones.  ``kwargs`` are the microbatch's keyword arguments (``attention_mask=``, already on
    ``device`` and cut to the microbatch: :func:`~.staging.split_keywords`); every forward of a layer
    gets those its ``forward`` takes, as a stage passes them (:class:`~.staging.StageModule`).
    ``comm`` is ``(latency seconds, bandwidth bytes/s)`` from :func:`measure_transfer`.
    ``evict_bytes`` > 0 writes a buffer of that size before each timed F, B, W and BW
    (:class:`CacheEvictor`), for the case where the other layers of a stage push a layer's data out
    of the caches between two of its ops.  Off by default: the op times recorded in pipeline runs of
    both benchmark models matched the warm profile, and a 64 MiB eviction overstated them by up to
    56 % (``docs/auto-planning.md``, section 1).
    """
    named = _named(layers)
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    target_device = torch.device(device) if device is not None else _device_of(named)
    first = _as_tuple(inputs, target_device)
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    timing = _Timing(
        target_device, optimizer_bytes_per_parameter_byte, CacheEvictor(target_device, evict_bytes)
    )
    sweeps: list[list[LayerProfile]] = []
    try:
        # every sweep times each layer once (after a warm-up): a burst of load from elsewhere then
        # hits one sample of many layers instead of every sample of one layer
        for _ in range(repeats):
            loss = (loss_fn, _to_device(targets, target_device)) if loss_fn is not None else None
            sweeps.append(_sweep(named, first, loss, timing, kwargs))
    finally:
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    measured = median_profile([ModelProfile(tuple(sweep)) for sweep in sweeps]).layers
    latency, bandwidth = comm
    return ModelProfile(
        measured,
        comm_latency=latency,
        comm_bandwidth=bandwidth,
        microbatch_size=_batch_size(inputs),
        source=f"profile_layers on {target_device}, median of {repeats} sweeps",
        meta={"torch": torch.__version__, "device": str(target_device)},
    )


def split_backward(
    module: nn.Module,
    tensors: list[torch.Tensor],
    grads: list[torch.Tensor] | None,
    store: WeightGradStore,
    watched: Sequence[weakref.ref[torch.Tensor]] = (),
    excluded: set[int] | frozenset[int] = frozenset(),
    evict: Callable[[], None] = lambda: None,
    parameters: set[int] | frozenset[int] = frozenset(),
) -> tuple[float, float, float]:
    """B then W of one microbatch through the store API the executor uses: ``(T_B, T_W, bytes kept for W)``.

    The one function that knows how the runtime defers weight gradients (``install_deferral`` has
    been applied to ``module``): B is a backward between ``store.begin(key, defer=True)`` and
    ``store.end()``, W is ``store.flush(key)``.  The bytes kept for W are those the store's work
    holds plus the ``watched`` saved tensors still alive after B, except storages in ``excluded``.
    ``evict`` runs before B and before W, outside the timed spans.  Storages in ``parameters`` are
    not counted (the generic split's W work names the parameters it computes).
    """
    key = (0, 0)
    evict()
    started = _now(tensors[0].device)
    store.begin(key, True)
    try:
        torch.autograd.backward(tensors, grads)
    finally:
        store.end()
    middle = _now(tensors[0].device)
    if key not in store.pending_keys():  # nothing deferred: this layer has no W
        return middle - started, 0.0, 0.0
    alive = [
        t for ref in watched if (t := ref()) is not None and t.untyped_storage().data_ptr() not in excluded
    ]
    held = [t for t in store.held_tensors(key) if t.untyped_storage().data_ptr() not in parameters]
    kept_tensors = [*held, *alive]
    kept = float(storage_bytes(kept_tensors))
    del alive, kept_tensors
    evict()
    flushing = _now(tensors[0].device)
    store.flush(key)
    ended = _now(tensors[0].device)
    return middle - started, ended - flushing, kept


def fused_backward(
    tensors: list[torch.Tensor],
    grads: list[torch.Tensor] | None,
    store: WeightGradStore,
    evict: Callable[[], None] = lambda: None,
) -> float:
    """The executor's fused BW of one microbatch (``store.begin(key, defer=False)``): its time
    (``evict`` runs first, untimed)."""
    evict()
    started = _now(tensors[0].device)
    store.begin((0, 1), False)
    try:
        torch.autograd.backward(tensors, grads)
    finally:
        store.end()
    return _now(tensors[0].device) - started


@dataclass(frozen=True)
class _Timing:
    """How each layer of a sweep is timed and sized: on ``device``, its optimizer state
    ``optimizer_factor`` times its trainable parameter bytes, ``evict`` run before each timed op."""

    device: torch.device
    optimizer_factor: float
    evict: Callable[[], None]


def _sweep(
    named: list[tuple[str, nn.Module]],
    values: tuple[torch.Tensor, ...],
    loss: tuple[Loss, Any] | None,
    timing: _Timing,
    kwargs: Mapping[str, Any] | None,
) -> list[LayerProfile]:
    """Profile every layer once, in order, each on the previous one's outputs; ``loss`` goes with the
    last layer, and each layer gets those of ``kwargs`` its ``forward`` takes."""
    sweep = []
    for index, (name, layer) in enumerate(named):
        last_loss = loss if index == len(named) - 1 else None
        keywords = layer_keywords(layer).select(kwargs, len(values)) if kwargs else {}
        profile, values = _profile_layer(name, layer, values, last_loss, timing, index == 0, keywords)
        sweep.append(profile)
    return sweep


def _profile_layer(
    name: str,
    layer: nn.Module,
    values: tuple[torch.Tensor, ...],
    loss: tuple[Loss, Any] | None,
    timing: _Timing,
    first: bool = False,
    keywords: Mapping[str, Any] | None = None,
) -> tuple[LayerProfile, tuple[torch.Tensor, ...]]:
    """Time and size one layer once (on a copy, after a warm-up); its profile and detached outputs.

    The ``first`` layer takes the data as the pipeline's first stage does, without asking for its
    gradient: its B computes no input gradient.  Every forward gets the keyword arguments ``keywords``.
    """
    keywords, device, evict = keywords or {}, timing.device, timing.evict
    module = copy.deepcopy(layer).to(device)
    store = WeightGradStore()
    deferral = install_deferral([module], store)
    parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
    for timed in (False, True):  # the first run warms up and creates the .grad tensors the second adds into
        before = evict if timed else _nothing
        inputs = _layer_inputs(values, first)
        forward, outputs, head, saved = _timed_forward(module, inputs, keywords, loss, device, before)
        tensors, grads = _backward_roots(outputs, head)
        saved_bytes, watched, ours = _saved_for_backward(saved, inputs, outputs, parameters)
        b, w, kept_bytes = (
            split_backward(module, tensors, grads, store, watched, ours, before, parameters)
            if tensors
            else (0.0, 0.0, 0.0)
        )
    # fused schedules install the fast paths only: without a generic module that is this copy already
    fused_split = (module, store) if not deferral.generic else _fast_paths_copy(layer, device)
    fused = (
        _fused_backward_time(*fused_split, _layer_inputs(values, first), loss, evict, keywords)
        if w > 0
        else 0.0
    )
    parameter_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    trainable = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    profile = LayerProfile(
        name=name,
        forward=forward,
        backward_input=b,
        backward_weight=w,
        activation_bytes=saved_bytes,
        weight_input_bytes=kept_bytes,
        parameter_bytes=float(parameter_bytes),
        gradient_bytes=float(trainable),
        optimizer_bytes=float(trainable * timing.optimizer_factor),
        output_bytes=float(sum(t.numel() * t.element_size() for t in outputs)),
        backward_fused=fused,
    )
    return profile, tuple(t.detach() for t in outputs)


def _timed_forward(
    module: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    keywords: Mapping[str, Any],
    loss: tuple[Loss, Any] | None,
    device: torch.device,
    before: Callable[[], None],
) -> tuple[float, tuple[torch.Tensor, ...], torch.Tensor | None, list[torch.Tensor]]:
    """One forward of ``module`` (the loss too, when given), timed after ``before``: its time, its
    outputs, the loss (or None) and every tensor autograd saved for the backward."""
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor, saved: list[torch.Tensor] = saved) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    before()
    started = _now(device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = module(*inputs, **keywords)
        outputs = result if isinstance(result, tuple) else (result,)
        head = loss[0](result, loss[1]) if loss is not None else None
    return _now(device) - started, outputs, head, saved


def _saved_for_backward(
    saved: list[torch.Tensor],
    inputs: tuple[torch.Tensor, ...],
    outputs: tuple[torch.Tensor, ...],
    parameters: set[int],
) -> tuple[float, list[weakref.ref[torch.Tensor]], set[int]]:
    """The bytes a forward keeps for its B (the saved tensors and the outputs, parameters excluded),
    then what tells W's bytes apart after B: weak references to the saved tensors, and the storages
    of the layer's own inputs and outputs.  Empties ``saved``, so that only the graph keeps them."""
    activations = [t for t in (*saved, *outputs) if t.untyped_storage().data_ptr() not in parameters]
    saved_bytes = float(storage_bytes(activations))
    # after B, the saved tensors still alive are the ones W keeps (the generic split's graph)
    # the layer's own inputs and outputs stay referenced here, so they are no evidence of W keeping them
    ours = {t.untyped_storage().data_ptr() for t in (*inputs, *outputs) if isinstance(t, torch.Tensor)}
    watched = [weakref.ref(t) for t in saved if t.untyped_storage().data_ptr() not in parameters]
    del saved[:], activations
    return saved_bytes, watched, ours


def _layer_inputs(values: tuple[torch.Tensor, ...], first: bool) -> tuple[torch.Tensor, ...]:
    """A layer's inputs as a stage gets them: received activations need their gradient (B sends it
    back), the first stage's data does not (the executor's ``_stage_inputs``)."""
    if first:
        return tuple(t.detach() for t in values)
    return tuple(t.detach().requires_grad_() if t.is_floating_point() else t for t in values)


def _fast_paths_copy(layer: nn.Module, device: torch.device) -> tuple[nn.Module, WeightGradStore]:
    """A copy of ``layer`` split as schedules without W ops run it (``install_deferral(generic=False)``),
    and its store."""
    module, store = copy.deepcopy(layer).to(device), WeightGradStore()
    install_deferral([module], store, generic=False)
    return module, store


def _fused_backward_time(
    module: nn.Module,
    store: WeightGradStore,
    inputs: tuple[torch.Tensor, ...],
    loss: tuple[Loss, Any] | None,
    evict: Callable[[], None],
    keywords: Mapping[str, Any],
) -> float:
    """The fused backward (BW) of 1F1B-style schedules on ``module``, split into ``store`` as those
    schedules run it (fast paths only), timed after a warm-up; the forwards get ``keywords``."""
    elapsed = 0.0
    for timed in (False, True):  # the warm-up creates the .grad tensors the timed run adds into
        with store.keyed_forward((0, 1)):  # as the executor's forwards: no hooks on the norms
            result = module(*inputs, **keywords)
        outputs = result if isinstance(result, tuple) else (result,)
        tensors, grads = _backward_roots(outputs, loss[0](result, loss[1]) if loss is not None else None)
        if not tensors:
            return 0.0
        elapsed = fused_backward(tensors, grads, store, evict if timed else _nothing)
    return elapsed


class CacheEvictor:
    """Writes a buffer of ``size`` bytes on ``device`` when called (nothing when ``size`` is 0), so
    that the next timed op finds the caches as a pipeline leaves them: holding other layers' data.

    64 MiB exceeds the last-level cache of the CPUs and GPUs this runs on (32 MiB L3 here; 50 MiB L2
    on an H100); on a GPU the write is synchronised before the op's clock starts.
    """

    def __init__(self, device: torch.device, size: int):
        if size < 0:
            raise ValueError(f"evict_bytes must be >= 0, got {size}")
        self.device = device
        self.buffer = torch.empty(size // 4, dtype=torch.float32, device=device) if size else None

    def __call__(self) -> None:
        if self.buffer is None:
            return
        self.buffer.fill_(1.0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _nothing() -> None:
    """No cache eviction (the warm-up run)."""


def _backward_roots(
    outputs: tuple[torch.Tensor, ...], loss: torch.Tensor | None
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """What B differentiates: the loss on the last layer, else every floating output needing a gradient."""
    if loss is not None:
        return [loss], None
    roots = [t for t in outputs if t.is_floating_point() and t.requires_grad]
    return roots, [torch.ones_like(t) for t in roots]


def measure_transfer(
    group: dist.ProcessGroup | None,
    device: torch.device,
    sizes: tuple[int, int] = (1024, 4 * 2**20),
    repeats: int = 7,
) -> tuple[float, float]:
    """``(latency seconds, bandwidth bytes/s)`` between ranks 0 and 1 of ``group`` (collective on them).

    Ping-pongs a float32 message of each byte size in ``sizes`` ``repeats`` times; a one-way time is
    half the median round trip.  Ranks other than 0 and 1 return at once; a group of one rank gives
    ``(0, 0)`` (no transfers).
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if world < 2 or rank > 1:
        return 0.0, 0.0
    peer = dist.get_global_rank(group, 1 - rank) if group is not None else 1 - rank
    times = []
    for size in sizes:
        buffer = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
        trips = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            if rank == 0:
                dist.send(buffer, peer, group=group)
                dist.recv(buffer, peer, group=group)
            else:
                dist.recv(buffer, peer, group=group)
                dist.send(buffer, peer, group=group)
            trips.append(time.perf_counter() - started)
        times.append(statistics.median(trips[1:]) / 2)
    small, large = times
    extra = large - small
    bandwidth = (sizes[1] - sizes[0]) / extra if extra > 0 else 0.0
    return small, bandwidth


def measure_all_to_all(
    group: dist.ProcessGroup,
    rows: int,
    width: int,
    dtype: torch.dtype,
    *,
    device: torch.device,
    repeats: int = 5,
) -> float:
    """Seconds of one forward's expert exchange over ``group`` (collective on it): the routed pairs'
    counts, then ``rows`` rows of ``width`` elements dispatched and as many combined back, split evenly
    over the ranks (:class:`~..parallel.experts.ExpertParallelExperts`' three all-to-alls); the median
    of ``repeats`` after a warm-up."""
    ranks = dist.get_world_size(group)
    per_rank = max(1, -(-rows // ranks))  # the rows each rank sends to each rank
    sent = torch.zeros(ranks * per_rank, width, dtype=dtype, device=device)
    received = torch.empty_like(sent)
    counts = torch.zeros(ranks, dtype=torch.int64, device=device)
    counts_in = torch.empty_like(counts)
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        dist.all_to_all_single(counts_in, counts, group=group)
        dist.all_to_all_single(received, sent, group=group)
        dist.all_to_all_single(sent, received, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


# -- helpers ----------------------------------------------------------------------------------------


def _named(layers: Any) -> list[tuple[str, nn.Module]]:
    if isinstance(layers, nn.Sequential):
        return list(layers.named_children())
    items = list(layers)
    if items and isinstance(items[0], tuple):
        return [(str(name), module) for name, module in items]
    return [(str(index), module) for index, module in enumerate(items)]


def _device_of(named: list[tuple[str, nn.Module]]) -> torch.device:
    for _, module in named:
        for parameter in module.parameters():
            return parameter.device
    return torch.device("cpu")


def _as_tuple(inputs: Any, device: torch.device) -> tuple[torch.Tensor, ...]:
    tensors = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    return tuple(t.to(device) for t in tensors)


def _to_device(targets: Any, device: torch.device) -> Any:
    if isinstance(targets, torch.Tensor):
        return targets.to(device)
    if isinstance(targets, (tuple, list)):
        return type(targets)(_to_device(t, device) for t in targets)
    return targets


def _batch_size(inputs: Any) -> int | None:
    tensor = inputs if isinstance(inputs, torch.Tensor) else next(iter(inputs), None)
    return int(tensor.shape[0]) if isinstance(tensor, torch.Tensor) and tensor.dim() else None


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
