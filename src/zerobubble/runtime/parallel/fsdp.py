"""FSDP2 for the data-parallel dimension: ``Pipeline(..., mesh=mesh, data_parallel="fsdp")``.

Each of this rank's chunks (its :class:`~..construct.staging.StageModule`) is one FSDP2 unit: torch's own
``fully_shard`` over the mesh's data-parallel dimension.  The Pipeline drives
it explicitly, the way torch's pipelining runtime does (``torch/distributed/pipelining/stage.py``):

* every chunk is all-gathered (``unshard``) once per step, just before this rank's first forward
  (after the pending optimizer step is settled), and stays unsharded for every microbatch's F, B
  and W: ``reshard_after_forward=False``, and during the step ``set_reshard_after_backward(False)``,
  ``set_requires_gradient_sync(False)``, ``set_is_last_backward(False)``, so the post-backward hooks
  FSDP2 fires in each B reduce nothing;
* after a chunk's last gradient op (its last W, B or BW: :func:`~.data_parallel.last_gradient_ops`)
  its gradients are reduce-scattered by FSDP2's own reduction: with gradient sync switched on, each
  param group's ``post_backward()`` (which reads the unsharded parameters' ``.grad``, where W wrote
  them) and the root's ``_root_post_backward_final_callback()``, as ``perform_reduce_grad`` does;
  that also reshards the chunk, whose parameters the step no longer reads;
* whatever is still unsharded at the step's end (an evaluation) is resharded.

FSDP2 averages over the group, which is the replicated path's average: gradients of the mean loss
over the global batch.

One unit per chunk, not per layer: every layer of a chunk stays unsharded for the whole step anyway,
so per-layer units would only multiply the collectives (why: ``docs/guide.md``, "FSDP2").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ...schedule.modelplan.layout import SHARDINGS
from .. import PipelineError
from .consistency import broadcast_replicas
from .data_parallel import ParallelLayout


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

    ``shard(module)`` (given to :func:`~..construct.build.place_stages`) makes one chunk a unit right after it
    is placed and before its backward is split: it copies replica 0's values first (the replicas
    start equal, as in the replicated path), applies ``fully_shard`` and unshards it, so that
    :func:`~..wgrad.install_deferral` tracks the unsharded parameters the forwards will see (FSDP2
    keeps the same unsharded ``Parameter`` objects across steps).  :meth:`placed` reshards them all.
    """

    def __init__(self, layout: ParallelLayout, device: torch.device, mesh: Any = None):
        from torch.distributed.device_mesh import DeviceMesh

        self.layout = layout
        # the user's mesh's data-parallel dimension (HSDP: its dp_replicate × dp_shard submesh, which
        # fully_shard reads as replicate × shard), else a 1-D mesh over the layout's dp group
        self.mesh = mesh or DeviceMesh.from_group(layout.dp_group, device.type, mesh_dim_names=("dp",))
        self.units: dict[int, Any] = {}  # stage index -> the FSDPModule (a StageModule)
        self._source = layout.grid.global_rank(layout.grid.pipeline_rank, 0)
        self._unsharded: set[int] = set()

    def shard(self, stage: int, module: nn.Module) -> None:
        """Make ``module`` (chunk ``stage``'s StageModule) an FSDP2 unit, left unsharded (collective
        over the data-parallel group)."""
        from torch.distributed.fsdp import fully_shard

        broadcast_replicas(module, self.layout.dp_group, self._source)
        unit: Any = fully_shard(module, mesh=self.mesh, reshard_after_forward=False)
        self._quiet(unit)
        unit.unshard()
        self.units[stage] = unit
        self._unsharded.add(stage)

    def placed(self) -> None:
        """Reshard every unit once construction is done (the optimizer must see the shards)."""
        self.reshard()

    # -- the step --------------------------------------------------------------------------------------

    def unshard(self) -> None:
        """All-gather every chunk (once a step, before the first forward); no-op for unsharded ones."""
        handles = []
        for stage, unit in self.units.items():
            if stage not in self._unsharded:
                self._quiet(unit)
                handles.append(unit.unshard(async_op=True))
                self._unsharded.add(stage)
        for handle in handles:
            if handle is not None:
                handle.wait()

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

    def reshard(self) -> None:
        """Reshard every chunk still unsharded (a step's end, an evaluation, construction)."""
        for stage in sorted(self._unsharded):
            self.units[stage].reshard()
        self._unsharded.clear()

    def discard(self) -> None:
        """After a failed step: drop the unsharded state (the Pipeline is unusable afterwards)."""
        try:
            self.reshard()
        except Exception:  # the failure that stopped the step is the one to report
            self._unsharded.clear()

    @staticmethod
    def _quiet(unit: Any) -> None:
        """During a step: FSDP2's own backward hooks neither reduce nor reshard (B runs before W)."""
        unit.set_is_last_backward(False)
        unit.set_reshard_after_backward(False)
        unit.set_requires_gradient_sync(False)


ShardFn = Callable[[int, nn.Module], None]
"""``shard(stage, stage_module)``: what :func:`~..construct.build.place_stages` calls before splitting
a chunk."""
