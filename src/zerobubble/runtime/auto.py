"""``Pipeline(schedule="auto")``: profile, plan once, broadcast, so every rank runs the same plan.

:func:`plan_for_pipeline` is called by the Pipeline before it places any layer.  Ranks 0 and 1 of
the group time a transfer (:func:`~.profile.measure_transfer`); every rank profiles the layers on the
first microbatch of the example batch at the same time (on copies: the model, its gradients and the
random state are untouched), so the ranks contend for the machine as they will in the run; rank 0
takes the median of each time over the ranks and runs :func:`zerobubble.schedule.plan.plan`; the
resulting :class:`Plan` — or the error saying why nothing fits — is broadcast, so every rank either
runs the same schedule and partition or raises the same :class:`PipelineError` before allocating
anything.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..schedule import ScheduleError
from ..schedule.plan import ModelProfile, Plan, median_profile, plan
from . import PipelineError
from .profile import measure_transfer, profile_layers


def plan_for_pipeline(
    named: Sequence[tuple[str, nn.Module]],
    example: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    group: dist.ProcessGroup | None,
    ranks: int,
    microbatches: int,
    memory_limit: str | float | None,
    post_validation: bool,
    device: torch.device,
    repeats: int = 5,
) -> tuple[Plan, ModelProfile]:
    """The plan every rank of ``group`` agrees on, and the profile it came from (collective).

    ``example`` is one batch as :meth:`Pipeline.step` takes it, ``(inputs, targets)``; ``ranks`` is the
    pipeline's size.  Raises :class:`PipelineError` on every rank when no schedule fits the budget.
    """
    if example is None or not isinstance(example, (tuple, list)) or len(example) != 2:
        raise PipelineError(
            'schedule="auto" profiles the layers before placing them: pass example=(inputs, targets), one '
            "batch as step() takes it"
        )
    comm = measure_transfer(group, device)
    # every rank profiles at once: the ranks then contend for the machine as they will in the run
    mine = _profile_here(named, example, loss_fn, microbatches, device, comm, repeats)
    rank, source = dist.get_rank(group), dist.get_global_rank(group, 0) if group is not None else 0
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(mine, gathered, dst=source, group=group)
    payload: list[Any] = [None]
    if gathered is not None:
        payload[0] = _decide(gathered, ranks, microbatches, memory_limit, post_validation, device)
    dist.broadcast_object_list(payload, src=source, group=group, device=_object_device(device))
    outcome = payload[0]
    if isinstance(outcome, str):
        raise PipelineError(f'schedule="auto" cannot run: {outcome}')
    return outcome


def _profile_here(
    named: Sequence[tuple[str, nn.Module]],
    example: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    microbatches: int,
    device: torch.device,
    comm: tuple[float, float],
    repeats: int,
) -> ModelProfile | str:
    """This rank's profile of the layers on the first microbatch, or why it failed."""
    try:
        inputs, targets = (_first_microbatch(part, microbatches) for part in example)
        return profile_layers(named, inputs, targets, loss_fn, device, repeats, comm=comm)
    except PipelineError as error:
        return str(error)
    except Exception as error:  # every rank must learn of it, or the others wait in the collectives
        return f"profiling the layers failed on rank {dist.get_rank()}: {type(error).__name__}: {error}"


def _decide(
    profiles: Sequence[ModelProfile | str],
    ranks: int,
    microbatches: int,
    memory_limit: str | float | None,
    post_validation: bool,
    device: torch.device,
) -> tuple[Plan, ModelProfile] | str:
    """Rank 0's plan from every rank's profile (median times), or the message every rank will raise."""
    failures = [outcome for outcome in profiles if isinstance(outcome, str)]
    if failures:
        return failures[0]
    try:
        profile = median_profile(profiles)  # type: ignore[arg-type]  # no str left
        device_memory = (
            float(torch.cuda.get_device_properties(device).total_memory) if device.type == "cuda" else None
        )
        optimizer = "post-validation" if post_validation else "sync"
        chosen = plan(
            profile, ranks, microbatches, memory_limit, optimizer=optimizer, device_memory=device_memory
        )
        return chosen, profile
    except ScheduleError as error:
        return str(error)


def _first_microbatch(batch: Any, microbatches: int) -> Any:
    tensors = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
    for tensor in tensors:
        if tensor.dim() == 0 or tensor.shape[0] % microbatches:
            raise PipelineError(
                f"the example batch of size {tensor.shape[0] if tensor.dim() else 'a scalar'} does not split "
                f"into {microbatches} equal microbatches"
            )
    pieces = tuple(t[: t.shape[0] // microbatches] for t in tensors)
    return pieces[0] if isinstance(batch, torch.Tensor) else pieces


def _object_device(device: torch.device) -> torch.device | None:
    return device if device.type == "cuda" else None
