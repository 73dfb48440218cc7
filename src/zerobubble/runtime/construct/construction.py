"""What a Pipeline's construction resolves before it builds anything: its world and its resolution.

:func:`world_of` joins the process group (or the mesh), picks the device and reads the grid;
:func:`planned_resolution` profiles and plans when the :class:`~.request.PipelineRequest` asks
(``schedule="auto"`` or ``partition="profile"``, :mod:`.auto`); :func:`agreed_resolution` resolves
the request otherwise and has every rank agree on the result (:func:`~.resolve.agree_on`).  The
Pipeline then builds this rank's part of it, with the data-parallel options :func:`run_options` says.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ...schedule.grid import Grid
from ...schedule.sharding import FSDPOptions
from .. import PipelineError
from ..execute.pairs import check_threaded_grid
from ..launch import init_distributed, local_device
from ..parallel.experts import check_expert_layers
from ..parallel.groups import equalize_group_counts, local_group
from ..parallel.mesh import grid_of_mesh, mesh_groups, mesh_ranks
from .resolve import Resolution, agree_on, resolve

if TYPE_CHECKING:
    from ..parallel.consistency import Agreement
    from .auto import Calibrator
    from .request import PipelineRequest


@dataclass(frozen=True)
class World:
    """Where a Pipeline runs: its device, its group (every rank of the mesh, with one), the mesh, and
    the :class:`~...schedule.grid.Grid` of its ranks (sizes, roles, this rank's place)."""

    device: torch.device
    group: dist.ProcessGroup | None
    mesh: Any
    grid: Grid

    def stage_layout(self, parallelized: bool) -> Grid | None:
        """Each stage's ranks for the planner: the mesh's, or the replicas (None: one rank)."""
        if self.mesh is not None or self.grid.dp > 1:
            return self.grid.stage_grid(parallelized=parallelized)
        return None


def world_of(request: PipelineRequest) -> World:
    """Join the request's group (initialised from the environment if needed) or mesh (collective).

    The grid's arguments are checked first, the same way on every rank, so a bad one raises
    :class:`PipelineError` on each rank before any collective."""
    group, mesh, timeout = request.group, request.mesh, request.timeout
    if mesh is not None and group is not None:
        raise PipelineError("pass mesh= or group=, not both (the mesh's pipeline dimension is the group)")
    backend = init_distributed(timeout=timeout) if group is None else dist.get_backend(group)
    device = local_device(backend)  # before the first collective (NCCL needs it)
    grid = (
        grid_of_mesh(mesh, request.mesh_dims, request.data_parallel)
        if mesh is not None
        else _flat_grid(group, request.data_parallel)
    )
    check_expert_layers(request.layers, grid.ep)  # alike on every rank, before any collective
    check_threaded_grid(request.overlap, grid, request.vocab_parallel)
    # local groups are named by each rank's group count: make the counts equal first (.groups)
    setup = timedelta(seconds=max(timeout, 60.0))
    equalize_group_counts(mesh_groups(mesh) if mesh is not None else [group], timeout=setup)
    if mesh is not None:  # the Pipeline's world: every rank of the mesh (agreement, planning)
        group = local_group(mesh_ranks(mesh), timeout=setup)
    return World(device, group, mesh, grid)


def _flat_grid(group: dist.ProcessGroup | None, data_parallel: int | str | None) -> Grid:
    """The grid of ``group``'s ranks (the world when None) split into ``data_parallel`` replicas,
    placed at this rank."""
    grid = Grid.flat(dist.get_world_size(group), data_parallel)
    ranks = dist.get_process_group_ranks(group) if group is not None else range(grid.pp * grid.dp)
    return grid.on_group(list(ranks), dist.get_rank(group))


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
        ranks=world.grid.pp,
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
    experts = world.mesh[world.grid.dim("ep")].get_group() if world.grid.ep > 1 else None
    planned = resolve_auto(request, world.group, world.device, planning, experts_group=experts)
    planned = _passed_options_said(request, planned)
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
        return resolve(request, ranks=world.grid.pp * world.grid.dp, data_parallel=world.grid.dp)

    return agree_on(
        attempt,
        data_parallel=world.grid.replicas,  # the ep ranks too: FSDP2 shards over every replica
        seed=request.seed,
        group=world.group,
        verify=request.verify,
        check_calls=bool(request.check_calls),
        sharding=world.grid.sharding,
        fsdp=run_options(request, planned),
    )


def run_options(request: PipelineRequest, resolution: Resolution | None) -> FSDPOptions | None:
    """The data-parallel options the Pipeline runs: ``fsdp=`` as passed; else, planned with replicas,
    those the plan chose (``plan.comm``: FSDP units, resharding and prefetch, or the all-reduce's
    bucket size; alike on every rank, the plan being broadcast); else None (the runtime's default)."""
    plan = resolution.plan if resolution is not None else None
    if request.fsdp is not None or plan is None or plan.comm is None:
        return request.fsdp
    return plan.comm.options


def _passed_options_said(request: PipelineRequest, planned: Resolution) -> Resolution:
    """``planned`` whose plan's reason says the Pipeline runs ``fsdp=`` as passed, not its choice."""
    plan = planned.plan
    if request.fsdp is None or plan is None or plan.comm is None:
        return planned
    mode = plan.comm.timeline.lowered.grid.dp_mode
    passed, chosen = request.fsdp.describe(mode), plan.comm.options.describe(mode)
    said = "the planned choice" if request.fsdp == plan.comm.options else f"not the planned {chosen}"
    return replace(
        planned, plan=replace(plan, reason=f"{plan.reason}; runs fsdp= as passed ({passed}), {said}")
    )
