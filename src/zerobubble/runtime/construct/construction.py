"""What a Pipeline's construction resolves before it builds anything: its world and its resolution.

:func:`world_of` joins the process group (or the mesh), picks the device and sizes the layout;
:func:`planned_resolution` profiles and plans when the :class:`~.request.PipelineRequest` asks
(``schedule="auto"`` or ``partition="profile"``, :mod:`.auto`); :func:`agreed_resolution` resolves
the request otherwise and has every rank agree on the result (:func:`~.resolve.agree_on`).  The
Pipeline then builds this rank's part of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ...schedule.modelplan import MeshLayout
from .. import PipelineError
from ..launch import check_timeout, init_distributed, local_device
from ..parallel.data_parallel import pipeline_size_of
from ..parallel.groups import equalize_group_counts, local_group
from ..parallel.mesh import MeshDims, mesh_groups, mesh_ranks, parallel_size, stage_layout
from ..parallel.mesh import mesh_dims as mesh_dims_of
from .resolve import Resolution, agree_on, resolve

if TYPE_CHECKING:
    from ..parallel.consistency import Agreement
    from .auto import Calibrator
    from .request import PipelineRequest


@dataclass(frozen=True)
class World:
    """Where a Pipeline runs: its device, its group (every rank of the mesh, with one), the mesh's
    roles, the ranks of the pipeline grid, the replicas and how they hold the parameters."""

    device: torch.device
    group: dist.ProcessGroup | None
    mesh: Any
    dims: MeshDims | None
    size: int
    data_parallel: int
    sharding: str | None

    def stage_layout(self, parallelized: bool) -> MeshLayout | None:
        """Each stage's ranks for the planner: the mesh's, or the replicas (None: one rank)."""
        if self.mesh is not None and self.dims is not None:
            return stage_layout(self.mesh, self.dims, self.data_parallel, self.sharding, parallelized)
        return MeshLayout(dp=self.data_parallel) if self.data_parallel > 1 else None


def world_of(
    group: dist.ProcessGroup | None,
    mesh: Any,
    mesh_dims: Mapping[str, str] | None,
    data_parallel: int | str | None,
    timeout: float,
) -> World:
    """Join the group (initialised from the environment if needed) or the mesh (collective).

    The arguments are checked first, the same way on every rank, so a bad one raises
    :class:`PipelineError` on each rank before any collective."""
    check_timeout(timeout)
    if mesh is not None and group is not None:
        raise PipelineError("pass mesh= or group=, not both (the mesh's pipeline dimension is the group)")
    backend = init_distributed(timeout=timeout) if group is None else dist.get_backend(group)
    device = local_device(backend)  # before the first collective (NCCL needs it)
    dims = mesh_dims_of(mesh, mesh_dims) if mesh is not None else None
    # local groups are named by each rank's group count: make the counts equal first (.groups)
    setup = timedelta(seconds=max(timeout, 60.0))
    equalize_group_counts(mesh_groups(mesh) if mesh is not None else [group], timeout=setup)
    if mesh is not None:  # the Pipeline's world: every rank of the mesh (agreement, planning)
        group = local_group(mesh_ranks(mesh), timeout=setup)
    size, replicas, sharding = parallel_size(data_parallel, mesh, dims, group)
    return World(device, group, mesh, dims, size, replicas, sharding)


def planned_resolution(
    request: PipelineRequest, world: World
) -> tuple[Resolution | None, Calibrator | None, tuple[Any, Any]]:
    """The planner's resolution when ``schedule="auto"`` or ``partition="profile"`` asks for one
    (collective: profile, plan once, broadcast), the calibrator of its first steps, and the
    vocabulary layers still to place (none when the plain model won); ``(None, None, vocab_layers)``
    otherwise."""
    vocab_layers = request.vocab_layers
    if not request.wants_profile:
        return None, None, vocab_layers
    from .auto import Calibrator, Planning, resolve_auto
    from .staging import DEFAULT_MICROBATCHES

    # the calibration models stages only, not the vocabulary ops
    calibrate = request.calibrate if not request.vocab_parallel else 0
    calibrator = Calibrator(calibrate) if calibrate else None  # checked before collectives
    schedule, partition = request.schedule, request.partition
    planning = Planning(
        ranks=pipeline_size_of(world.size, world.data_parallel),
        microbatches=request.microbatches or DEFAULT_MICROBATCHES,
        memory_limit=request.memory_limit,
        post_validation=request.post_validation,
        schedules=(schedule,) if isinstance(schedule, str) and partition == "profile" else None,
        chunks=request.chunks,
        # with head= the planner weighs a plain head (and embedding) against the vocabulary-parallel ones
        head="both" if request.vocab_parallel else "plain",
        vocab_embedding=request.vocab_parallel and request.embedding is not None,
        layout=world.stage_layout(request.parallelized),
    )
    planned = resolve_auto(request, world.group, world.device, planning)
    if request.vocab_parallel and planned.plan is not None and not planned.plan.winner.vocab_parallel:
        vocab_layers = (None, None)  # the plain model won: its layers hold head and embedding
    return planned, calibrator, vocab_layers


def agreed_resolution(
    request: PipelineRequest, world: World, planned: Resolution | None
) -> tuple[Resolution, Agreement]:
    """``planned``, or ``request`` resolved, once every rank agrees on it (collective)."""

    def attempt() -> Resolution:
        if planned is not None:
            return planned
        return resolve(request, ranks=world.size, data_parallel=world.data_parallel)

    return agree_on(
        attempt,
        data_parallel=world.data_parallel,
        seed=request.seed,
        group=world.group,
        verify=request.verify,
        check_calls=bool(request.check_calls),
        sharding=world.sharding,
    )
