"""What a Pipeline's construction resolves before it builds anything: its world and its resolution.

:func:`world_of` joins the process group (or the mesh), picks the device and reads the grid;
:func:`planned_resolution` profiles and plans when ``schedule="auto"`` or ``partition="profile"``
asks (:mod:`.auto`); :func:`agreed_resolution` resolves the arguments otherwise and has every rank
agree on the result (:func:`~.resolve.agree_on`).  The Pipeline then builds this rank's part of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ...schedule import CostModel, Schedule
from ...schedule.grid import Grid
from .. import PipelineError
from ..launch import check_timeout, init_distributed, local_device
from ..parallel.groups import equalize_group_counts, local_group
from ..parallel.mesh import grid_of_mesh, mesh_groups, mesh_ranks
from ..vocab.runner import plain_model
from .resolve import LossFn, Resolution, agree_on, resolve, wants_profile

if TYPE_CHECKING:
    from ..parallel.consistency import Agreement
    from .auto import Calibrator


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
    grid = (
        grid_of_mesh(mesh, mesh_dims, data_parallel) if mesh is not None else _flat_grid(group, data_parallel)
    )
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
    layers: Sequence[nn.Module] | nn.Sequential,
    world: World,
    *,
    schedule: str | Schedule,
    partition: Sequence[int] | str | None,
    example: Any,
    loss_fn: LossFn | None,
    microbatches: int | None,
    memory_limit: str | float | None,
    post_validation: bool,
    chunks: int | None,
    calibrate: int,
    vocab_layers: tuple[Any, Any],
    parallelized: bool,
) -> tuple[Resolution | None, Calibrator | None, tuple[Any, Any]]:
    """The planner's resolution when ``schedule="auto"`` or ``partition="profile"`` asks for one
    (collective: profile, plan once, broadcast), the calibrator of its first steps, and the
    vocabulary layers still to place (none when the plain model won); ``(None, None, vocab_layers)``
    otherwise."""
    if not wants_profile(schedule, partition):
        return None, None, vocab_layers
    from .auto import Calibrator, VocabPlanning, resolve_auto

    head, embedding = vocab_layers
    profiled, vocab = layers, None
    if head is not None:  # the planner weighs a plain head against the vocabulary-parallel one
        profiled, loss_fn = plain_model(head, embedding, layers)
        vocab = VocabPlanning(layers, embedding=embedding is not None)
        calibrate = 0  # the calibration models stages only, not the vocabulary ops
    calibrator = Calibrator(calibrate) if calibrate else None  # checked before collectives
    planned = resolve_auto(
        profiled,
        example,
        loss_fn,
        world.group,
        world.grid.pp,
        microbatches,
        memory_limit,
        post_validation,
        world.device,
        schedules=[schedule] if isinstance(schedule, str) and partition == "profile" else None,
        chunks=chunks,
        vocab=vocab,
        layout=world.stage_layout(parallelized),
    )
    if vocab is not None and planned.plan is not None and not planned.plan.winner.vocab_parallel:
        vocab_layers = (None, None)  # the plain model won: its layers hold head and embedding
    return planned, calibrator, vocab_layers


def agreed_resolution(
    layers: Sequence[nn.Module] | nn.Sequential,
    world: World,
    planned: Resolution | None,
    *,
    schedule: str | Schedule,
    microbatches: int | None,
    loss_fn: LossFn | None,
    chunks: int | None,
    partition: Sequence[int] | str | None,
    costs: CostModel | None,
    vocab_parallel: bool,
    seed: int | None,
    verify: bool | str,
    check_calls: bool,
) -> tuple[Resolution, Agreement]:
    """``planned``, or the arguments resolved, once every rank agrees on it (collective)."""

    def attempt() -> Resolution:
        if planned is not None:
            return planned
        return resolve(
            layers,
            ranks=world.grid.pp * world.grid.dp,
            data_parallel=world.grid.dp,
            schedule=schedule,
            microbatches=microbatches,
            loss_fn=loss_fn,
            chunks=chunks,
            partition=None if isinstance(partition, str) else partition,
            costs=costs,
            vocab_parallel=vocab_parallel,
        )

    return agree_on(
        attempt,
        data_parallel=world.grid.dp,
        seed=seed,
        group=world.group,
        verify=verify,
        check_calls=bool(check_calls),
        sharding=world.grid.sharding,
    )
