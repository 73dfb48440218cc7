"""The user-facing :class:`Pipeline`: one script on every rank, one ``step`` per batch.

.. code-block:: python

    pipe = zerobubble.Pipeline(layers, schedule="zb-v", microbatches=8, loss_fn=F.cross_entropy)
    optimizer = torch.optim.AdamW(pipe.parameters())
    loss = pipe.step(inputs, targets)   # mean loss where the last stage lives, else None
    optimizer.step(); optimizer.zero_grad()

The layers are cut into ``p·v`` chunks (evenly, or at the cut points of ``partition``), placed by the
schedule's placement, and only this rank's chunks are kept.  Parameter names stay those of
``layers`` (``"3.mlp.fc.weight"``), so checkpoints are interchangeable with the unpipelined model.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..schedule import CostModel, Schedule, ScheduleError, build_schedule, validate_schedule
from . import PipelineError
from .comm import Comm
from .executor import Executor, StageState
from .launch import init_distributed, local_device
from .wgrad import WeightGradStore, install_deferral

class StageModule:
    """A contiguous run of layers; a layer returning a tuple passes it unpacked to the next one."""

    def __init__(self, layers: Sequence[nn.Module]):
        self.layers = list(layers)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        values: Any = inputs
        for layer in self.layers:
            values = layer(*values) if isinstance(values, tuple) else layer(values)
        return values


class Pipeline:
    """Pipeline-parallel training of ``layers`` with any schedule of the registry.

    ``schedule`` is a registry name or a :class:`Schedule` (``microbatches`` and ``chunks`` then come
    from it).  ``chunks`` sets v for schedules that take it; ``partition`` lists the ``S−1`` layer
    indices where a new chunk starts; ``costs`` goes to the builder (cost-aware schedules) and the
    validator; ``timeout`` (seconds) bounds every wait on another rank.  ``group`` is the process
    group of the pipeline (the default group when None; it is initialised from the environment if
    needed); its channels are created with ``new_group``, so every rank of the world constructs the
    Pipeline.  With ``static_shapes`` the tensors crossing stage boundaries keep the shapes of the
    first step, which lets receives be posted ahead of time.

    Only this rank's layers are referenced after construction (moved to its device); the others
    are freed once the caller drops ``layers``.  Linear layers of a schedule with W ops compute
    their weight gradients in W (:mod:`.wgrad`); their type and parameter names do not change.
    """

    def __init__(
        self,
        layers: nn.Sequential | Sequence[nn.Module],
        schedule: str | Schedule = "zb-v",
        microbatches: int | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        chunks: int | None = None,
        partition: Sequence[int] | None = None,
        group: dist.ProcessGroup | None = None,
        costs: CostModel | None = None,
        timeout: float = 300.0,
        static_shapes: bool = True,
    ):
        if loss_fn is None:
            raise PipelineError("Pipeline needs a loss_fn(output, target) returning a scalar tensor")
        backend = init_distributed(timeout=timeout) if group is None else dist.get_backend(group)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = local_device(backend)
        self.schedule, self.timeline = _resolve_schedule(schedule, self.world_size, microbatches, chunks, costs)
        self.module = nn.Module()
        stages = self._place(_named_layers(layers), partition)
        self.stages = tuple(sorted(stages))
        comm = Comm(self.schedule, group, self.device, timeout, static_shapes)
        self._executor = Executor(self.schedule, self.rank, stages, comm, loss_fn)
        self._first, self._last = 0 in stages, self.schedule.num_stages - 1 in stages

    def _place(self, named: list[tuple[str, nn.Module]], partition: Sequence[int] | None) -> dict[int, StageState]:
        """Cut the layers into chunks and keep this rank's, registered under their original names."""
        bounds = _partition_bounds(len(named), self.schedule.num_stages, partition)
        stages = {}
        for index in self.schedule.placement.stages_of(self.rank):
            chunk = named[bounds[index] : bounds[index + 1]]
            for name, layer in chunk:
                self.module.add_module(name, layer.to(self.device))
            layers = [layer for _, layer in chunk]
            store = WeightGradStore()
            if self.schedule.splits_backward:
                install_deferral(layers, store)
            stages[index] = StageState(
                index, StageModule(layers), store, first=index == 0, last=index == self.schedule.num_stages - 1,
                name=f"layers {chunk[0][0]}..{chunk[-1][0]}",
            )
        return stages

    # -- training ----------------------------------------------------------------------------------

    @property
    def holds_loss(self) -> bool:
        """True on the rank of the last stage (the one whose :meth:`step` returns the loss)."""
        return self._last

    @property
    def recorder(self) -> Any:
        """An optional object timing every op (``op(op, start, end)``) and wait (``wait(key, start, end)``)."""
        return self._executor.recorder

    @recorder.setter
    def recorder(self, recorder: Any) -> None:
        self._executor.recorder = recorder
        self._executor.comm.recorder = recorder

    def step(self, inputs: Any = None, targets: Any = None) -> torch.Tensor | None:
        """Forward and backward of one batch, split into microbatches, in the schedule's order.

        ``inputs`` (a tensor or tuple of tensors) is used where the first stage lives, ``targets``
        where the last one lives; both are split along dimension 0.  Gradients are accumulated into
        ``.grad`` as ``loss_fn(model(inputs), targets).backward()`` would.  Returns the mean of the
        microbatch losses on the rank of the last stage, ``None`` elsewhere.
        """
        m = self.schedule.microbatches
        split_inputs = _split(inputs, m, "inputs", self.device)
        split_targets = _split(targets, m, "targets", self.device)
        if self._first and split_inputs is None:
            raise PipelineError(f"rank {self.rank} holds the first stage: pass the batch inputs to step()")
        if self._last and split_targets is None:
            raise PipelineError(f"rank {self.rank} holds the last stage: pass the targets to step()")
        targets_mb = [t[0] if len(t) == 1 else t for t in split_targets] if split_targets else ()
        losses = self._executor.run_step(split_inputs or (), targets_mb)
        return torch.stack(losses).mean() if self._last else None

    # -- parameters ----------------------------------------------------------------------------------

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters."""
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters, named as in ``layers`` (``"3.mlp.fc.weight"``)."""
        return self.module.named_parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers under the names they have in ``layers``."""
        return self.module.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> Any:
        """Load this rank's entries of a (whole-model or per-rank) state dict.

        Keys of layers this rank does not hold are ignored, so the full model's checkpoint works.
        """
        local = {name for name in self.module.state_dict()}
        return self.module.load_state_dict({k: v for k, v in state_dict.items() if k in local}, strict=strict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of this rank's parameters."""
        self.module.zero_grad(set_to_none=set_to_none)


def _resolve_schedule(
    schedule: str | Schedule, world: int, microbatches: int | None, chunks: int | None, costs: CostModel | None
) -> tuple[Schedule, Any]:
    try:
        if isinstance(schedule, str):
            built = build_schedule(schedule, world, microbatches or 8, costs=costs, chunks=chunks, validate=False)
        else:
            built = schedule
            if microbatches is not None and microbatches != built.microbatches:
                raise PipelineError(
                    f"the schedule object runs {built.microbatches} microbatches but microbatches={microbatches} "
                    "was given; drop the argument or build the schedule for that count"
                )
        if built.num_ranks != world:
            raise PipelineError(
                f"schedule {built.name!r} needs {built.num_ranks} ranks but the process group has {world}; "
                f"start {built.num_ranks} ranks or build the schedule for {world}"
            )
        return built, validate_schedule(built, costs)
    except ScheduleError as error:
        raise PipelineError(f"schedule {getattr(schedule, 'name', schedule)!r} cannot run: {error}") from error


def _named_layers(layers: nn.Sequential | Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    if isinstance(layers, nn.Sequential):
        return list(layers.named_children())
    named = [(str(index), layer) for index, layer in enumerate(layers)]
    for name, layer in named:
        if not isinstance(layer, nn.Module):
            raise PipelineError(f"layer {name} is a {type(layer).__name__}, not an nn.Module")
    return named


def _partition_bounds(count: int, stages: int, partition: Sequence[int] | None) -> list[int]:
    """Start index of every chunk, plus ``count`` at the end."""
    if partition is None:
        if count < stages:
            raise PipelineError(f"{count} layers cannot fill {stages} pipeline chunks; give at least {stages}")
        base, extra = divmod(count, stages)
        bounds = [0]
        for stage in range(stages):
            bounds.append(bounds[-1] + base + (1 if stage < extra else 0))
        return bounds
    cuts = [int(c) for c in partition]
    bounds = [0, *cuts, count]
    if len(cuts) != stages - 1 or any(b >= a for a, b in zip(bounds[1:], bounds)):
        raise PipelineError(
            f"partition must list {stages - 1} strictly increasing layer indices in 1..{count - 1} "
            f"(where chunks 1..{stages - 1} start); got {list(partition)}"
        )
    return bounds


def _split(batch: Any, microbatches: int, what: str, device: torch.device) -> list[tuple[torch.Tensor, ...]] | None:
    if batch is None:
        return None
    tensors = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
    for tensor in tensors:
        if tensor.dim() == 0 or tensor.shape[0] % microbatches:
            size = tensor.shape[0] if tensor.dim() else "a scalar"
            raise PipelineError(
                f"the {what} batch of size {size} does not split into {microbatches} equal microbatches; "
                f"use a batch size that is a multiple of {microbatches}"
            )
    pieces = [t.to(device, non_blocking=True).chunk(microbatches) for t in tensors]
    return [tuple(piece[j] for piece in pieces) for j in range(microbatches)]
