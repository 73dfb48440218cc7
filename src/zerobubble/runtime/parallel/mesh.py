"""A Pipeline on a ``DeviceMesh``: the mesh read into a :class:`~...schedule.grid.Grid`.

The mesh's ``"pp"`` dimension carries the pipeline (its stages, in rank order along it); the
data-parallel replicas run along the optional ``"dp"`` dimension (replicated or FSDP2-sharded), or
along the pair ``"dp_replicate"`` × ``"dp_shard"`` (HSDP: sharded within a row, replicated across
rows, torchtitan's names); the optional ``"ep"`` dimension holds replicas too, each with its own
batch shard, whose experts are disjoint (:mod:`.experts`); every other dimension (``"tp"``, or any
the user adds) lives *inside* a stage: each coordinate along them runs its own copy of the pipeline
grid, with the stages' layers parallelised over it by ``parallelize``.  The role names are
configurable (``mesh_dims={"pp": "pipe", "dp": "data"}``).

Which dimension does what is checked on the mesh's names and sizes alone (the grid's
:func:`~...schedule.grid.mesh_roles`); :func:`grid_of_mesh` places this rank on it.  The pipeline
and data-parallel groups are the mesh's own; the few others the Pipeline needs (control, ties,
channels, the call check) are created by their members only (:mod:`.groups`,
:func:`~.data_parallel.build_layout`), so a Pipeline never makes a world-wide ``new_group`` call and
builds on any slice of a larger mesh.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from ...schedule.grid import ROLES as _ROLES
from ...schedule.grid import Grid
from .. import PipelineError

__all__ = [
    "ROLES",
]

ROLES = tuple(_ROLES)
"""The dimensions a Pipeline knows by role: pipeline, data parallelism (one dimension, or HSDP's
replicate × shard pair), tensor parallelism (:data:`~...schedule.grid.ROLES` says what each does)."""


def grid_of_mesh(mesh: Any, roles: Mapping[str, str] | None, data_parallel: int | str | None) -> Grid:
    """``mesh``'s :class:`~...schedule.grid.Grid` with ``mesh_dims=`` ``roles`` and ``data_parallel``
    (checked, :meth:`~...schedule.grid.Grid.of_mesh`), placed at this rank's coordinates."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    grid = Grid.of_mesh(
        names, [int(size) for size in mesh.mesh.shape], roles=roles, data_parallel=data_parallel
    )
    _check_expert_grid(grid)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise PipelineError(f"rank {dist.get_rank()} is not in the mesh passed as mesh=")
    return grid.on_mesh([int(rank) for rank in mesh.mesh.flatten().tolist()], list(coordinate))


def mesh_groups(mesh: Any) -> list[Any]:
    """The mesh's process groups, one per dimension (together they connect all its ranks)."""
    return [mesh.get_group(name) for name in mesh.mesh_dim_names]


def mesh_ranks(mesh: Any) -> list[int]:
    """Every global rank of ``mesh``, sorted."""
    return sorted(int(rank) for rank in mesh.mesh.flatten().tolist())


def data_mesh(mesh: Any, grid: Grid) -> Any:
    """The submesh FSDP2 shards over (None: the caller makes a 1-D mesh of the replicas' group).

    Without ``"ep"``: the data-parallel dimensions (None without one), 1-D, or HSDP's
    ``dp_replicate × dp_shard``, which ``fully_shard`` reads as replicate × shard.  With ``"ep"``
    alone, it; with ``"dp"`` and ``"ep"`` None: the replicas' flattened column, every one a shard."""
    if grid.ep > 1:  # every replica a shard: ep's own group, or the flattened dp × ep column
        return mesh[grid.replica_dims[0]] if len(grid.replica_dims) == 1 else None
    data = grid.data_dims
    if not data:
        return None
    return mesh[data[0]] if len(data) == 1 else mesh[data]


def _check_expert_grid(grid: Grid) -> None:
    """What expert parallelism runs with today: replicated or FSDP2-sharded data parallelism along
    one ``"dp"`` dimension at most (no HSDP rows); dimensions inside a stage (``"tp"``) run the
    experts whole on each of their ranks (``docs/runtime.md``, "Expert parallelism")."""
    if grid.ep == 1:
        return
    if grid.sharding not in (None, "fsdp"):
        raise PipelineError(
            f'an "ep" dimension with data_parallel={grid.sharding!r}: expert parallelism runs with '
            'replicated data parallelism or FSDP2 over the replicas; pass data_parallel="replicate" '
            '(the default) or "fsdp", on a mesh of "pp", "dp" and "ep" (and "tp")'
        )
    if len(grid.data_dims) > 1:
        raise PipelineError(
            f'an "ep" dimension with the data-parallel dimensions {list(grid.data_dims)}: expert '
            'parallelism runs beside one "dp" dimension at most'
        )
