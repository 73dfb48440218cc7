"""The Pipeline's lowered program: its resolved schedule lowered to every rank's communication, checked.

:func:`lowered_pipeline` lowers the agreed schedule (``schedule/lowering``) with the Pipeline's grid
(its data-parallel mode and sizes) and ``fsdp=`` record (default one unit per chunk, gathered once a
step), each stage's layers those of the resolution's bounds, and validates the result before
anything runs.  Every rank lowers the same agreed resolution, so a program that would hang (the
replicas' collectives in different orders, a receive posted out of order) raises the same
:class:`PipelineError` on every rank, at construction.  The executor then runs its rank's program
(:meth:`~..execute.executor.Executor.follow`).
"""

from __future__ import annotations

from dataclasses import replace

from ...errors import ScheduleError
from ...schedule.grid import Grid
from ...schedule.lowering import LoweredSchedule, StageBytes, lower, validate_lowered
from ...schedule.sharding import ONCE_PER_STEP, FSDPOptions
from .. import PipelineError
from .resolve import Resolution


def stage_bytes(resolution: Resolution) -> StageBytes:
    """Per stage, per layer of the resolution's bounds: the layer's parameter bytes (a parameter
    shared by several layers counted at its first).  A stage without layers counts one empty layer."""
    seen: set[int] = set()
    per_layer: list[float] = []
    for _, layer in resolution.layers:
        total = 0
        for param in layer.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                total += param.numel() * param.element_size()
        per_layer.append(float(total))
    bounds = resolution.bounds
    stages = [tuple(per_layer[bounds[s] : bounds[s + 1]]) or (0.0,) for s in range(len(bounds) - 1)]
    return StageBytes(tuple(stages))


def lowered_pipeline(resolution: Resolution, grid: Grid, fsdp: FSDPOptions | None) -> LoweredSchedule:
    """``resolution``'s schedule lowered under ``grid`` and ``fsdp`` and validated (module docstring);
    raises :class:`PipelineError` saying what the check found."""
    schedule = resolution.schedule
    # the expert-parallel ranks are replicas: every parameter but the experts' is averaged over them
    # too, in the buckets the lowering places for the data-parallel replicas (..parallel.experts)
    grid = replace(grid, dp=grid.replicas) if grid.ep > 1 else grid
    try:
        lowered = lower(schedule, fsdp or ONCE_PER_STEP, grid=grid, model=stage_bytes(resolution))
        validate_lowered(lowered)
    except ScheduleError as error:  # LoweringError and LoweredDeadlock included
        raise PipelineError(
            f"the lowered program of schedule {schedule.name!r} ({grid.dp_mode} data parallelism, "
            f"{(fsdp or ONCE_PER_STEP).describe(grid.dp_mode)}) failed its check before the first step: "
            f"{error} — nothing ran; this is a bug of the lowering or of a custom schedule: report it"
        ) from error
    return lowered
