"""How a stage's layers are cut into the parts communication works on: FSDP units and all-reduce buckets.

An FSDP unit is ``(stage, index)``: the stage's layers cut per chunk (one unit), per layer, or per
group of ``g`` layers.  A bucket of the replicated all-reduce is ``(stage, index)`` too: the stage's
gradient bytes cut by a bucket size, filled from the last layer backwards (the order the backward
produces them, as DDP does).  Parts are numbered in forward layer order either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...errors import ScheduleError
from ..sharding import FSDPOptions


@dataclass(frozen=True)
class StageBytes:
    """Per virtual stage, per layer: the parameter bytes of one full copy (after tensor parallelism)
    and the gradient bytes (the same by default)."""

    params: tuple[tuple[float, ...], ...]
    grads: tuple[tuple[float, ...], ...] = ()

    def __post_init__(self) -> None:
        params = tuple(tuple(float(b) for b in stage) for stage in self.params)
        grads = tuple(tuple(float(b) for b in stage) for stage in self.grads) if self.grads else params
        if any(not stage for stage in params):
            raise ScheduleError("every stage needs at least one layer in StageBytes.params")
        if [len(stage) for stage in grads] != [len(stage) for stage in params]:
            raise ScheduleError("StageBytes.grads needs one value per layer of params, stage by stage")
        if any(b < 0 for stage in (*params, *grads) for b in stage):
            raise ScheduleError("StageBytes holds byte counts: none may be negative")
        object.__setattr__(self, "params", params)
        object.__setattr__(self, "grads", grads)

    @classmethod
    def uniform(cls, stages: int, layers: int, layer_bytes: float) -> StageBytes:
        """``stages`` stages of ``layers`` layers of ``layer_bytes`` bytes each."""
        return cls(tuple((float(layer_bytes),) * layers for _ in range(stages)))

    @property
    def num_stages(self) -> int:
        """How many virtual stages the bytes describe."""
        return len(self.params)


def cut_stage(
    params: Sequence[float], grads: Sequence[float], options: FSDPOptions, mode: str
) -> tuple[tuple[int, int], ...]:
    """The layer ranges ``[start, stop)`` of one stage's parts under ``options`` and the grid's
    data-parallel ``mode``, in layer order."""
    layers = len(params)
    if mode == "fsdp":
        size = options.unit_size(layers)
        return tuple((start, min(start + size, layers)) for start in range(0, layers, size))
    if mode == "replicate" and options.bucket_bytes > 0:
        return _buckets(grads, options.bucket_bytes)
    return ((0, layers),)


def _buckets(grads: Sequence[float], bucket_bytes: float) -> tuple[tuple[int, int], ...]:
    """Buckets filled from the last layer backwards until each holds ``bucket_bytes`` (the first
    bucket, of the first layers, may hold less)."""
    ranges: list[tuple[int, int]] = []
    stop, held = len(grads), 0.0
    for layer in range(len(grads) - 1, -1, -1):
        held += grads[layer]
        if held >= bucket_bytes:
            ranges.append((layer, stop))
            stop, held = layer, 0.0
    if stop > 0:
        ranges.append((0, stop))
    return tuple(reversed(ranges))


def stage_parts(
    num_stages: int, model: StageBytes | None, options: FSDPOptions, mode: str
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...]]:
    """Per stage: its parts' layer counts, parameter bytes and gradient bytes.  Without ``model``
    every stage is one layer of no bytes."""
    if model is None:
        if mode != "none":
            raise ScheduleError(
                f"lowering with data_parallel={mode!r} needs the stages' byte sizes (model=StageBytes(...))"
            )
        model = StageBytes.uniform(num_stages, 1, 0.0)
    if model.num_stages != num_stages:
        raise ScheduleError(
            f"StageBytes describes {model.num_stages} stages; the schedule has {num_stages} virtual stages"
        )
    layers, params, grads = [], [], []
    for stage_params, stage_grads in zip(model.params, model.grads):
        ranges = cut_stage(stage_params, stage_grads, options, mode)
        layers.append(tuple(stop - start for start, stop in ranges))
        params.append(tuple(sum(stage_params[start:stop]) for start, stop in ranges))
        grads.append(tuple(sum(stage_grads[start:stop]) for start, stop in ranges))
    return tuple(layers), tuple(params), tuple(grads)
