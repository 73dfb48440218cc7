"""The user-facing :class:`Pipeline`: one script on every rank, one ``step`` per batch.

.. code-block:: python

    pipe = zerobubble.Pipeline(layers, schedule="zb-v", microbatches=8, loss_fn=F.cross_entropy)
    optimizer = torch.optim.AdamW(pipe.parameters())
    loss = pipe.step(inputs, targets)   # mean loss where the last stage lives, else None
    pipe.optimizer_step(optimizer, max_norm=1.0)   # clipped, post-validated; then zero the grads
    optimizer.zero_grad(set_to_none=True)

The layers are cut into ``p·v`` chunks (evenly, or at the cut points of ``partition``), placed by the
schedule's placement, and only this rank's chunks are kept.  Parameter names stay those of
``layers`` (``"3.mlp.fc.weight"``): the union of the ranks' ``state_dict()`` is the unpipelined
model's, tied aliases included, and the unpipelined model's loads on every rank (:mod:`.checkpoint`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import torch
import torch.distributed as dist
from torch import nn

from ..schedule import CostModel, Schedule, Timeline
from ..schedule.sharding import FSDPOptions
from . import PipelineError
from .construct.build import place_stages, tie_parameters
from .construct.compiled import prepare_layers
from .construct.construction import World, agreed_resolution, planned_resolution, run_options, world_of
from .construct.lowering import lowered_pipeline
from .construct.pipeline_calls import PipelineCalls, call_results
from .construct.request import PipelineRequest
from .construct.resolve import LossFn, Resolution
from .construct.staging import layer_keywords
from .execute.comm import Comm
from .execute.executor import Executor, StageState
from .failures import PeerFailure, PeerMonitor
from .observe.recorder import OpRecorder, as_recorder
from .optim.post_validation import OptimizerStats
from .optim.step import StepOptimization, averager_of
from .parallel.consistency import CallCheck
from .parallel.data_parallel import build_layout
from .parallel.experts import broadcast_replicas, expert_sharding
from .parallel.fsdp import ShardedStages
from .parallel.groups import local_group
from .parallel.mesh import data_mesh
from .state.checkpoint import model_keys
from .state.pipeline_state import PipelineState
from .vocab.layers import VocabParallelEmbedding, VocabParallelHead
from .vocab.runner import VocabRunner, check_vocab_grid, place_vocab
from .wgrad import FastPaths
from .wgrad.verify import SplitRecord

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ..schedule.modelplan import ModelProfile, Plan
    from .observe.trace import MeasuredTimeline, TraceReport

logger = logging.getLogger(__name__)


class Pipeline:
    """Pipeline-parallel training of ``layers`` with any schedule of the registry, on every rank.

    ``schedule``: a registry name (with ``microbatches`` and ``chunks``), a :class:`Schedule`, or
    ``"auto"`` — profile, plan under ``memory_limit`` from ``example``, broadcast (:mod:`.auto`;
    :attr:`plan` says what and why).  ``partition`` cuts the layers (``"profile"``: where a profile
    says); ``costs`` goes to the builder and the validator; ``timeout`` bounds every wait.
    ``group`` or ``mesh`` (a ``DeviceMesh``: ``"pp"``, ``"dp"`` or ``"dp_replicate"`` ×
    ``"dp_shard"``, and dimensions inside a stage such as ``"tp"``, :mod:`.mesh`) lays out the
    ranks; ``data_parallel`` is a replica count, or on a mesh ``"replicate"``, ``"fsdp"`` (FSDP2,
    :mod:`.fsdp`; ``fsdp=FSDPOptions(...)``: per-layer units, ZeRO-3) or ``"hsdp"``.
    ``parallelize(layer, mesh)`` applies tensor parallelism to each layer on its device; ``compile``
    compiles the layers; ``head``, ``embedding`` are vocabulary-parallel layers.  :meth:`step` runs one batch,
    :meth:`optimizer_step` clips and steps (post-validated unless ``post_validation=False``),
    :meth:`evaluate` runs forward only; the state-dict methods checkpoint by the unpipelined
    model's names (:mod:`.pipeline_state`).  ``trace`` records the last steps' ops, ``emulate``
    stretches each op to a modelled duration; ``fast_paths`` adds split rules, ``verify`` sets the
    split guard, ``check_calls=False`` skips the per-call comparison, ``seed`` roots the forwards'
    RNG streams, ``static_shapes`` lets receives be posted ahead, ``overlap`` runs each overlapped
    F&B pair (:mod:`.execute.pairs`; ``"threads"``: two threads).  Arguments after ``layers``: keyword-only.

    Construction records the arguments as one checked :class:`~.construct.request.PipelineRequest`
    (:attr:`request`), resolves it into one :class:`~.resolve.Resolution` every rank agrees
    on (:mod:`.construction`), then builds this rank's part (:mod:`.build`): the layers' state,
    optimisation (:mod:`.pipeline_optimization`) and checkpoints each live in an object of their
    own, this class is the facade.  Every argument, with its guarantees: ``docs/guide.md``
    ("The Pipeline's arguments"); the failure semantics: ``docs/failure-semantics.md``.
    """

    def __init__(
        self,
        layers: nn.Sequential | Sequence[nn.Module],
        *,
        schedule: str | Schedule = "zb-v",
        microbatches: int | None = None,
        loss_fn: LossFn | None = None,
        chunks: int | None = None,
        partition: Sequence[int] | str | None = None,
        group: dist.ProcessGroup | None = None,
        costs: CostModel | None = None,
        timeout: float = 300.0,
        static_shapes: bool = True,
        trace: bool = False,
        emulate: CostModel | None = None,
        data_parallel: int | str | None = None,
        mesh: DeviceMesh | None = None,
        mesh_dims: Mapping[str, str] | None = None,
        post_validation: bool = True,
        seed: int | None = None,
        fast_paths: FastPaths | None = None,
        memory_limit: str | float | None = None,
        example: Any = None,
        calibrate: int = 3,
        verify: bool | str = True,
        check_calls: bool = True,
        parallelize: Callable[[nn.Module, Any], nn.Module] | None = None,
        compile: bool | Mapping[str, Any] = False,
        head: VocabParallelHead | None = None,
        embedding: VocabParallelEmbedding | None = None,
        fsdp: FSDPOptions | None = None,
        overlap: Callable[[Any], None] | str | None = None,
    ):
        # checked as it is made: a wrong argument raises here, on every rank, before any collective
        request = PipelineRequest(
            layers=layers, schedule=schedule, microbatches=microbatches, loss_fn=loss_fn, chunks=chunks,
            partition=partition, group=group, costs=costs, timeout=timeout, static_shapes=static_shapes,
            trace=trace, emulate=emulate, data_parallel=data_parallel, mesh=mesh, mesh_dims=mesh_dims,
            post_validation=post_validation, seed=seed, fast_paths=fast_paths, memory_limit=memory_limit,
            example=example, calibrate=calibrate, verify=verify, check_calls=check_calls, overlap=overlap,
            parallelize=parallelize, compile=compile, head=head, embedding=embedding, fsdp=fsdp,
        )  # fmt: skip
        self._request = request
        # the request as the construction reads it: its layers compiled and unwrapped (.compiled)
        asked = replace(request, layers=prepare_layers(request.layers, request.compile))
        # collective: joins the group or the mesh (their arguments checked first, alike on every rank)
        world = world_of(asked)
        check_vocab_grid(asked.head, asked.embedding, world.grid)  # alike on every rank, no group made yet
        self.device: torch.device = world.device
        self.timeout = asked.timeout
        self.sharding: str | None = world.grid.sharding  # "fsdp", "hsdp", or None: replicated
        self._failure: str | None = None
        self._recorder: OpRecorder | None = None
        planned, self._calibrator, self._vocab_layers = planned_resolution(asked, world)  # collective: plans
        resolution, self._agreement = agreed_resolution(asked, world, planned)  # collective: every rank's
        self._build(resolution, world)
        self._build_recording()
        self._build_facets(resolution)

    @property
    def request(self) -> PipelineRequest:
        """What was asked of this Pipeline: its layers and keyword arguments, as one frozen, checked
        record (:class:`~.construct.request.PipelineRequest`)."""
        return self._request

    def _build(self, resolution: Resolution, world: World) -> None:
        """Build this rank's part of the agreed ``resolution`` (collective: the layout's, the call
        check's, the ties' and the channels' groups); nothing is resolved or validated here."""
        self.resolution = resolution
        self.schedule: Schedule = resolution.schedule
        self.timeline: Timeline = resolution.timeline
        self.layer_bounds = resolution.bounds  # chunk s holds layers [bounds[s], bounds[s + 1])
        self.plan: Plan | None = resolution.plan  # schedule="auto": what was chosen and why
        self.profile: ModelProfile | None = resolution.profile  # and the layer profile it came from
        logger.info("%s", resolution.describe())
        self.lowered = lowered_pipeline(resolution, world.grid, run_options(self._request, resolution))
        self._build_groups(world)
        self._model_keys = model_keys(resolution.layers)  # the unpipelined state dict's keys
        self._ties = [tuple(name for _, name in tie) for tie in resolution.ties]
        # the keywords every layer of the model takes (step(**kwargs)): read before any is placed
        self._keywords = [(name, layer_keywords(layer)) for name, layer in resolution.layers]
        stages = self._place(resolution)
        self._build_executor(resolution, stages)

    def _build_groups(self, world: World) -> None:
        """The layout's process groups, the peer monitor and the per-call check's group (collective)."""
        self.layout = build_layout(
            world.grid, group=world.group, mesh=self._request.mesh, timeout=self.timeout
        )
        self.group: dist.ProcessGroup | None = self.layout.pipeline_group
        self.rank = self.layout.grid.pipeline_rank
        self.world_size = self.layout.grid.pp
        self._monitor = PeerMonitor(self._agreement.key, self.rank, self.timeout)
        # the per-call argument check: a gloo group of its own over every rank (collective: local group)
        calls = local_group(self.layout.grid.everyone, backend="gloo", timeout=self.layout.setup_timeout)
        self._calls = CallCheck(calls, self._monitor, self.layout.grid.rank_name)
        self._check_calls = bool(self._request.check_calls)

    def _place(self, resolution: Resolution) -> dict[int, StageState]:
        """Place this rank's chunks into :attr:`module`, sharded or tied, every replica starting from
        replica 0's values (collective); returns the chunks by stage index."""
        self.module = nn.Module()
        mesh, options = self._request.mesh, run_options(self._request, resolution)  # fsdp= or planned
        dp_mesh = data_mesh(mesh, self.layout.grid) if mesh is not None else None
        held = (self.layout, self.device, dp_mesh, options, self._monitor.wait)  # its waits monitored
        self._sharded = ShardedStages(*held) if self.sharding else None  # "fsdp"/"hsdp": FSDP2 units
        shard = self._sharded.shard if self._sharded is not None else None
        experts = expert_sharding(self.layout.grid, mesh, timeout=self.timeout)  # expert parallelism
        stages, self._guards = place_stages(
            resolution, self._request, rank=self.rank, device=self.device, module=self.module, shard=shard,
            experts=experts)  # fmt: skip
        if self._sharded is not None:
            self._sharded.placed({stage: guard.deferral for stage, guard in self._guards.items()})
        self.stages = tuple(sorted(stages))
        self._tied = tie_parameters(resolution, self.rank, self.layout, self.module, self._monitor.wait)
        if self.layout.grid.replicas > 1 and self._sharded is None:  # replicas start from replica 0's
            broadcast_replicas(self.module, self.layout, self.rank)
        return stages

    def _build_executor(self, resolution: Resolution, stages: dict[int, StageState]) -> None:
        """The channels, the executor of this rank's program and the per-call argument preparation."""
        static_shapes = self._request.static_shapes
        comm = Comm(
            self.schedule, self.group, self.device, self.timeout, static_shapes, monitor=self._monitor
        )
        self._executor = Executor(
            self.schedule, self.rank, stages, comm, resolution.loss_fn, self._agreement.seed,
            ends=self._vocab_runner(),
        )  # fmt: skip
        self._executor.overlap = self._request.overlap  # a user's run of each overlapped F&B pair
        self._executor.follow(self.lowered.program_of(self.rank, self.layout.grid.dp_index))
        self._first, self._last = 0 in stages, self.schedule.num_stages - 1 in stages
        head, embedding = self._vocab_layers
        self._call_args = PipelineCalls(
            microbatches=self.schedule.microbatches, device=self.device, rank=self.rank,
            ends=(self._first or embedding is not None, self._last or head is not None),
            vocab_layers=self._vocab_layers, keywords=self._keywords,
            calls=self._calls if self._check_calls else None, guarded=self._guarded,
        )  # fmt: skip

    def _build_facets(self, resolution: Resolution) -> None:
        """The objects the facade forwards to: the optimizer step's and the state dicts'."""
        self._optimization = StepOptimization(
            resolution=resolution, layout=self.layout, device=self.device, executor=self._executor,
            post_validation=self._request.post_validation, wait=self._monitor.wait, tied=self._tied,
            reductions=self._sharded or averager_of(self._executor, self.lowered, self.layout, self._monitor),
        )  # fmt: skip
        self._state = PipelineState(
            module=self.module, ends=self._executor.ends, layout=self.layout, calls=self._calls,
            monitor=self._monitor, model_keys=self._model_keys, ties=self._ties, guarded=self._guarded,
        )  # fmt: skip

    def _vocab_runner(self) -> VocabRunner | None:
        """This rank's shard of the vocabulary-parallel head and embedding
        (:func:`~.vocab.runner.place_vocab`); their weights join the model's state-dict keys."""
        head, embedding = self._vocab_layers
        if head is None and embedding is None:
            return None
        runner, keys = place_vocab(
            head, embedding, self.schedule, self.layout, self.module, self.device, self._monitor.wait
        )
        self._model_keys = (*self._model_keys, *keys)
        return runner

    def _build_recording(self) -> None:
        emulate = self._request.emulate
        if emulate is not None:  # each op lasts its modelled duration (ms), see .emulate
            from .execute.emulate import install_emulation

            install_emulation(self._executor, emulate)
        if self._request.trace:  # record every op and wait of the last steps, see .trace
            from .observe.trace import TraceRecorder

            self.recorder = TraceRecorder(self.device)

    def split_report(self) -> list[SplitRecord]:
        """How every module of this rank's stages splits its backward: the path it takes (a fast path
        and its rule, the generic split, routed calls, plain autograd after a fall-back), whether the
        split guard has checked it, and why a module fell back (``docs/wgrad.md``)."""
        return [record for index in self.stages for record in self._guards[index].report()]

    # -- training ----------------------------------------------------------------------------------

    @property
    def holds_loss(self) -> bool:
        """True on the rank of the last stage (the one whose :meth:`step` returns the loss)."""
        return self._last

    @property
    def recorder(self) -> OpRecorder | None:
        """An optional :class:`~.recorder.Recorder` timing every op, runtime event and transfer wait:
        ``op(op, start, end)``, ``wait(key, start, end)``; ``clock``, ``begin_step``, ``event`` optional."""
        return self._recorder

    @recorder.setter
    def recorder(self, recorder: OpRecorder | None) -> None:
        complete = as_recorder(recorder)
        self._recorder = recorder
        self._executor.recorder = complete
        self._executor.comm.recorder = complete

    @overload
    def step(
        self,
        inputs: Any = None,
        targets: Any = None,
        loss_scale: float | None = None,
        *,
        losses: list[torch.Tensor] | None = None,
        return_outputs: Literal[False] = False,
        **kwargs: Any,
    ) -> torch.Tensor | None: ...

    @overload
    def step(
        self,
        inputs: Any = None,
        targets: Any = None,
        loss_scale: float | None = None,
        *,
        losses: list[torch.Tensor] | None = None,
        return_outputs: Literal[True],
        **kwargs: Any,
    ) -> tuple[torch.Tensor | None, Any]: ...

    def step(
        self,
        inputs: Any = None,
        targets: Any = None,
        loss_scale: float | None = None,
        *,
        losses: list[torch.Tensor] | None = None,
        return_outputs: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Forward and backward of one batch, split into microbatches, in the schedule's order.

        ``inputs`` (a tensor or tuple of tensors) is used where the first stage lives, ``targets``
        where the last one lives; both are split along dimension 0.  Gradients are accumulated into
        ``.grad`` as ``loss_fn(model(inputs, **kwargs), targets).backward()`` would.  Returns the mean
        of the microbatch losses on the rank of the last stage, ``None`` elsewhere.

        Keyword arguments (``attention_mask=mask``, ``position_ids=ids``) reach every layer whose
        ``forward`` takes that name (any layer with ``**kwargs``), on whichever rank holds it: pass the
        same ones on every rank.  A tensor of at least one dimension is split along dimension 0 into
        the microbatches like the inputs; any other value (a 0-d tensor, None, a number, a flag)
        reaches every microbatch unchanged.  They are constants of the layers: a tensor that requires
        grad is refused.  A name no layer of the model takes is refused.

        ``losses`` (a list) gets this call's per-microbatch losses appended, in microbatch order, on
        the last stage's rank (detached; this replica's microbatches under data parallelism).  With
        ``return_outputs`` the call returns ``(loss, outputs)``: the last stage's outputs (what
        ``loss_fn`` receives) concatenated over the microbatches along dimension 0 (0-d tensors
        stacked, tuples and dicts merged entry by entry), detached, on the last stage's rank and
        ``None`` elsewhere.

        With ``data_parallel = D`` each replica passes its own equal shard of the global batch; the
        gradients are those of the global batch's mean loss, which is returned.  A pending optimizer
        step is settled at the start of the step, before anything reads the parameters.  ``loss_scale``
        multiplies the loss before the backward (fp16); pass it as ``unscale`` to
        :meth:`optimizer_step`.  The returned loss is unscaled.

        Call it on every rank.  Before any message moves, the ranks compare their calls and argument
        checks: a difference raises the same :class:`PipelineError` on every rank, naming the rank
        and what differs, and the Pipeline stays usable (``docs/failure-semantics.md``;
        ``check_calls=False`` skips this).
        """
        self._check_usable("step")
        split_inputs, targets_mb, kwargs_mb = self._call_args.prepare(
            "step", inputs, targets, loss_scale, kwargs, losses, return_outputs
        )
        run = self._guarded(
            "step",
            lambda: self._run_program(split_inputs, targets_mb, loss_scale or 1.0, kwargs_mb, return_outputs),
        )
        calibrator = self._calibrator
        if calibrator is not None:  # schedule="auto": the plan is calibrated from the recorded steps
            calibrated = self._guarded("step", lambda: calibrator.after_step(self))
            if calibrated is not None:
                self.plan, self._calibrator = calibrated, None
        return self._results(run, losses, return_outputs)

    @overload
    def evaluate(
        self,
        inputs: Any = None,
        targets: Any = None,
        *,
        losses: list[torch.Tensor] | None = None,
        return_outputs: Literal[False] = False,
        **kwargs: Any,
    ) -> torch.Tensor | None: ...

    @overload
    def evaluate(
        self,
        inputs: Any = None,
        targets: Any = None,
        *,
        losses: list[torch.Tensor] | None = None,
        return_outputs: Literal[True],
        **kwargs: Any,
    ) -> tuple[torch.Tensor | None, Any]: ...

    @torch.no_grad()
    def evaluate(
        self,
        inputs: Any = None,
        targets: Any = None,
        *,
        losses: list[torch.Tensor] | None = None,
        return_outputs: bool = False,
        **kwargs: Any,
    ) -> Any:
        """The mean loss of a batch, forward only: no graph, no ``.grad`` change, eval mode meanwhile.

        Call it on every rank, like :meth:`step` (inputs where the first stage lives, targets
        where the last one does); it returns the mean microbatch loss on the last stage's rank
        (over the global batch with data parallelism), None elsewhere.  A pending optimizer step is
        settled first.  The batch may differ in size from the training batches (it still splits into
        the schedule's microbatches).  Works inside ``torch.no_grad()``.  Keyword arguments,
        ``losses`` and ``return_outputs`` (then ``(loss, outputs)``) work as for :meth:`step`.  The
        ranks' calls are compared first, as for :meth:`step`.
        """
        self._check_usable("evaluate")
        split_inputs, targets_mb, kwargs_mb = self._call_args.prepare(
            "evaluate", inputs, targets, None, kwargs, losses, return_outputs
        )
        modes = [(module, module.training) for module in self.module.modules()]
        self.module.eval()
        try:
            run = self._guarded(
                "evaluate", lambda: self._evaluate(split_inputs, targets_mb, kwargs_mb, return_outputs)
            )
        finally:
            for module, training in modes:
                module.training = training
        return self._results(run, losses, return_outputs)

    def _evaluate(
        self,
        inputs: Sequence[tuple[torch.Tensor, ...]],
        targets: Sequence[Any],
        kwargs: Sequence[Mapping[str, Any]],
        keep_outputs: bool,
    ) -> list:
        self._optimization.settle()  # the parameters must be final before they are read
        run = self._executor.run_forward
        if self._sharded is None:
            return run(inputs, targets, kwargs=kwargs, keep_outputs=keep_outputs)
        self._sharded.unshard()  # collective over the replicas, which evaluate together
        try:
            return run(inputs, targets, kwargs=kwargs, keep_outputs=keep_outputs)
        finally:
            self._sharded.reshard()

    def _results(self, run: list[torch.Tensor], losses: list | None, return_outputs: bool) -> Any:
        wait = self._monitor.wait
        return call_results(
            self._executor, run, losses, return_outputs, holds_loss=self._last, layout=self.layout, wait=wait
        )

    def _check_usable(self, call: str) -> None:
        if self._failure is not None:
            raise PipelineError(
                f"this Pipeline cannot run {call}() any more: an earlier step failed ({self._failure}); "
                "its channels may hold that step's messages — build a new Pipeline (and reload a checkpoint)"
            )

    def _guarded(self, call: str, work: Callable[[], Any]) -> Any:
        """Run communicating work; on failure tell the peers (once) and mark the Pipeline unusable."""
        try:
            return work()
        except BaseException as error:
            if not isinstance(error, PeerFailure) and self._monitor.failure is None:
                self._monitor.post(f"rank {self.rank} failed in {call}(): {type(error).__name__}: {error}")
            self._failure = self._monitor.failure or f"{type(error).__name__}: {error}"
            raise

    # -- parameters ----------------------------------------------------------------------------------

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters."""
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters, named as in ``layers`` (``"3.mlp.fc.weight"``)."""
        return self.module.named_parameters()

    def state_dict(self) -> dict[str, Any]:
        """This rank's entries of the unpipelined model's ``state_dict()``, same names: disjoint dicts
        whose union is the unpipelined model's, but for the vocabulary-parallel weights, on every rank
        as DTensor shards of its rows (for DCP).  Settles a pending optimizer step first (collective)."""
        self.synchronize()
        return self._state.state_dict()

    def full_state_dict(self) -> dict[str, Any]:
        """The whole model's state dict on every rank (collective), equal key for key to the unpipelined
        model's ``state_dict()``: CPU copies of full tensors (FSDP2 shards, vocabulary rows gathered)."""
        self.synchronize()
        return self._state.full_state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """Load this rank's entries of a whole-model state dict, or of this rank's own
        (:meth:`.pipeline_state.PipelineState.load_state_dict`: ties, strictness, shapes).  Settles a
        pending optimizer step first (collective), so its validation cannot undo the load."""
        self.synchronize()
        return self._state.load_state_dict(state_dict, strict)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer | None, flatten: bool = False) -> dict:
        """``optimizer``'s state keyed by this rank's parameter names, as torch's ``get_optimizer_state_dict``
        keys the unpipelined model's; ``flatten=True``: torch's flat form, to save with DCP when the layout
        may change (``docs/guide.md``); vocabulary rows as DTensor shards.  Settles first (collective)."""
        self.synchronize()
        return self._state.optimizer_state_dict(optimizer, flatten)

    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer | None, state_dict: Mapping[str, Any], strict: bool = True
    ) -> list[str]:
        """Load an optimizer state dict keyed by parameter names (of any layout, or torch's
        ``get_optimizer_state_dict`` of the unpipelined model) into this rank's ``optimizer``;
        returns the names whose state is missing.  Settles a pending optimizer step first."""
        self.synchronize()
        return self._state.load_optimizer_state_dict(optimizer, state_dict, strict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of this rank's parameters.  ``set_to_none=False`` zeroes them in place,
        which a pending optimizer step still reads: it is settled first (call it on every rank)."""
        if not set_to_none:
            self.synchronize()
        self.module.zero_grad(set_to_none=set_to_none)

    # -- recorded timelines (trace=True) ------------------------------------------------------------

    def measured_timelines(self) -> list[MeasuredTimeline] | None:
        """The recorded steps as :class:`~.trace.MeasuredTimeline` objects on rank 0, None elsewhere
        (collective; needs ``trace=True`` or another :class:`~.recorder.StepRecorder`)."""
        from .observe.trace import recorded_timelines

        return recorded_timelines(self.recorder, self.schedule, self.group, self.device)

    def write_trace(self, directory: str | Path) -> TraceReport | None:
        """Write the recorded timeline, the prediction and a picture to ``directory`` (collective;
        :func:`~.trace.write_recorded_trace`).  Returns the report on rank 0, None elsewhere."""
        from .observe.trace import recorded_timelines, write_recorded_trace

        timelines = recorded_timelines(self.recorder, self.schedule, self.group, self.device)
        profile = self.profile.to_dict() if self.profile is not None else None
        return write_recorded_trace(
            timelines, self.recorder, directory, self.layout, layer_bounds=self.layer_bounds, profile=profile
        )

    # -- optimizer step and data parallelism --------------------------------------------------------

    @property
    def data_parallel(self) -> int:
        """Number of pipeline replicas ``D`` (data-parallel times ``"ep"`` ranks, each its own rows);
        this rank is pipeline rank ``self.rank`` of replica ``self.layout.grid.dp_index``."""
        return self.layout.grid.replicas

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer | None,
        max_norm: float | None = None,
        unscale: float | None = None,
    ) -> None:
        """Clip the gradients to ``max_norm`` over the whole model and step, or skip on Inf/NaN.

        Call it on every rank after :meth:`step`; the result is that of ``clip_grad_norm_`` +
        ``optimizer.step()`` on the whole model.  With post-validation (the default) no collective
        runs here: the step is confirmed, or rolled back and redone, before the next step's first
        forward or at :meth:`synchronize` (:mod:`.optim`, ``docs/optimizer-post-validation.md``).
        ``unscale`` divides the gradients by the ``loss_scale`` given to :meth:`step` first.
        ``optimizer`` may be None on a rank without parameters; a ``ZeroRedundancyOptimizer`` must
        shard over ``self.layout.dp_group``.  Counters: :attr:`optimizer_stats`.
        """
        self._check_usable("optimizer_step")
        optimizer = self._optimization.prepare(optimizer, list(self.parameters()), unscale)
        self._guarded("optimizer_step", lambda: self._optimization.step(optimizer, max_norm))

    def synchronize(self) -> None:
        """Settle a pending optimizer step now (collective over the pipeline: every rank calls it);
        afterwards parameters and optimizer state are final.  Waits honour ``timeout``."""
        self._check_usable("synchronize")
        self._guarded("synchronize", self._optimization.close)

    @property
    def optimizer_stats(self) -> OptimizerStats:
        """Counters of this rank's settled optimizer steps (steps, clipped, skipped, rolled back)."""
        return self._optimization.stats

    def _run_program(
        self,
        inputs: Sequence[tuple[torch.Tensor, ...]],
        targets: Sequence[Any],
        loss_scale: float = 1.0,
        kwargs: Sequence[Mapping[str, Any]] = (),
        keep_outputs: bool = False,
    ) -> list[torch.Tensor]:
        """Run the executor's program; the gradients' reductions follow (:meth:`StepOptimization.run`)."""
        run = self._executor.run_step
        return self._optimization.run(
            lambda: run(inputs, targets, loss_scale, kwargs=kwargs, keep_outputs=keep_outputs)
        )
