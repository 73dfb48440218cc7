"""FSDP units and data-parallel buckets: the bytes a rank holds and the collectives it waits for.

A :class:`~..grid.Grid` whose record ``grid.comm`` (:class:`~..sharding.FSDPOptions`) reshards its
units shards its replicas as FSDP2 does with ``fully_shard`` on units of ``comm.units`` layers
(``docs/auto-planning.md``, "A cluster on paper"), instead of the runtime's default, the whole
chunk gathered once a step (:data:`~..sharding.ONCE_PER_STEP`; any record that never reshards):

* **memory**: every layer's parameters, gradients and optimizer state sharded, plus the whole
  parameters of the ``prefetch + 1`` units in flight (without ``reshard_after_forward`` every unit
  stays whole from its forward to its backward: all of them) and the whole gradients of two units
  (the one whose backward runs, the one being reduce-scattered) — :func:`unit_held_bytes`;
* **time**: each microbatch's forward gathers every unit and its backward gathers them again when
  they were resharded and reduce-scatters each; the collectives run on their own stream beside the
  compute (:func:`exposed_seconds`): a gather issued ``prefetch`` units ahead hides behind their
  compute, the first of a pass and the last reduce-scatter do not.  The closed form reshards after
  every backward (``reshard_after_backward`` is read as True): the lowering's simulator
  (``schedule/lowering``) times the other records exactly; ``docs/auto-planning.md`` § 8 compares.

A replicated grid with ``comm.bucket_bytes`` > 0 all-reduces its gradients in buckets during the last
microbatch's backward (DDP), the last bucket exposed; with 0 once after the step, in full.
Pure Python; no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..grid import Grid
    from .profile import LayerProfile


def units(layers: Sequence[LayerProfile], size: int) -> list[list[LayerProfile]]:
    """``layers`` in consecutive groups of ``size``."""
    return [list(layers[i : i + size]) for i in range(0, len(layers), size)]


def window(values: Sequence[float], width: int) -> float:
    """The largest sum of ``width`` consecutive ``values`` (all of them when fewer)."""
    if len(values) <= width:
        return math.fsum(values)
    return max(math.fsum(values[i : i + width]) for i in range(len(values) - width + 1))


def unit_held_bytes(grid: Grid, layers: Sequence[LayerProfile]) -> float:
    """The most parameter, gradient and optimizer-state bytes a rank holding ``layers`` keeps in a
    step with the FSDP units of ``grid.comm`` (module docstring)."""
    tp = grid.tp
    sharded = math.fsum(layer.static_bytes for layer in layers) / (tp * grid.shard)
    groups = units(layers, grid.comm.unit_size(len(layers)))
    whole = [math.fsum(layer.parameter_bytes for layer in unit) / tp for unit in groups]
    grads = [math.fsum(layer.gradient_bytes for layer in unit) / tp for unit in groups]
    params = window(whole, grid.comm.prefetch + 1) if grid.comm.reshard_after_forward else math.fsum(whole)
    return sharded + params + window(grads, 2)


def exposed_seconds(
    compute: Sequence[float], before: Sequence[float], after: Sequence[float], prefetch: int
) -> float:
    """The seconds one pass over units waits for its collectives beyond its ``compute``.

    Unit ``i`` computes once its ``before`` collective (a gather) ended and unit ``i − 1`` finished;
    its ``after`` collective (a reduce-scatter) is issued when it finishes.  One collective stream
    runs them in the order issued; the gather of unit ``i + prefetch`` is issued when unit ``i``
    starts (``prefetch`` 0: when unit ``i − 1`` ends).
    """
    count = len(compute)
    stream = 0.0

    def run(issued: float, seconds: float) -> float:
        nonlocal stream
        stream = max(stream, issued) + seconds
        return stream

    gathered = [0.0] * count
    for i in range(min(prefetch, count)):
        gathered[i] = run(0.0, before[i])
    end = 0.0
    for i in range(count):
        if prefetch == 0:
            gathered[i] = run(end, before[i])
        start = max(end, gathered[i])
        if prefetch > 0 and i + prefetch < count:
            gathered[i + prefetch] = run(start, before[i + prefetch])
        end = start + compute[i]
        run(end, after[i])
    return max(end, stream) - math.fsum(compute)


def unit_step_seconds(
    grid: Grid, layers: Sequence[LayerProfile], chunks: int = 1, microbatches: int = 1
) -> float:
    """The exposed FSDP collectives of one step for a rank holding ``layers`` in ``chunks`` chunks
    with the units of ``grid.comm``: every microbatch's forward and backward passes."""
    link, s, tp = grid.dp_link, grid.shard, grid.tp
    rows = grid.dp // s
    size = math.ceil(len(layers) / chunks)
    total = 0.0
    for chunk in units(layers, size):
        groups = units(chunk, grid.comm.unit_size(len(chunk)))
        params = [math.fsum(layer.parameter_bytes for layer in unit) / tp for unit in groups]
        grads = [math.fsum(layer.gradient_bytes for layer in unit) / tp for unit in groups]
        gathers = [link.time((s - 1) / s * p) for p in params]
        scatters = [link.time((s - 1) / s * g) + grid.all_reduce(g / s, rows, link) for g in grads]
        forward = [math.fsum(layer.forward for layer in unit) for unit in groups]
        backward = [
            math.fsum(layer.backward_input + layer.backward_weight for layer in unit) for unit in groups
        ]
        nothing = [0.0] * len(groups)
        total += exposed_seconds(forward, gathers, nothing, grid.comm.prefetch)
        again = gathers[::-1] if grid.comm.reshard_after_forward else nothing
        total += exposed_seconds(backward[::-1], again, scatters[::-1], grid.comm.prefetch)
    return microbatches * total


def bucket_step_seconds(grid: Grid, layers: Sequence[LayerProfile]) -> float:
    """The exposed gradient all-reduce of a replicated rank whose buckets of ``grid.comm.bucket_bytes``
    start during the last microbatch's backward (layers in reverse, a bucket closed at a layer's end)."""
    backward, reduces, filled = [], [], 0.0
    for index, layer in enumerate(reversed(layers)):
        filled += layer.gradient_bytes / grid.tp
        backward.append(layer.backward_input + layer.backward_weight)
        closes = filled >= grid.comm.bucket_bytes or index == len(layers) - 1
        reduces.append(grid.all_reduce(filled, grid.dp, grid.dp_link) if closes else 0.0)
        filled = 0.0 if closes else filled
    return exposed_seconds(backward, [0.0] * len(backward), reduces, 1)
