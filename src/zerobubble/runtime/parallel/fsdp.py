"""FSDP2 for the data-parallel dimension: ``Pipeline(..., mesh=mesh, data_parallel="fsdp", fsdp=...)``.

Units (``fsdp=``, the schedule layer's record :class:`~...schedule.sharding.FSDPOptions`): by
default each chunk (its ``StageModule``) is one ``fully_shard`` unit, all-gathered once before this
rank's first forward and kept whole for the step.  With ``fsdp=FSDPOptions(units="layer" | N)``
each layer (each run of N layers) is a unit under a parameter-less chunk root, and FSDP2's own
hooks all-gather a unit just before its forward and its B (prefetching ``prefetch`` units ahead)
and reshard it after (``reshard_after_forward``, ``reshard_after_backward``) — B and W split
(``runtime/wgrad``) around it:
* B reads the parameters (input gradients): FSDP2's pre-backward hook re-gathers the unit, its
  post-backward hook reshards it (``set_reshard_after_backward``), reducing nothing
  (``set_requires_gradient_sync(False)``, ``set_is_last_backward(False)``);
* W writes the unsharded ``Parameter`` objects' ``.grad`` (FSDP2 keeps them across reshards; only
  their storage is freed).  W of a linear, embedding or norm fast path reads no parameter value, so
  such units stay sharded in W; a unit holding any other split (a generic local graph may have saved
  a parameter) is gathered before the chunk's W op and resharded after it (``weight_readers``);
* after a chunk's last gradient op (:func:`~.data_parallel.last_gradient_ops`) FSDP2's own
  ``post_backward()`` per unit and the root's final callback reduce-scatter the unsharded ``.grad``,
  as ``perform_reduce_grad`` of torch's pipelining does; whatever is still unsharded at the step's
  end (an evaluation) is resharded.
Peak parameter memory per rank: the shards plus one unit (plus ``prefetch`` more) in F and B, plus
the gathered W-reading units in W; the unsharded gradients stay whole until the reduce-scatter.
FSDP2 averages over the group (beside ``"ep"``: every replica, the experts left to ``reduce``).
Derivation: ``docs/runtime.md``, "FSDP2 units" and "Expert parallelism".
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ...schedule.ir import Kind, Op
from ...schedule.lowering import CommKind, Issue, Wait
from ...schedule.modelplan.layout import SHARDINGS
from ...schedule.sharding import ONCE_PER_STEP, FSDPOptions
from .. import PipelineError
from .data_parallel import GradientAverager, ParallelLayout
from .experts import ExpertParallelExperts, broadcast_replicas, expert_parameters

W_READS_NO_PARAMETER = ("MatmulRule", "EmbeddingRule", "LayerNormRule", "GroupNormRule", "BatchNormRule")
"""The fast paths whose W reads no parameter value (closed forms of the saved input and the output
gradient; the norms' parameter gradients come from B's kernel): a unit made only of them stays
sharded during W (``docs/runtime.md``, "FSDP2 units")."""


def check_fsdp_options(fsdp: Any, data_parallel: Any) -> None:
    """``fsdp`` is None or an :class:`FSDPOptions` (the schedule layer's record, checked when made):
    with ``data_parallel="fsdp"``/``"hsdp"`` without the replicated all-reduce's buckets; with
    replicas (a count, ``"replicate"``, or a mesh's) only its ``bucket_bytes`` applies, so the FSDP
    fields must be those of ``FSDPOptions()`` (with a bucket size) or of :data:`ONCE_PER_STEP`."""
    if fsdp is None:
        return
    if not isinstance(fsdp, FSDPOptions):
        raise PipelineError(
            f"fsdp={fsdp!r}: pass FSDPOptions(units=..., reshard_after_forward=..., prefetch=..., "
            "bucket_bytes=...) or None"
        )
    if fsdp.reduce_after_step:
        raise PipelineError(
            "fsdp=FSDPOptions(reduce_after_step=True) models Megatron-LM 2021's reduction after the "
            "step for the lowering and the planner; the runtime reduces each unit or bucket when "
            "ready: drop it"
        )
    if data_parallel in ("fsdp", "hsdp"):
        if fsdp.bucket_bytes:
            raise PipelineError(
                f"fsdp=FSDPOptions(bucket_bytes={fsdp.bucket_bytes!r}): buckets are the replicated "
                "all-reduce's; FSDP reduce-scatters per unit: drop it"
            )
        return
    unbucketed = replace(fsdp, bucket_bytes=0.0)
    if unbucketed != ONCE_PER_STEP and not (fsdp.bucket_bytes and unbucketed == FSDPOptions()):
        raise PipelineError(
            f'fsdp={fsdp!r} says how data_parallel="fsdp" or "hsdp" shards, but data_parallel='
            f"{data_parallel!r} replicates, where only the all-reduce's buckets apply: pass "
            'FSDPOptions(bucket_bytes=...) alone, or data_parallel="fsdp" (or "hsdp") with a mesh'
        )


def check_sharding(sharding: Any, data_parallel: int) -> str | None:
    """``sharding`` checked against ``data_parallel`` (raises :class:`PipelineError`)."""
    if sharding not in SHARDINGS or isinstance(sharding, bool):
        raise PipelineError(
            f"sharding={sharding!r}: None (replicate the stages and all-reduce their gradients), "
            '"fsdp" (shard them over the data-parallel replicas with FSDP2) or "hsdp" (shard within '
            "a dp_shard row, replicate across rows)"
        )
    if sharding is not None and data_parallel < 2:
        raise PipelineError(
            f'data_parallel="{sharding}" shards the stages over the mesh\'s data-parallel dimension, '
            f"which has {data_parallel} rank; give it two or more"
        )
    return sharding


def check_ties(ties: Sequence[Sequence[tuple[int, str]]], bounds: Sequence[int]) -> None:
    """FSDP2 gives each parameter to one unit: a parameter tied across chunks cannot be sharded."""
    for uses in ties:
        chunks = {next(s for s in range(len(bounds) - 1) if index < bounds[s + 1]) for index, _ in uses}
        if len(chunks) > 1:
            names = ", ".join(name for _, name in uses)
            raise PipelineError(
                f'data_parallel="fsdp"/"hsdp" cannot shard the parameter tied across chunks ({names}): each '
                "chunk is one FSDP2 unit and a parameter belongs to one unit; untie it, put its uses in "
                'one chunk (partition=...), or use data_parallel="replicate"'
            )


class ShardedStages:
    """This rank's chunks as FSDP2 units over the data-parallel group, driven step by step.

    ``shard(stage, module)`` (given to :func:`~..construct.build.place_stages`) makes one chunk's
    units right after it is placed and before its backward is split: it copies replica 0's values
    first (the replicas start equal, as in the replicated path), applies ``fully_shard`` (per the
    :class:`FSDPOptions`) and unshards every unit, so that :func:`~..wgrad.install_deferral` tracks
    the unsharded parameters the forwards will see (FSDP2 keeps the same unsharded ``Parameter``
    objects across steps).  :meth:`placed` reshards them all.
    """

    def __init__(
        self,
        layout: ParallelLayout,
        device: torch.device,
        mesh: Any = None,
        options: FSDPOptions | None = None,
        wait: Callable[[Any, str], None] | None = None,
    ):
        from torch.distributed.device_mesh import DeviceMesh

        self.layout = layout
        # the user's mesh's data-parallel dimension (HSDP: its dp_replicate × dp_shard submesh, which
        # fully_shard reads as replicate × shard), else a 1-D mesh over the layout's dp group
        self.mesh = mesh or DeviceMesh.from_group(layout.dp_group, device.type, mesh_dim_names=("dp",))
        self.options = options or ONCE_PER_STEP
        self.layered = not self.options.once_per_step  # units driven by FSDP2's hooks, op by op
        self.units: dict[int, Any] = {}  # stage index -> the chunk's root FSDPModule (a StageModule)
        self.layer_units: dict[int, list[Any]] = {}  # stage index -> its units in forward order
        self._readers: dict[int, list[Any]] = {}  # stage index -> the units its W reads
        self._unsharded: set[int] = set()
        self._pending: dict[int, Any] = {}  # stage -> its all-gather's handle, issued not yet waited
        self._params: list[Any] = []  # the layered units' FSDPParams
        # expert parallelism: each chunk's expert shards, which FSDP2 ignores, averaged as the
        # replicated path averages them (a bucket a chunk, over the replicas holding the same experts)
        self._experts: dict[int, list[nn.Parameter]] = {}
        self._wait = wait
        self._expert_average = self._expert_averager()  # remade once every chunk is placed
        self.in_step = False  # between begin_step and the step's end (reshard)

    def shard(self, stage: int, module: nn.Module) -> None:
        """Make ``module`` (chunk ``stage``'s StageModule) FSDP2 units, left unsharded (collective
        over the data-parallel group)."""
        from torch.distributed.fsdp import fully_shard

        broadcast_replicas(module, self.layout, self.layout.grid.pipeline_rank)  # the experts' own way
        # the experts are already cut over "ep" (DTensors): FSDP2 leaves them alone (see reduce)
        self._experts[stage] = expert_parameters([module])
        ignored = set(self._experts[stage]) or None
        units: list[Any] = []
        if self.layered:
            layers = list(getattr(module, "layers", ()))
            size = self.options.unit_size(len(layers))
            for start in range(0, len(layers), size):
                group = layers[start : start + size]
                shard = fully_shard(
                    group if len(group) > 1 else group[0],
                    mesh=self.mesh,
                    reshard_after_forward=self.options.reshard_after_forward,
                    ignored_params=ignored,
                )
                units.append(shard[0] if isinstance(shard, list) else shard)
            _set_prefetch(units, self.options.prefetch)
            for unit in units:
                self._params += [_keep_split_view(param, self) for param in _fsdp_params(unit)]
        root: Any = fully_shard(module, mesh=self.mesh, reshard_after_forward=False, ignored_params=ignored)
        self._quiet(root)
        for unit in (*units, root):
            unit.unshard()
        self.units[stage], self.layer_units[stage] = root, units
        self._unsharded.add(stage)

    def placed(self, deferrals: Mapping[int, Any] | None = None) -> None:
        """Reshard every unit once construction is done (the optimizer must see the shards); note
        which units each chunk's W reads, from its split (``deferrals``: stage -> ``Deferral``)."""
        for stage, units in self.layer_units.items():
            deferral = (deferrals or {}).get(stage)
            self._readers[stage] = [unit for unit in units if deferral is None or _w_reads(unit, deferral)]
        self._expert_average = self._expert_averager()
        self.reshard()

    def _expert_averager(self) -> GradientAverager:
        """The average of the chunks' expert gradients, one bucket a chunk, as the replicated path
        reduces them (over the replicas holding the same experts, divided by every replica)."""
        experts = [param for params in self._experts.values() for param in params]
        buckets = {stage: [params] for stage, params in self._experts.items()}
        return GradientAverager(
            buckets, None, self.layout.grid.replicas, self._wait,
            experts=experts, expert_group=self.layout.expert_group,
        )  # fmt: skip

    def weight_readers(self, stage: int) -> list[Any]:
        """The units of chunk ``stage`` whose W may read parameter values (layered units only):
        gathered around its W ops (:meth:`gather_for_w`)."""
        return self._readers.get(stage, []) if self.layered else []

    # -- the step --------------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """A training step starts: resharded layered units keep their unsharded parameters registered
        (:func:`_keep_split_view`) until :meth:`reshard` at the step's end."""
        self.in_step = self.layered

    def comm_handler(self, action: Issue | Wait) -> Callable[[], None] | None:
        """A lowered program's FSDP action on this rank (:class:`~..execute.program.Communication`).

        Chunk units (the default): ``issue unshard`` starts the chunk's all-gather, ``wait unshard``
        waits for it, ``issue reduce_scatter`` reduce-scatters and reshards the chunk (its reshard and
        the reduction's wait are FSDP2's, inside).  Layered units: FSDP2's per-module hooks gather and
        reshard them inside the ops; the chunk's units are reduce-scattered together by the root's
        callback, at the issue of its unit 0 (the last reduced; every unit's gradients are final by
        then: the op ran whole at its first part).
        """
        comm = action.comm
        if comm.kind is CommKind.REDUCE_SCATTER and isinstance(action, Issue):
            return functools.partial(self.reduce, comm.stage) if comm.index == 0 else None
        if comm.kind is not CommKind.UNSHARD or self.layered:
            return None
        work = self.issue_unshard if isinstance(action, Issue) else self.wait_unshard
        return functools.partial(work, comm.stage)

    def compute_handler(self, op: Op, handler: Callable[[Any, int], None]) -> Callable[[Any, int], None]:
        """A W op of a chunk whose W reads gathered units (:meth:`weight_readers`): gathered before it,
        released after (FSDP2's hooks do not run in W); any other op as it is."""
        if op.kind is not Kind.W or not self.weight_readers(op.stage):
            return handler
        gather = functools.partial(self.gather_for_w, op.stage)
        release = functools.partial(self.release_after_w, op.stage)

        def gathered(state: Any, microbatch: int) -> None:
            gather()
            handler(state, microbatch)
            release()

        return gathered

    def issue_unshard(self, stage: int) -> None:
        """Chunk units: start chunk ``stage``'s all-gather (no-op when it is whole)."""
        if stage not in self._unsharded:
            self._quiet(self.units[stage])
            self._pending[stage] = self.units[stage].unshard(async_op=True)
            self._unsharded.add(stage)

    def wait_unshard(self, stage: int) -> None:
        """Chunk units: wait for chunk ``stage``'s all-gather (:meth:`issue_unshard`)."""
        handle = self._pending.pop(stage, None)
        if handle is not None:
            handle.wait()

    def unshard(self) -> None:
        """Once-per-step layout: all-gather every chunk (before the first forward or an evaluation);
        no-op for unsharded ones.  Layered units are gathered by FSDP2's hooks as they run."""
        if self.layered:
            return
        handles = []
        for stage, unit in self.units.items():
            if stage not in self._unsharded:
                self._quiet(unit)
                handles.append(unit.unshard(async_op=True))
                self._unsharded.add(stage)
        for handle in handles:
            if handle is not None:
                handle.wait()

    def gather_for_w(self, stage: int) -> None:
        """Before a W op of chunk ``stage``: all-gather the units its W reads (all started, then waited)."""
        handles = [unit.unshard(async_op=True) for unit in self.weight_readers(stage)]
        for handle in handles:
            if handle is not None:
                handle.wait()

    def release_after_w(self, stage: int) -> None:
        """After a W op of chunk ``stage``: reshard what :meth:`gather_for_w` gathered (with
        ``reshard_after_backward``; otherwise the units stay whole until the reduce-scatter)."""
        if self.options.reshard_after_backward:
            for unit in self.weight_readers(stage):
                unit.reshard()

    @torch.no_grad()
    def reduce(self, stage: int) -> None:
        """Reduce-scatter chunk ``stage``'s gradients through FSDP2 and reshard it (after its last
        gradient op): what torch's ``perform_reduce_grad`` does."""
        from torch.distributed.fsdp import fully_shard

        unit = self.units[stage]
        unit.set_is_last_backward(True)
        unit.set_reshard_after_backward(True)
        unit.set_requires_gradient_sync(True)
        try:
            state = fully_shard.state(unit)  # type: ignore[attr-defined]
            for each in state._state_ctx.all_states:
                for group in each._fsdp_param_groups:
                    group.post_backward()
            state._root_post_backward_final_callback()
        finally:
            self._quiet(unit)
        self._unsharded.discard(stage)
        self._expert_average.start(stage)  # waited for at the step's end (reshard)

    def reshard(self) -> None:
        """Reshard every unit still unsharded (a step's end, an evaluation, construction); the expert
        gradients' averages are waited for."""
        self._expert_average.finish()
        for stage in sorted(self._unsharded):
            self.units[stage].reshard()
        self._unsharded.clear()
        for units in self.layer_units.values():
            for unit in units:
                unit.reshard()
        self.in_step = False
        for param in self._params:  # the step is over: the modules show their shards again
            if param.sharded_state == _sharded_state():
                param._setattr_on_modules(param.sharded_param)

    def discard(self) -> None:
        """After a failed step: drop the unsharded state (the Pipeline is unusable afterwards)."""
        self._expert_average.discard()  # not waited for: a failed peer may never post its part
        try:
            self.reshard()
        except Exception:  # the failure that stopped the step is the one to report
            self._unsharded.clear()
        self._pending.clear()

    def _quiet(self, unit: Any) -> None:
        """During a step: FSDP2's own backward hooks reduce nothing (B runs before W); layered units
        with ``reshard_after_backward`` are resharded after each B."""
        unit.set_is_last_backward(False)
        unit.set_reshard_after_backward(self.layered and bool(self.options.reshard_after_backward))
        unit.set_requires_gradient_sync(False)


def _set_prefetch(units: Sequence[Any], depth: int) -> None:
    """Each unit gathers the next ``depth`` units in its forward and the previous ``depth`` in its
    backward, explicitly.  A unit with nothing to prefetch lists itself (a no-op: it is unsharded by
    then): with an empty list FSDP2 prefetches the unit whose forward ran before in its order of every
    microbatch's forwards — a later microbatch's last layer, left gathered until the chunk's reduce."""
    for index, unit in enumerate(units):
        unit.set_modules_to_forward_prefetch(list(units[index + 1 : index + 1 + depth]))
        before = list(reversed(units[max(index - depth, 0) : index])) if depth else []
        unit.set_modules_to_backward_prefetch(before or [unit])


def _fsdp_params(unit: Any) -> list[Any]:
    """The FSDPParams of one unit (FSDP2's param group of its state; none without parameters)."""
    from torch.distributed.fsdp import fully_shard

    group = fully_shard.state(unit)._fsdp_param_group  # type: ignore[attr-defined]
    return list(group.fsdp_params) if group is not None else []


def _sharded_state() -> Any:
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    return ShardedState.SHARDED


def _keep_split_view(param: Any, stages: ShardedStages) -> Any:
    """``param`` (an FSDPParam) resharding as FSDP2 does, except that during a step its module keeps
    the unsharded ``Parameter`` registered, its storage freed.  Why: the split's W resolves a layer's
    parameters through the module when it adds into ``.grad`` (the fast paths' rules), after the
    unit was resharded; the gradients must reach the unsharded parameters FSDP2 reduce-scatters.
    Nothing reads their freed values: forwards and B gather first, W gathers the units it reads."""
    to_sharded = param.to_sharded

    def resharded() -> None:
        to_sharded()
        if stages.in_step:
            param._setattr_on_modules(param._unsharded_param)

    param.to_sharded = resharded
    return param


def _w_reads(unit: nn.Module, deferral: Any) -> bool:
    """Whether W may read a parameter value of ``unit``: it holds a module with parameters that is
    not a fast path of :data:`W_READS_NO_PARAMETER` (a generic split, a convolution, a compiled or
    fallen-back layer, a user rule)."""
    for module in unit.modules():
        if isinstance(module, ExpertParallelExperts):
            continue  # its weights are not FSDP2's (ShardedStages.shard): nothing to gather for them
        if any(p is not None for p in module._parameters.values()):
            path = deferral.path_of(module)
            if not any(path == f"fast path ({rule})" for rule in W_READS_NO_PARAMETER):
                return True
    return False


@contextmanager
def parameter_peak() -> Iterator[ParameterPeak]:
    """The peak parameter bytes FSDP2 holds on this rank while the block runs (:class:`ParameterPeak`)."""
    peak = ParameterPeak()
    with peak.tracking():
        yield peak


class ParameterPeak:
    """The most bytes of parameters this rank's FSDP2 units held at once: every distinct storage of
    their shards, gathered (unsharded) parameters and pending all-gather buffers, summed right after
    each all-gather is started or completed (the only moments the total grows)."""

    def __init__(self) -> None:
        self.peak = 0
        self.shards = 0
        self._groups: dict[int, Any] = {}

    @contextmanager
    def tracking(self) -> Iterator[None]:
        """Patch FSDP2's param group's ``unshard`` and ``wait_for_unshard`` to sample after each."""
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        originals = {name: getattr(FSDPParamGroup, name) for name in ("unshard", "wait_for_unshard")}

        def sampled(original: Callable[..., Any]) -> Callable[..., Any]:
            def run(group: Any, *args: Any, **kwargs: Any) -> Any:
                self._groups[id(group)] = group
                result = original(group, *args, **kwargs)
                self.sample()
                return result

            return run

        for name, original in originals.items():
            setattr(FSDPParamGroup, name, sampled(original))
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(FSDPParamGroup, name, original)

    def sample(self) -> int:
        """The bytes held now (and the peak updated)."""
        storages: dict[int, int] = {}
        shards: dict[int, int] = {}
        for group in self._groups.values():
            for param in group.fsdp_params:
                local = param._sharded_local_tensor
                shards[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
                for tensor in (*param.all_gather_outputs, getattr(param, "_unsharded_param", None)):
                    if tensor is not None and tensor.untyped_storage().nbytes() > 0:
                        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            pending = group._all_gather_result
            if pending is not None and pending.all_gather_output is not None:
                storage = pending.all_gather_output.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        self.shards = sum(shards.values())
        total = self.shards + sum(storages.values())
        self.peak = max(self.peak, total)
        return total


ShardFn = Callable[[int, nn.Module], None]
"""``shard(stage, stage_module)``: what :func:`~..construct.build.place_stages` calls before splitting
a chunk."""
