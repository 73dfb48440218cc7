"""``Pipeline(schedule="auto")``: profile, plan once, broadcast, so every rank runs the same plan.

:func:`plan_for_pipeline` is called by the Pipeline before it places any layer.  Ranks 0 and 1 of
the group time a transfer (:func:`~.profile.measure_transfer`); rank 0 profiles the layers on the
first microbatch of the example batch (on copies: the model, its gradients and the random state are
untouched) and runs :func:`zerobubble.schedule.plan.plan`; the resulting :class:`Plan` — or the
error saying why nothing fits — is broadcast, so every rank either runs the same schedule and
partition or raises the same :class:`PipelineError` before allocating anything.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..schedule import ScheduleError
from ..schedule.plan import ModelProfile, Plan, plan
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
    payload: list[Any] = [None]
    if dist.get_rank(group) == 0:
        payload[0] = _decide(
            named, example, loss_fn, ranks, microbatches, memory_limit, post_validation, device, comm, repeats
        )
    source = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(payload, src=source, group=group, device=_object_device(device))
    outcome = payload[0]
    if isinstance(outcome, str):
        raise PipelineError(f'schedule="auto" cannot run: {outcome}')
    return outcome


def _decide(
    named: Sequence[tuple[str, nn.Module]],
    example: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    ranks: int,
    microbatches: int,
    memory_limit: str | float | None,
    post_validation: bool,
    device: torch.device,
    comm: tuple[float, float],
    repeats: int,
) -> tuple[Plan, ModelProfile] | str:
    """Rank 0's profile and plan, or the message of the error every rank will raise."""
    try:
        inputs, targets = (_first_microbatch(part, microbatches) for part in example)
        profile = profile_layers(named, inputs, targets, loss_fn, device, repeats, comm=comm)
        device_memory = (
            float(torch.cuda.get_device_properties(device).total_memory) if device.type == "cuda" else None
        )
        optimizer = "post-validation" if post_validation else "sync"
        return plan(
            profile, ranks, microbatches, memory_limit, optimizer=optimizer, device_memory=device_memory
        ), profile
    except (ScheduleError, PipelineError) as error:
        return str(error)
    except Exception as error:  # every rank must learn of it, or the others wait in the broadcast
        return f"profiling the layers failed: {type(error).__name__}: {error}"


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
