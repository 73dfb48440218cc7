"""The user-facing :class:`Pipeline`: one script on every rank, one ``step`` per batch.

.. code-block:: python

    pipe = zerobubble.Pipeline(layers, schedule="zb-v", microbatches=8, loss_fn=F.cross_entropy)
    optimizer = torch.optim.AdamW(pipe.parameters())
    loss = pipe.step(inputs, targets)   # mean loss where the last stage lives, else None
    pipe.optimizer_step(optimizer, max_norm=1.0)   # clipped, post-validated; then zero the grads
    optimizer.zero_grad(set_to_none=True)

The layers are cut into ``p·v`` chunks (evenly, or at the cut points of ``partition``), placed by the
schedule's placement, and only this rank's chunks are kept.  Parameter names stay those of
``layers`` (``"3.mlp.fc.weight"``), so checkpoints are interchangeable with the unpipelined model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..schedule import CostModel, Schedule, ScheduleError, build_schedule, validate_schedule
from ..schedule.partition import even_partition
from . import PipelineError
from .comm import Comm, directed_pairs
from .data_parallel import (
    GradientAverager,
    chunk_parameters,
    create_layout,
    first_forward,
    hook_program,
    last_gradient_ops,
)
from .executor import Executor, StageState
from .launch import init_distributed, local_device
from .optim import OptimizerStats, PipelineOptimizer, validation_chain
from .wgrad import WeightGradStore, install_deferral


class StageModule(nn.Module):
    """A contiguous run of layers; a layer returning a tuple passes it unpacked to the next one."""

    def __init__(self, layers: Sequence[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, *inputs: torch.Tensor) -> Any:
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

    ``schedule="auto"`` chooses the schedule, chunk count and partition from measurement
    (:mod:`.auto`): every rank profiles the layers on the first microbatch of ``example`` (one batch,
    ``(inputs, targets)``), rank 0 plans under ``memory_limit`` bytes per rank (``"24GiB"``, or
    ``"80%"`` of a GPU's memory) and broadcasts the plan; :attr:`plan` then says what was chosen and why.

    ``trace=True`` records the start and end of every op and transfer wait of the last steps
    (:mod:`.trace`); :meth:`write_trace` then writes the measured timeline next to the simulator's
    prediction.  ``emulate=costs`` (a CostModel in milliseconds) stretches every op to its modelled
    duration while real tensors still flow (:mod:`.emulate`), to measure the runtime's own overhead.

    ``data_parallel = D`` runs ``D`` replicas of a ``p``-rank pipeline over the ``p·D`` ranks of
    ``group`` (group rank ``dp_index · p + pipeline rank``, see :mod:`.data_parallel`); each replica
    steps on its shard of the batch and the gradients are averaged over the replicas, chunk by
    chunk as soon as a chunk's last weight-gradient op has run.  :meth:`optimizer_step` clips and
    steps with optimizer post-validation (:mod:`.optim`); ``post_validation=False`` makes it a
    plain synchronous step.

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
        trace: bool = False,
        emulate: CostModel | None = None,
        data_parallel: int = 1,
        post_validation: bool = True,
        memory_limit: str | float | None = None,
        example: Any = None,
    ):
        if loss_fn is None:
            raise PipelineError("Pipeline needs a loss_fn(output, target) returning a scalar tensor")
        backend = init_distributed(timeout=timeout) if group is None else dist.get_backend(group)
        self.layout = create_layout(group, data_parallel, timeout)  # collective: new_group
        outer, group = group, self.layout.pipeline_group
        self.group = group
        self.rank = self.layout.pipeline_rank
        self.world_size = self.layout.pipeline_size
        self.device = local_device(backend)
        named = _named_layers(layers)
        self.plan: Any = None  # the Plan of schedule="auto", and the ModelProfile it came from
        self.profile: Any = None
        if isinstance(schedule, str) and schedule == "auto":  # profile, plan once, broadcast: .auto
            from .auto import plan_for_pipeline

            self.plan, self.profile = plan_for_pipeline(
                named,
                example,
                loss_fn,
                outer,
                self.world_size,
                microbatches or 8,
                memory_limit,
                post_validation,
                self.device,
            )
            schedule, partition, costs = self.plan.schedule, self.plan.partition, self.plan.costs
            microbatches = chunks = None
        self.schedule, self.timeline = _resolve_schedule(
            schedule, self.world_size, microbatches, chunks, costs
        )
        self.module = nn.Module()
        stages = self._place(named, partition)
        self.stages = tuple(sorted(stages))
        with self.layout.replicated(directed_pairs(self.schedule)):
            comm = Comm(self.schedule, group, self.device, timeout, static_shapes)
        self._executor = Executor(self.schedule, self.rank, stages, comm, loss_fn)
        if emulate is not None:  # each op lasts its modelled duration (ms), see .emulate
            from .emulate import install_emulation

            install_emulation(self._executor, emulate)
        if trace:  # record every op and wait of the last steps, see .trace
            from .trace import TraceRecorder

            self.recorder = TraceRecorder(self.device)
        self._first, self._last = 0 in stages, self.schedule.num_stages - 1 in stages
        self._init_optimization(post_validation)

    def _place(
        self, named: list[tuple[str, nn.Module]], partition: Sequence[int] | None
    ) -> dict[int, StageState]:
        """Cut the layers into chunks and keep this rank's, registered under their original names."""
        bounds = _partition_bounds(len(named), self.schedule.num_stages, partition)
        self.layer_bounds = tuple(bounds)  # chunk s holds layers [bounds[s], bounds[s + 1])
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
                index,
                StageModule(layers),
                store,
                first=index == 0,
                last=index == self.schedule.num_stages - 1,
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
        """An optional object timing every op (``op(op, start, end)``) and wait (``wait(key, ...)``)."""
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

        With ``data_parallel = D`` each replica passes its own shard of the global batch (equal
        shards); the gradients are then averaged over the replicas (those of the mean loss over the
        global batch) and the returned loss is the global batch's mean.  A pending optimizer step
        (:meth:`optimizer_step`) is settled just before this rank's first forward reads the
        parameters.
        """
        m = self.schedule.microbatches
        split_inputs = _split(inputs, m, "inputs", self.device)
        split_targets = _split(targets, m, "targets", self.device)
        if self._first and split_inputs is None:
            raise PipelineError(f"rank {self.rank} holds the first stage: pass the batch inputs to step()")
        if self._last and split_targets is None:
            raise PipelineError(f"rank {self.rank} holds the last stage: pass the targets to step()")
        targets_mb = [t[0] if len(t) == 1 else t for t in split_targets] if split_targets else ()
        losses = self._run_program(split_inputs or (), targets_mb)
        return self._mean_loss(losses) if self._last else None

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
        local = set(self.module.state_dict())
        return self.module.load_state_dict({k: v for k, v in state_dict.items() if k in local}, strict=strict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of this rank's parameters."""
        self.module.zero_grad(set_to_none=set_to_none)

    # -- recorded timelines (trace=True) ------------------------------------------------------------

    def measured_timelines(self) -> list[Any] | None:
        """The recorded steps as :class:`~.trace.MeasuredTimeline` objects on rank 0, None elsewhere.

        Collective (every rank calls it); needs ``trace=True`` or another recorder with ``seconds()``.
        """
        from .trace import gather_timelines

        if not hasattr(self.recorder, "seconds"):
            raise PipelineError("no timeline was recorded: build the Pipeline with trace=True")
        return gather_timelines(self.recorder, self.schedule, self.group, self.device)

    def write_trace(self, directory: Any) -> Any:
        """Write the recorded timeline, the prediction and a picture to ``directory`` (collective).

        See :func:`~.trace.write_trace`; returns its report on rank 0, None elsewhere.
        """
        from .trace import write_trace

        return write_trace(self, directory)

    # -- optimizer step and data parallelism --------------------------------------------------------

    @property
    def data_parallel(self) -> int:
        """Number of pipeline replicas (``D``); this rank is pipeline rank ``self.rank`` of replica
        ``self.layout.dp_index`` (group rank ``dp_index · p + rank``)."""
        return self.layout.data_parallel

    def optimizer_step(self, optimizer: torch.optim.Optimizer, max_norm: float | None = None) -> None:
        """Clip the gradients to ``max_norm`` over the whole model and step, or skip on Inf/NaN.

        Call it on every rank after :meth:`step`, where ``optimizer.step()`` would be; ``optimizer``
        holds this rank's parameters.  The result is that of ``clip_grad_norm_(all parameters,
        max_norm)`` + ``optimizer.step()`` on the whole model (no step at all when a gradient
        anywhere is not finite).  With post-validation (the default) the global norm is reduced
        point to point along the ranks, each rank steps optimistically when its partial state
        allows, and the step is confirmed — or rolled back in place and redone — during the next
        :meth:`step` (before its first forward) or at :meth:`synchronize`; no collective over the
        pipeline runs here.  ``post_validation=False`` steps after one all-reduce of the norm.
        ``zero_grad(set_to_none=True)`` may follow at once; gradients must not be changed in place
        before the step is settled.  Counters: :attr:`optimizer_stats`.
        """
        self._optimizer.step(optimizer, max_norm)

    def synchronize(self) -> None:
        """Settle a pending optimizer step now (collective over the pipeline: every rank calls it).

        Afterwards parameters and optimizer state are final — call it before reading them outside
        the training loop (checkpoints, ``state_dict``, evaluation, the end of training).
        """
        self._optimizer.close()

    @property
    def optimizer_stats(self) -> OptimizerStats:
        """Counters of this rank's settled optimizer steps (steps, clipped, skipped, rolled back)."""
        return self._optimizer.stats

    def _init_optimization(self, post_validation: bool) -> None:
        """Chain the ranks for the optimizer step; plan the data-parallel reductions and the op hooks."""
        layout, program = self.layout, self.schedule.programs[self.rank]
        finish_times = [ends[-1] if ends else 0.0 for ends in self.timeline.end]
        chain = [layout.global_rank(rank) for rank in validation_chain(finish_times)]
        self._optimizer = PipelineOptimizer(
            chain, layout.global_rank(self.rank), layout.control_group, post_validation, self.device
        )
        self._averager: GradientAverager | None = None
        after: dict[int, Callable[[], None]] = {}
        if layout.data_parallel > 1:
            last_ops = last_gradient_ops(program)
            chunks = chunk_parameters(self._executor.stages, last_ops)
            self._averager = GradientAverager(chunks, layout.dp_group, layout.data_parallel)
            after = {
                position: functools.partial(self._averager.start, stage)
                for stage, position in last_ops.items()
            }
        self._hooks = ({first_forward(program): self._optimizer.finish}, after)
        self._hooked_program: list | None = None

    def _run_program(
        self, inputs: Sequence[tuple[torch.Tensor, ...]], targets: Sequence[Any]
    ) -> list[torch.Tensor]:
        """Run the executor's program with the Pipeline's hooks; average gradients over the replicas."""
        executor = self._executor
        if executor.program is not self._hooked_program:  # first step, or compile() rebuilt it
            executor.program = self._hooked_program = hook_program(executor.program, *self._hooks)
        try:
            losses = executor.run_step(inputs, targets)
        except BaseException:
            if self._averager is not None:
                self._averager.discard()
            raise
        if self._averager is not None:
            self._averager.finish()
        return losses

    def _mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The step's mean loss, over the global batch when there are several replicas."""
        mean = torch.stack(losses).mean()
        if self.layout.data_parallel > 1:
            dist.all_reduce(mean, group=self.layout.dp_group)
            mean /= self.layout.data_parallel
        return mean


def _resolve_schedule(
    schedule: str | Schedule,
    world: int,
    microbatches: int | None,
    chunks: int | None,
    costs: CostModel | None,
) -> tuple[Schedule, Any]:
    try:
        if isinstance(schedule, str):
            built = build_schedule(
                schedule, world, microbatches or 8, costs=costs, chunks=chunks, validate=False
            )
        else:
            built = schedule
            if microbatches is not None and microbatches != built.microbatches:
                raise PipelineError(
                    f"the schedule object runs {built.microbatches} microbatches but "
                    f"microbatches={microbatches} was given; drop the argument or build the schedule "
                    "for that count"
                )
        if built.num_ranks != world:
            raise PipelineError(
                f"schedule {built.name!r} needs {built.num_ranks} ranks but the process group has {world}; "
                f"start {built.num_ranks} ranks or build the schedule for {world}"
            )
        return built, validate_schedule(built, costs)
    except ScheduleError as error:
        raise PipelineError(
            f"schedule {getattr(schedule, 'name', schedule)!r} cannot run: {error}"
        ) from error


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
            raise PipelineError(
                f"{count} layers cannot fill {stages} pipeline chunks; give at least {stages}"
            )
        return [0, *even_partition(count, stages), count]
    cuts = [int(c) for c in partition]
    bounds = [0, *cuts, count]
    if len(cuts) != stages - 1 or any(b >= a for a, b in zip(bounds[1:], bounds)):
        raise PipelineError(
            f"partition must list {stages - 1} strictly increasing layer indices in 1..{count - 1} "
            f"(where chunks 1..{stages - 1} start); got {list(partition)}"
        )
    return bounds


def _split(
    batch: Any, microbatches: int, what: str, device: torch.device
) -> list[tuple[torch.Tensor, ...]] | None:
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
