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
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import torch
import torch.distributed as dist
from torch import nn

from ..schedule import CostModel, Schedule, Timeline
from ..schedule.modelplan import MeshLayout
from . import PipelineError
from .build import (
    chain_optimizer,
    install_averager,
    install_sharded_reduction,
    place_stages,
    tie_parameters,
)
from .checkpoint import merge_state_dicts, model_keys, select_entries, strict_error
from .comm import Comm
from .compiled import prepare_layers
from .consistency import (
    STATE_DICT_TAG,
    CallCheck,
    CallSignature,
    broadcast_replicas,
    prepare_call,
    share_objects,
)
from .data_parallel import (
    create_layout,
    first_forward,
    mean_loss,
    pipeline_size_of,
)
from .executor import Executor, Hook
from .failures import PeerFailure, PeerMonitor
from .fsdp import ShardedStages
from .groups import equalize_group_counts, local_group
from .launch import init_distributed, local_device
from .mesh import data_mesh, layout_of_mesh, mesh_groups, mesh_ranks, parallel_size, stage_layout
from .mesh import mesh_dims as mesh_dims_of
from .optim import OptimizerStats, check_sharded_optimizer, unscale_gradients
from .recorder import OpRecorder, StepRecorder, as_recorder
from .resolve import LossFn, Resolution, agree_on, resolve, wants_profile
from .staging import layer_keywords, merge_microbatches, split_call, split_keywords
from .vocab import (
    VOCAB_LAYER_NAMES,
    VocabRunner,
    check_vocab_call,
    check_vocab_request,
    gathered_optimizer_state,
    gathered_state,
    load_vocab_state,
    place_vocab,
    plain_model,
    sliced_optimizer_state,
)
from .vocab_layers import VocabParallelEmbedding, VocabParallelHead
from .wgrad import FastPaths
from .wgrad.verify import SplitRecord

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ..schedule.modelplan import ModelProfile, Plan
    from .auto import Calibrator
    from .trace import MeasuredTimeline, TraceReport

logger = logging.getLogger(__name__)


def _full(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's full tensor (an all-gather over its mesh), any other tensor itself."""
    full_tensor = getattr(value, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else value


def _sharded_like(entries: Mapping[str, Any], local: Mapping[str, Any]) -> dict[str, Any]:
    """``entries`` with each full tensor whose local entry is a DTensor (``data_parallel="fsdp"``) cut to
    this rank's shard of it, laid out as the local one (no communication: every replica loads the
    same full value)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    out = dict(entries)
    for key, value in entries.items():
        mine = local.get(key)
        if isinstance(mine, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            full = value.detach().to(mine.device, mine.dtype)
            out[key] = distribute_tensor(full, mine.device_mesh, mine.placements, src_data_rank=None)
    return out


class Pipeline:
    """Pipeline-parallel training of ``layers`` with any schedule of the registry.

    ``schedule`` is a registry name (with ``microbatches``, :data:`DEFAULT_MICROBATCHES` when None),
    a :class:`Schedule` (``microbatches`` and ``chunks`` then come from it) or ``"auto"``.
    ``chunks`` sets v for schedules that take it; ``partition`` lists the ``S−1`` layer
    indices where a new chunk starts; ``costs`` goes to the builder (cost-aware schedules) and the
    validator; ``timeout`` (seconds) bounds every wait on another rank.  ``group`` is the process
    group of the pipeline (the default group when None; it is initialised from the environment if
    needed); every rank of it constructs the Pipeline, and the groups the Pipeline creates are made
    by their members only (:mod:`.groups`), so a Pipeline may run on any slice of the world.  With
    ``static_shapes`` the tensors crossing stage boundaries keep the shapes of the
    first step, which lets receives be posted ahead of time.

    ``partition="profile"`` with a schedule name cuts the layers where the profile says (the same
    profiling and planning as ``"auto"``, restricted to that schedule; ``example`` is then needed).

    ``schedule="auto"`` chooses the schedule, chunk count and partition from measurement
    (:mod:`.auto`): every rank profiles the layers on the first microbatch of ``example`` (one batch,
    ``(inputs, targets)``, or ``(inputs, targets, {"attention_mask": mask})`` with the keyword
    arguments the steps will pass, split and handed to the layers as :meth:`step` does), rank 0 plans
    under ``memory_limit`` bytes per rank (``"24GiB"``, or ``"80%"`` of a GPU's memory) and
    broadcasts the plan; :attr:`plan` then says what was chosen and why.
    The ``calibrate`` steps after the first one (0: none) are recorded and the plan is calibrated
    from their measured op times: ``plan.calibration`` then holds the prediction made from them and
    the plan they would choose (the running plan is kept; ``docs/auto-planning.md``).

    ``trace=True`` records the start and end of every op and transfer wait of the last steps
    (:mod:`.trace`); :meth:`write_trace` then writes the measured timeline next to the simulator's
    prediction.  ``emulate=costs`` (a CostModel in milliseconds) stretches every op to its modelled
    duration while real tensors still flow (:mod:`.emulate`), to measure the runtime's own overhead.

    ``data_parallel = D`` runs ``D`` replicas of a ``p``-rank pipeline over the ``p·D`` ranks of
    ``group`` (group rank ``dp_index · p + pipeline rank``, see :mod:`.data_parallel`); each replica
    steps on its shard of the batch and the gradients are averaged over the replicas, chunk by
    chunk as soon as a chunk's last weight-gradient op has run.

    ``mesh`` (a ``DeviceMesh``, instead of ``group``) lays the ranks out by its named dimensions
    (:mod:`.mesh`): the pipeline along ``"pp"``, the replicas along ``"dp"`` (if present) and every
    other dimension (``"tp"``) inside a stage; ``mesh_dims`` renames the roles (``{"pp": "pipe"}``).
    Every rank of the mesh constructs the Pipeline.  ``data_parallel`` is then ``"replicate"`` (the
    default: the averaging above) or ``"fsdp"``, which shards each chunk over the replicas with
    FSDP2 (:mod:`.fsdp`: one ``fully_shard`` unit per chunk, all-gathered once a step before the
    first forward, reduce-scattered by FSDP2 after the chunk's last gradient op; parameters,
    gradients and optimizer state are then ``DTensor`` shards).  :meth:`optimizer_step` clips and
    steps with optimizer post-validation (:mod:`.optim`); ``post_validation=False`` makes it a
    plain synchronous step.

    Construction resolves the arguments into one frozen :class:`~.resolve.Resolution`
    (:attr:`resolution`), agreed by every rank, then builds this rank's part (:mod:`.build`).  Only
    this rank's layers are referenced afterwards (moved to its device); the others are freed once
    the caller drops ``layers``.  With a schedule that has W ops every parameter
    gets its gradient in W (:mod:`.wgrad`; ``fast_paths`` adds split rules for your own layer
    types); module types and parameter names do not change.  Without ``costs`` the schedule is
    planned with :func:`.staging.default_costs` (W keeps M_B until it runs).

    Safety (see ``docs/guide.md`` and ``docs/failure-semantics.md``): at construction every rank's
    layers, parameters and schedule are compared (:mod:`.consistency`), data-parallel replicas and
    parameters tied across ranks start equal, and tied gradients are summed after every step.  The
    forward of each (step, stage, microbatch) draws from its own RNG stream rooted at ``seed`` (rank
    0's ``torch.initial_seed()`` when None).  Before each :meth:`step` and :meth:`evaluate` sends
    anything, every rank's call is compared (the method, the loss scale, the batch shapes and dtypes,
    a rank's argument error): a difference raises the same error on every rank and the Pipeline stays
    usable.  A failure on one rank stops every peer within a fraction of a second with its rank, op
    and error; the Pipeline then refuses further steps.  :meth:`evaluate` runs a forward-only pass.
    ``check_calls=False`` skips the per-call comparison — a max-reduce of ten int64 over every rank
    per call, point to point on a gloo group of its own (``benchmarks/call_check.py``) — and with it
    the guarantee: an argument error then stops only the rank that makes it.

    ``parallelize(layer, mesh)`` (tensor parallelism inside a stage, ``docs/guide.md``) is called on
    each layer this rank holds, on its device, before its backward is split; it returns the layer to
    use (e.g. ``parallelize_module(layer, mesh["tp"], plan)``), whose ``DTensor`` parameters keep the
    layer's own names; ``mesh`` is the Pipeline's (None without one).  Every argument after
    ``layers`` is keyword-only.

    Compiled layers (``docs/wgrad.md``, "torch.compile"): a layer compiled with ``layer.compile()``
    or ``torch.compile(layer)`` runs compiled, and ``compile=True`` (or a dict of ``torch.compile``
    keyword arguments) compiles every layer that is not, in place (``layer.compile(**kwargs)``).
    An ``OptimizedModule`` is replaced by the module it wraps, compiled in place with its options,
    so parameter and state-dict names stay those of the uncompiled layers.  The compiled region is
    the layer's own forward; under a schedule with W ops its linear layers defer their weight
    gradients to W from inside it (``split_report()``: ``"compiled: weight gradient in W"``), its
    other parameters get theirs from the compiled backward, in B.
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
    ):
        check_vocab_request(
            head, embedding, loss_fn=loss_fn, data_parallel=data_parallel, mesh=mesh, schedule=schedule
        )
        self._vocab_layers = (head, embedding)
        layers = prepare_layers(layers, compile)  # before anything reads a name (.compiled)
        if mesh is not None and group is not None:
            raise PipelineError("pass mesh= or group=, not both (the mesh's pipeline dimension is the group)")
        backend = init_distributed(timeout=timeout) if group is None else dist.get_backend(group)
        self.device: torch.device = local_device(backend)  # before the first collective (NCCL needs it)
        self.timeout = timeout
        self._failure: str | None = None
        self._placeholder: torch.optim.Optimizer | None = None
        self._recorder: OpRecorder | None = None
        self._calibrator: Calibrator | None = None
        self._mesh = mesh
        self._parallelize = parallelize
        self._dims = mesh_dims_of(mesh, mesh_dims) if mesh is not None else None
        # local groups are named by each rank's group count: make the counts equal first (.groups)
        setup = timedelta(seconds=max(timeout, 60.0))
        equalize_group_counts(mesh_groups(mesh) if mesh is not None else [group], timeout=setup)
        if mesh is not None:  # the Pipeline's world: every rank of the mesh (agreement, planning)
            group = local_group(mesh_ranks(mesh), timeout=setup)
        size, data_parallel, sharding = parallel_size(data_parallel, mesh, self._dims, group)
        self.sharding: str | None = sharding  # "fsdp", "hsdp", or None: replicated
        planned: Resolution | None = None
        if wants_profile(schedule, partition):  # profile, plan once, broadcast: .auto
            from .auto import Calibrator, VocabPlanning, resolve_auto

            profiled, vocab = layers, None
            if head is not None:  # the planner weighs a plain head against the vocabulary-parallel one
                profiled, loss_fn = plain_model(head, embedding, layers)
                vocab = VocabPlanning(layers, embedding=embedding is not None)
                calibrate = 0  # the calibration models stages only, not the vocabulary ops
            self._calibrator = Calibrator(calibrate) if calibrate else None  # checked before collectives
            planned = resolve_auto(
                profiled,
                example,
                loss_fn,
                group,
                pipeline_size_of(size, data_parallel),
                microbatches,
                memory_limit,
                post_validation,
                self.device,
                schedules=[schedule] if isinstance(schedule, str) and partition == "profile" else None,
                chunks=chunks,
                vocab=vocab,
                layout=self._stage_layout(data_parallel, sharding),
            )
            if vocab is not None and planned.plan is not None and not planned.plan.winner.vocab_parallel:
                self._vocab_layers = (None, None)  # the plain model won: its layers hold head and embedding
        resolution, self._agreement = agree_on(  # collective: every rank checks every rank's
            lambda: (
                planned
                or resolve(
                    layers,
                    ranks=size,
                    data_parallel=data_parallel,
                    schedule=schedule,
                    microbatches=microbatches,
                    loss_fn=loss_fn,
                    chunks=chunks,
                    partition=None if isinstance(partition, str) else partition,
                    costs=costs,
                    vocab_parallel=head is not None,
                )
            ),
            data_parallel=data_parallel,
            seed=seed,
            group=group,
            verify=verify,
            check_calls=bool(check_calls),
            sharding=sharding,
        )
        self._build(resolution, group, data_parallel, static_shapes, fast_paths, verify, check_calls)
        self._build_recording(trace, emulate)
        self._init_optimization(post_validation)

    def _stage_layout(self, data_parallel: int, sharding: str | None) -> Any:
        """Each stage's ranks for the planner: the mesh's, or ``data_parallel`` replicas (None: one)."""
        if self._mesh is not None and self._dims is not None:
            parallelized = self._parallelize is not None
            return stage_layout(self._mesh, self._dims, data_parallel, sharding, parallelized)
        return MeshLayout(dp=data_parallel) if data_parallel > 1 else None

    def _build(
        self,
        resolution: Resolution,
        group: dist.ProcessGroup | None,
        data_parallel: int,
        static_shapes: bool,
        fast_paths: FastPaths | None,
        verify: bool | str,
        check_calls: bool,
    ) -> None:
        """Build this rank's part of the agreed ``resolution`` (collective: the layout's, the call
        check's, the ties' and the channels' groups); nothing is resolved or validated here."""
        self.resolution = resolution
        self.schedule: Schedule = resolution.schedule
        self.timeline: Timeline = resolution.timeline
        self.layer_bounds = resolution.bounds  # chunk s holds layers [bounds[s], bounds[s + 1])
        self.plan: Plan | None = resolution.plan  # schedule="auto": what was chosen and why
        self.profile: ModelProfile | None = resolution.profile  # and the layer profile it came from
        logger.info("%s", resolution.describe())
        if self._mesh is not None and self._dims is not None:
            self.layout = layout_of_mesh(self._mesh, self._dims, self.timeout)  # collective: local groups
        else:
            self.layout = create_layout(group, data_parallel, self.timeout)  # collective: local groups
        self.group: dist.ProcessGroup | None = self.layout.pipeline_group
        self.rank = self.layout.pipeline_rank
        self.world_size = self.layout.pipeline_size
        self._monitor = PeerMonitor(self._agreement.key, self.rank, self.timeout)
        # the per-call argument check: a gloo group of its own over every rank (collective: local group)
        calls = local_group(self.layout.everyone, backend="gloo", timeout=self.layout.setup_timeout)
        self._calls = CallCheck(calls, self._monitor, self.layout.rank_name)
        self._check_calls = bool(check_calls)
        self._model_keys = model_keys(resolution.layers)  # the unpipelined state dict's keys
        self._known_keys = frozenset(self._model_keys)
        self._ties = [tuple(name for _, name in tie) for tie in resolution.ties]
        self.module = nn.Module()
        # data_parallel="fsdp"/"hsdp": each chunk an FSDP2 unit (replica 0's values first), before its split
        dp_mesh = data_mesh(self._mesh, self._dims) if self._mesh is not None and self._dims else None
        self._sharded = ShardedStages(self.layout, self.device, dp_mesh) if self.sharding else None
        shard = self._sharded.shard if self._sharded is not None else None
        # the keywords every layer of the model takes (step(**kwargs)): read before any is placed
        self._keywords = [(name, layer_keywords(layer)) for name, layer in resolution.layers]
        stages, self._guards = place_stages(
            resolution,
            self.rank,
            self.device,
            self.module,
            fast_paths,
            verify,
            shard=shard,
            parallelize=self._parallelize,
            mesh=self._mesh,
        )
        if self._sharded is not None:
            self._sharded.placed()
        self.stages = tuple(sorted(stages))
        self._tied = tie_parameters(resolution, self.rank, self.layout, self.module, self._monitor.wait)
        if self.layout.data_parallel > 1 and self._sharded is None:  # replicas start from replica 0's
            broadcast_replicas(self.module, self.layout.dp_group, self.layout.global_rank(self.rank, 0))
        comm = Comm(
            self.schedule, self.group, self.device, self.timeout, static_shapes, monitor=self._monitor
        )
        self._executor = Executor(
            self.schedule,
            self.rank,
            stages,
            comm,
            resolution.loss_fn,
            self._agreement.seed,
            vocab=self._vocab_runner(),
        )
        self._first, self._last = 0 in stages, self.schedule.num_stages - 1 in stages

    def _vocab_runner(self) -> VocabRunner | None:
        """This rank's shard of the vocabulary-parallel head and embedding (:func:`~.vocab.place_vocab`);
        their weights join the model's state-dict keys."""
        head, embedding = self._vocab_layers
        if head is None and embedding is None:
            return None
        ranks = [self.layout.global_rank(r) for r in range(self.world_size)]
        runner, keys = place_vocab(
            head,
            embedding,
            self.schedule,
            self.rank,
            ranks,
            self.module,
            self.device,
            self.layout.setup_timeout,
        )
        self._model_keys = (*self._model_keys, *keys)
        self._known_keys = frozenset(self._model_keys)
        return runner

    def _build_recording(self, trace: bool, emulate: CostModel | None) -> None:
        if emulate is not None:  # each op lasts its modelled duration (ms), see .emulate
            from .emulate import install_emulation

            install_emulation(self._executor, emulate)
        if trace:  # record every op and wait of the last steps, see .trace
            from .trace import TraceRecorder

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
        """An optional :class:`~.recorder.Recorder` timing every op, runtime event and transfer wait.

        It needs at least ``op(op, start, end)`` and ``wait(key, start, end)``; the rest of the
        protocol (``clock``, ``begin_step``, ``event``) defaults when missing.
        """
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

        With ``data_parallel = D`` each replica passes its own shard of the global batch (equal
        shards); the gradients are then averaged over the replicas (those of the mean loss over the
        global batch) and the returned loss is the global batch's mean.  A pending optimizer step
        (:meth:`optimizer_step`) is settled just before this rank's first forward reads the
        parameters.

        ``loss_scale`` multiplies the loss before the backward (loss scaling for fp16); pass the
        same factor as ``unscale`` to :meth:`optimizer_step`.  The returned loss is unscaled.

        Call it on every rank.  Before any message moves, the ranks (every replica too) compare their
        calls — ``step`` or :meth:`evaluate`, ``loss_scale``, the shapes and dtypes of the inputs and
        of the targets among the ranks passing them, the keyword arguments' names, shapes, dtypes and
        plain values on every rank — and each rank's own argument checks (targets where the last
        stage lives, inputs where the first one does, a batch that splits): a difference or a failed
        check raises the same :class:`PipelineError` on every rank, naming the rank and what differs,
        and the Pipeline stays usable (``check_calls=False`` skips this).
        """
        self._check_usable("step")
        split_inputs, targets_mb, kwargs_mb = self._prepare_call(
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
        split_inputs, targets_mb, kwargs_mb = self._prepare_call(
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
        self._settle()  # the parameters must be final before they are read
        run = self._executor.run_forward
        if self._sharded is None:
            return run(inputs, targets, kwargs=kwargs, keep_outputs=keep_outputs)
        self._sharded.unshard()  # collective over the replicas, which evaluate together
        try:
            return run(inputs, targets, kwargs=kwargs, keep_outputs=keep_outputs)
        finally:
            self._sharded.reshard()

    def _results(self, run: list[torch.Tensor], losses: list | None, return_outputs: bool) -> Any:
        """What :meth:`step` / :meth:`evaluate` return from the executor's per-microbatch ``run``
        losses: the mean loss (or None), with the outputs when asked; ``losses`` extended."""
        executor = self._executor
        outputs, executor.outputs = executor.outputs, None
        if not self._last:
            return (None, None) if return_outputs else None
        loss = mean_loss(run, self.layout, self._monitor.wait)
        if losses is not None:
            losses.extend(value for _, value in sorted(zip(executor.loss_microbatches, run), key=_first))
        if not return_outputs:
            return loss
        merged = merge_microbatches([outputs[j] for j in sorted(outputs)]) if outputs else None
        return loss, merged

    def _prepare_call(
        self,
        call: str,
        inputs: Any,
        targets: Any,
        loss_scale: float | None,
        kwargs: Mapping[str, Any],
        losses: Any,
        return_outputs: Any,
    ) -> tuple:
        """Check and split this rank's arguments, then compare the call with every rank's (collective,
        unless ``check_calls=False``): :func:`~.consistency.prepare_call`.  Returns the microbatches of
        the inputs, the targets and the keyword arguments."""

        head, embedding = self._vocab_layers  # every rank's shard needs the tokens, the labels
        ends = (self._first or embedding is not None, self._last or head is not None)
        microbatches = self.schedule.microbatches

        def exchange(signature: CallSignature) -> str | None:
            return self._guarded(call, lambda: self._calls.exchange(signature))

        def split(i: Any, t: Any) -> tuple:
            if losses is not None and not isinstance(losses, list):
                raise PipelineError(
                    f"losses= takes a list (the per-microbatch losses are appended to it), not a "
                    f"{type(losses).__name__}"
                )
            if not isinstance(return_outputs, bool):
                raise PipelineError(f"return_outputs= takes True or False, not {return_outputs!r}")
            split_inputs, targets_mb = split_call(i, t, microbatches, self.device, call, self.rank, ends)
            check_vocab_call(head, embedding, split_inputs, targets_mb)
            kwargs_mb = split_keywords(kwargs, microbatches, self.device, call, self._keywords)
            return split_inputs, targets_mb, kwargs_mb

        return prepare_call(
            call,
            inputs,
            targets,
            loss_scale,
            split,
            exchange if self._check_calls else None,
            kwargs,
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
        """This rank's entries of the unpipelined model's ``state_dict()``, under the same names.

        Every parameter, persistent buffer and extra state of the layers this rank holds, in the
        model's order; a tied parameter appears under each of its names whose layer this rank holds
        (a language model's head weight on the last stage's rank, the embedding weight on the first).
        The ranks of a pipeline hold disjoint keys: the union of every rank's dict is the unpipelined
        model's state dict, key for key and value for value (:meth:`full_state_dict` gathers it).
        A pending optimizer step is settled first (collective, like :meth:`synchronize`: call it on
        every rank).  The tensors share storage with the parameters, as ``nn.Module.state_dict``'s.
        """
        self.synchronize()
        runner = self._executor.vocab
        if runner is not None:  # the full vocabulary weights, on the first / last stage's rank
            return self._guarded("state_dict", lambda: gathered_state(runner, self.module.state_dict()))
        return self.module.state_dict()

    def full_state_dict(self) -> dict[str, Any]:
        """The whole model's state dict on every rank: each rank's :meth:`state_dict` gathered (collective).

        Equal, key for key (in the same order) and value for value, to the unpipelined model's
        ``state_dict()`` — ``nn.Sequential(*layers).load_state_dict(pipe.full_state_dict())`` loads
        with ``strict=True``.  The tensors are CPU copies; every rank receives the whole model (for a
        model too large for one host, save each rank's :meth:`state_dict` and merge the files: their
        union is the same dict).  With data parallelism the ranks of this rank's replica are gathered.
        With ``data_parallel="fsdp"`` every sharded entry is first all-gathered over the replicas
        (``DTensor.full_tensor()``, collective over the data-parallel group), so the values are the
        full plain tensors as well.  Waits honour the Pipeline's ``timeout``.
        """
        local = {
            k: _full(v).detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
            for k, v in self.state_dict().items()
        }
        ranks = self.layout.replica_ranks(self.layout.dp_index)
        parts = self._guarded(
            "full_state_dict",
            lambda: share_objects(local, self._calls.group, ranks, self._monitor, tag=STATE_DICT_TAG),
        )
        return merge_state_dicts(parts, self._model_keys)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """Load this rank's entries of a whole-model state dict, or of this rank's own.

        ``state_dict`` may be the unpipelined model's ``state_dict()``, the union of the ranks' dicts
        (:meth:`full_state_dict`) or this rank's own :meth:`state_dict`: each rank takes the keys of
        the layers it holds and ignores those of the other ranks' layers.  Every copy of a tied
        parameter is set from one value, that of the first of its names the dict holds (so a dict
        without the alias keys loads too); a dict whose names of one tied parameter hold different
        values is refused.  With ``strict`` (the default), a key of this rank's layers the dict
        lacks, or a key of no layer of the model, raises a :class:`PipelineError` naming them; a
        shape that differs always raises.  Nothing is loaded when it raises.  Returns
        ``(missing_keys, unexpected_keys)`` as ``nn.Module.load_state_dict`` does.

        A pending optimizer step is settled first (collective, like :meth:`synchronize`: call it on
        every rank), so that its validation cannot roll back the loaded values.
        """
        self.synchronize()
        local = self.module.state_dict()
        vocab_missing: list[str] = []
        if self._executor.vocab is not None:  # each rank loads its rows of the full weights
            state_dict, vocab_missing = load_vocab_state(self._executor.vocab, state_dict, strict=strict)
            local = {k: v for k, v in local.items() if k.split(".")[0] not in VOCAB_LAYER_NAMES}
        entries, missing, unexpected = select_entries(state_dict, local, self._known_keys, self._ties)
        missing = [*missing, *vocab_missing]
        if strict and (missing or unexpected):
            raise strict_error(missing, unexpected, self.rank)
        self.module.load_state_dict(_sharded_like(entries, local), strict=False)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer | None, flatten: bool = False) -> dict:
        """``optimizer``'s state keyed by this rank's parameter names, as torch's
        ``get_optimizer_state_dict`` keys the unpipelined model's (``docs/guide.md``, Checkpoints).

        ``{"state": {"3.fc.weight": {"exp_avg": ..., "step": ...}}, "param_groups": [{"lr": ...,
        "params": ["3.fc.weight", ...]}]}``; ``flatten=True`` gives the flat form of torch's
        ``StateDictOptions(flatten_optimizer_state_dict=True)`` (``"state.3.fc.weight.exp_avg"``,
        ``"param_groups.3.fc.weight.lr"``), which is the one to save with
        ``torch.distributed.checkpoint`` when the layout may change (every key then names one
        parameter; the nested ``param_groups`` list differs between ranks and DCP keeps one rank's).
        A parameter tied across ranks is named by its first name on every holder (its copies' states
        are equal, so DCP writes it once).  A pending optimizer step is settled first (collective,
        like :meth:`synchronize`); parameters without state get the state their first step starts
        from (SGD, Adam, AdamW: :func:`~.checkpoint.create_optimizer_state`), so ``dcp.load`` can
        fill it in place.  The tensors are the optimizer's own.
        """
        from .checkpoint import create_optimizer_state, optimizer_state_by_name

        self.synchronize()
        optimizer = self._named_optimizer(optimizer, "optimizer_state_dict")
        if optimizer is None:  # a rank without parameters
            return {} if flatten else {"state": {}, "param_groups": []}
        create_optimizer_state(optimizer)
        names = self._parameter_names()
        state = optimizer_state_by_name(optimizer, names, flatten)
        runner = self._executor.vocab
        if runner is not None:  # the vocabulary rows' state, gathered to the weights' owners
            return self._guarded(
                "optimizer_state_dict",
                lambda: gathered_optimizer_state(runner, state, names, flatten=flatten),
            )
        return state

    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer | None, state_dict: Mapping[str, Any], strict: bool = True
    ) -> list[str]:
        """Load an optimizer state dict keyed by parameter names into ``optimizer`` (this rank's).

        ``state_dict`` is a dict of :meth:`optimizer_state_dict` (nested or flat) of any layout —
        another schedule, partition or number of ranks, read back with ``dcp.load`` — or torch's
        ``get_optimizer_state_dict`` of the unpipelined model: each rank takes the states of its own
        parameters.  With ``strict`` a parameter whose state is missing raises before anything is
        loaded; returns the names of those missing.  A pending optimizer step is settled first
        (collective, like :meth:`synchronize`).
        """
        from .checkpoint import load_optimizer_state_by_name

        self.synchronize()
        optimizer = self._named_optimizer(optimizer, "load_optimizer_state_dict")
        if optimizer is None:
            return []
        if self._executor.vocab is not None:  # this rank's rows of the full vocabulary state
            state_dict = sliced_optimizer_state(self._executor.vocab, state_dict, self._parameter_names())
        aliases = {tie[0]: tie[1:] for tie in self._ties}
        return load_optimizer_state_by_name(optimizer, state_dict, self._parameter_names(), aliases, strict)

    def _named_optimizer(
        self, optimizer: torch.optim.Optimizer | None, call: str
    ) -> torch.optim.Optimizer | None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if isinstance(optimizer, ZeroRedundancyOptimizer):
            raise PipelineError(
                f"{call}() keys a local optimizer's state by parameter name; a ZeroRedundancyOptimizer's is "
                "sharded over the replicas: use its consolidate_state_dict() after pipe.synchronize()"
            )
        if optimizer is None and any(True for _ in self.parameters()):
            raise PipelineError(f"rank {self.rank} holds parameters: pass an optimizer over them")
        return optimizer

    def _parameter_names(self) -> dict[int, str]:
        """Each of this rank's parameters by id: its name, a tied one's first name (on every holder)."""
        first = {name: tie[0] for tie in self._ties for name in tie}
        names: dict[int, str] = {}
        for name, param in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), first.get(name, name))
        return names

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of this rank's parameters."""
        self.module.zero_grad(set_to_none=set_to_none)

    # -- recorded timelines (trace=True) ------------------------------------------------------------

    def measured_timelines(self) -> list[MeasuredTimeline] | None:
        """The recorded steps as :class:`~.trace.MeasuredTimeline` objects on rank 0, None elsewhere.

        Collective (every rank calls it); needs ``trace=True`` or another
        :class:`~.recorder.StepRecorder`.
        """
        from .trace import gather_timelines

        recorder = self.recorder
        if not isinstance(recorder, StepRecorder):
            raise PipelineError("no timeline was recorded: build the Pipeline with trace=True")
        return gather_timelines(recorder, self.schedule, self.group, self.device)

    def write_trace(self, directory: str | Path) -> TraceReport | None:
        """Write the recorded timeline, the prediction and a picture to ``directory`` (collective).

        See :func:`~.trace.write_trace`; the pipeline's first step is left out when later ones were
        recorded (it also sends shape headers and allocates).  Returns the report on rank 0, None
        elsewhere.
        """
        from .trace import write_trace

        timelines = self.measured_timelines()
        if timelines is None:
            return None
        if not timelines:
            raise PipelineError("no step was recorded: run pipe.step() with trace=True before write_trace")
        if len(timelines) > 1 and getattr(self.recorder, "keeps_first_step", False):
            timelines = timelines[1:]
        profile = self.profile.to_dict() if self.profile is not None else None
        return write_trace(
            timelines, directory, self.layout, layer_bounds=self.layer_bounds, layer_profile=profile
        )

    # -- optimizer step and data parallelism --------------------------------------------------------

    @property
    def data_parallel(self) -> int:
        """Number of pipeline replicas (``D``); this rank is pipeline rank ``self.rank`` of replica
        ``self.layout.dp_index`` (group rank ``dp_index · p + rank``)."""
        return self.layout.data_parallel

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer | None,
        max_norm: float | None = None,
        unscale: float | None = None,
    ) -> None:
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

        ``unscale`` divides this rank's gradients by the ``loss_scale`` given to :meth:`step` first
        (what ``GradScaler.unscale_`` does); an overflow then shows as a skipped step on every rank.
        ``optimizer`` may be None on a rank that holds no parameters.

        A ``torch.distributed.optim.ZeroRedundancyOptimizer`` must shard over
        ``self.layout.dp_group`` (refused otherwise).  Over SGD, Adam or AdamW it is post-validated
        like them: the replicas of a pipeline rank step, confirm and roll back together (the
        rollback re-broadcasts the shards); over another optimizer it steps once the step is final.
        Its ``consolidate_state_dict`` needs the step settled: call :meth:`synchronize` first.
        """
        self._check_usable("optimizer_step")
        if optimizer is None:
            if any(True for _ in self.parameters()):
                raise PipelineError(
                    f"rank {self.rank} holds parameters: pass an optimizer over pipe.parameters()"
                )
            optimizer = self._empty_optimizer()
        layout = self.layout
        check_sharded_optimizer(
            optimizer, [layout.global_rank(self.rank, d) for d in range(layout.data_parallel)]
        )
        if unscale is not None:
            unscale_gradients(self.parameters(), float(unscale))
        self._guarded("optimizer_step", lambda: self._optimizer.step(optimizer, max_norm))

    def _empty_optimizer(self) -> torch.optim.Optimizer:
        """A stand-in optimizer for a rank without parameters (it still joins the norm reduction)."""
        if self._placeholder is None:
            self._placeholder = torch.optim.SGD([torch.zeros(0, requires_grad=True)], lr=0.0)
        return self._placeholder

    def synchronize(self) -> None:
        """Settle a pending optimizer step now (collective over the pipeline: every rank calls it).

        Afterwards parameters and optimizer state are final — call it before reading them outside
        the training loop (checkpoints, evaluation, the end of training; :meth:`state_dict` and
        :meth:`evaluate` call it themselves).  Waits honour the Pipeline's ``timeout``.
        """
        self._check_usable("synchronize")
        self._guarded("synchronize", self._optimizer.close)

    @property
    def optimizer_stats(self) -> OptimizerStats:
        """Counters of this rank's settled optimizer steps (steps, clipped, skipped, rolled back)."""
        return self._optimizer.stats

    def _init_optimization(self, post_validation: bool) -> None:
        """Chain the ranks for the optimizer step; plan the data-parallel reductions and the op hooks."""
        self._optimizer = chain_optimizer(
            self.resolution,
            self.layout,
            self.rank,
            self.device,
            post_validation,
            self._monitor.wait,
            self._tied,
            sharded=self._sharded is not None,
        )
        program = self.schedule.programs[self.rank]
        # the parameters are first read by the first forward: the pending step must be settled then
        self._executor.add_hook(first_forward(program), Hook("optimizer settle", self._settle))
        self._averager = None
        if self._sharded is not None:  # then all-gathered (FSDP2), reduce-scattered chunk by chunk
            install_sharded_reduction(self._executor, program, self._sharded)
        else:
            self._averager = install_averager(self._executor, program, self.layout, self._monitor.wait)

    def _settle(self) -> None:
        """Settle the pending optimizer step (confirm it or roll it back); log a rollback."""
        if not logger.isEnabledFor(logging.INFO):
            self._optimizer.finish()
            return
        rolled_back = self._optimizer.stats.rolled_back
        self._optimizer.finish()
        if self._optimizer.stats.rolled_back > rolled_back:
            logger.info("rank %d: the optimistic optimizer step was rolled back", self.rank)

    def _run_program(
        self,
        inputs: Sequence[tuple[torch.Tensor, ...]],
        targets: Sequence[Any],
        loss_scale: float = 1.0,
        kwargs: Sequence[Mapping[str, Any]] = (),
        keep_outputs: bool = False,
    ) -> list[torch.Tensor]:
        """Run the executor's program (its hooks settle the optimizer and start the reductions);
        average gradients over the replicas, sum those of tied parameters over their holders."""
        try:
            losses = self._executor.run_step(
                inputs, targets, loss_scale, kwargs=kwargs, keep_outputs=keep_outputs
            )
        except BaseException:
            if self._averager is not None:
                self._averager.discard()
            if self._sharded is not None:
                self._sharded.discard()
            raise
        if self._averager is not None:
            self._averager.finish()
        if self._sharded is not None:  # every chunk was reduced and resharded by its hook
            self._sharded.reshard()
        for tie in self._tied:
            tie.sum_gradients(self._monitor.wait)
        return losses


def _first(pair: tuple[int, Any]) -> int:
    return pair[0]
