"""A Pipeline on a ``DeviceMesh``: which dimension does what, and this rank's layout on it.

The mesh's ``"pp"`` dimension carries the pipeline (its stages, in rank order along it); the
data-parallel replicas run along the optional ``"dp"`` dimension (replicated or FSDP2-sharded), or
along the pair ``"dp_replicate"`` × ``"dp_shard"`` (HSDP: sharded within a row, replicated across
rows, torchtitan's names); every other dimension (``"tp"``, or any the user adds) lives *inside* a
stage: each coordinate along them runs its own copy of the pipeline grid, with the stages' layers
parallelised over it by ``parallelize``.  The role names are configurable
(``mesh_dims={"pp": "pipe", "dp": "data"}``).

The pipeline and data-parallel groups are the mesh's own; the few others the Pipeline needs
(control, ties, channels, the call check) are created by their members only (:mod:`.groups`), so a
Pipeline never makes a world-wide ``new_group`` call and builds on any slice of a larger mesh.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from itertools import product
from typing import Any

import torch.distributed as dist

from ...schedule.modelplan.layout import DATA_PARALLEL_MODES, MeshLayout
from .. import PipelineError
from .data_parallel import ParallelLayout
from .groups import local_group

__all__ = [
    "ROLES",
]

ROLES = ("pp", "dp", "dp_replicate", "dp_shard", "tp")
"""The dimensions a Pipeline knows by role: pipeline, data parallelism (one dimension, or HSDP's
replicate × shard pair), tensor parallelism."""


@dataclass(frozen=True)
class MeshDims:
    """The names of the mesh dimensions in each role (None where the mesh lacks one)."""

    pp: str
    dp: str | None
    tp: str | None
    dp_replicate: str | None = None
    dp_shard: str | None = None

    @property
    def data(self) -> tuple[str, ...]:
        """The data-parallel dimensions, outermost first: ``(dp,)``, ``(dp_replicate, dp_shard)``
        (either alone when the mesh has only one of them), or none."""
        if self.dp is not None:
            return (self.dp,)
        return tuple(name for name in (self.dp_replicate, self.dp_shard) if name is not None)


def mesh_dims(mesh: Any, names: Mapping[str, str] | None = None) -> MeshDims:
    """Which of ``mesh``'s dimensions plays each role; ``names`` maps a role to a dimension name."""
    given = dict(names or {})
    unknown = sorted(set(given) - set(ROLES))
    if unknown:
        raise PipelineError(f"mesh_dims: unknown roles {unknown}; the roles are {list(ROLES)}")
    dims = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if not dims:
        raise PipelineError(
            "mesh= needs a DeviceMesh with named dimensions: "
            'init_device_mesh(device_type, (pp, dp), mesh_dim_names=("pp", "dp"))'
        )
    chosen = {role: given.get(role, role) for role in ROLES}
    if chosen["pp"] not in dims:
        raise PipelineError(
            f"the mesh's dimensions are {list(dims)}: none is named {chosen['pp']!r} for the pipeline; "
            'name one "pp" or pass mesh_dims={"pp": <its name>}'
        )
    for role in ROLES[1:]:
        if role in given and chosen[role] not in dims:
            raise PipelineError(
                f"mesh_dims: the mesh has no dimension {chosen[role]!r} (it has {list(dims)})"
            )
    picked = [name for name in chosen.values() if name in dims]
    if len(set(picked)) != len(picked):
        raise PipelineError(f"mesh_dims: one dimension cannot play two roles ({chosen})")
    present = {role: chosen[role] if chosen[role] in dims else None for role in ROLES}
    if present["dp"] is not None and (present["dp_replicate"] or present["dp_shard"]):
        raise PipelineError(
            f"the mesh's dimensions are {list(dims)}: the data-parallel replicas run along one "
            f'"dp" dimension or along the pair "dp_replicate" × "dp_shard" (HSDP), not both'
        )
    return MeshDims(
        pp=chosen["pp"],
        dp=present["dp"],
        tp=present["tp"],
        dp_replicate=present["dp_replicate"],
        dp_shard=present["dp_shard"],
    )


def mesh_groups(mesh: Any) -> list[Any]:
    """The mesh's process groups, one per dimension (together they connect all its ranks)."""
    return [mesh.get_group(name) for name in mesh.mesh_dim_names]


def mesh_ranks(mesh: Any) -> list[int]:
    """Every global rank of ``mesh``, sorted."""
    return sorted(int(rank) for rank in mesh.mesh.flatten().tolist())


def layout_of_mesh(mesh: Any, dims: MeshDims, timeout: float) -> ParallelLayout:
    """This rank's :class:`ParallelLayout` on ``mesh``: its pipeline along ``dims.pp``, its replicas
    along the data-parallel dimensions (``dims.data``, replica index row-major over them), at its own
    coordinates on every other dimension.

    Collective over this rank's replica (its control and ties groups, :mod:`.groups`) and, with two
    data-parallel dimensions (HSDP), over its data-parallel column (their flattened group).  Pipeline
    rank ``r`` is the ``r``-th lowest global rank along the pipeline dimension — the rank order of
    the mesh's own pipeline group.
    """
    names = list(mesh.mesh_dim_names)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise PipelineError(f"rank {dist.get_rank()} is not in the mesh passed as mesh=")
    grid = mesh.mesh
    pp_axis = names.index(dims.pp)
    data_axes = [names.index(name) for name in dims.data]
    data_shape = [int(grid.shape[axis]) for axis in data_axes]
    replicas = math.prod(data_shape)

    def line(data_index: tuple[int, ...]) -> list[int]:
        ranks = []
        for r in range(int(grid.shape[pp_axis])):
            index = list(coordinate)
            index[pp_axis] = r
            for axis, i in zip(data_axes, data_index):
                index[axis] = i
            ranks.append(int(grid[tuple(index)]))
        return sorted(ranks)

    columns = list(product(*(range(n) for n in data_shape)))  # row-major: the replica order
    dp_index = columns.index(tuple(coordinate[axis] for axis in data_axes))
    span = tuple(rank for column in columns for rank in line(column))
    pipeline_size = len(span) // replicas
    me = dist.get_rank()
    replica = list(span[dp_index * pipeline_size : (dp_index + 1) * pipeline_size])
    setup = timedelta(seconds=max(timeout, 60.0))
    dp_group = _data_group(mesh, dims, span, pipeline_size, replica.index(me), setup)
    shard_dim = dims.dp_shard or dims.dp
    return ParallelLayout(
        pipeline_size,
        replicas,
        replica.index(me),
        dp_index,
        span,
        mesh.get_group(dims.pp),
        dp_group,
        control_group=local_group(replica, timeout=setup),
        setup_timeout=setup,
        ties_group=local_group(replica, timeout=setup),
        everyone=tuple(mesh_ranks(mesh)),
        labels=_labels(mesh),
        mesh=mesh,
        shard_group=mesh.get_group(shard_dim) if shard_dim is not None and replicas > 1 else None,
    )


def _data_group(
    mesh: Any, dims: MeshDims, span: tuple[int, ...], pipeline_size: int, rank: int, setup: timedelta
) -> Any:
    """The group of every replica's pipeline rank ``rank``: the mesh's data-parallel dimension's, or
    with two of them (HSDP) a group of the flattened column, created by its members (None: one replica)."""
    if len(span) == pipeline_size:
        return None
    if len(dims.data) == 1:
        return mesh.get_group(dims.data[0])
    column = [span[d * pipeline_size + rank] for d in range(len(span) // pipeline_size)]
    return local_group(column, timeout=setup)


def data_mesh(mesh: Any, dims: MeshDims) -> Any:
    """The submesh of ``mesh``'s data-parallel dimensions (None without one): 1-D, or HSDP's
    ``dp_replicate × dp_shard``, which ``fully_shard`` reads as replicate × shard."""
    if not dims.data:
        return None
    return mesh[dims.data[0]] if len(dims.data) == 1 else mesh[dims.data]


def stage_layout(
    mesh: Any, dims: MeshDims, replicas: int, sharding: str | None, parallelized: bool
) -> MeshLayout:
    """What the planner needs of the mesh (:class:`~...schedule.modelplan.MeshLayout`): the
    replicas and how they hold the parameters, and the ranks each stage's layers are parallelised
    over (the dimensions inside a stage; 1 without ``parallelize``, each then running whole layers)."""
    sizes = _dim_sizes(mesh)
    inside = [size for name, size in sizes.items() if name != dims.pp and name not in dims.data]
    tp = math.prod(inside) if parallelized else 1
    shard = sizes[dims.dp_shard] if sharding == "hsdp" and dims.dp_shard else None
    return MeshLayout(dp=replicas, tp=tp, sharding=sharding, dp_shard=shard)


def _dim_sizes(mesh: Any) -> dict[str, int]:
    """Each dimension's size, by name."""
    return dict(zip(mesh.mesh_dim_names, map(int, mesh.mesh.shape)))


def _labels(mesh: Any) -> dict[int, str]:
    """Each rank of ``mesh`` named by its coordinates: ``{5: "pp 1, dp 0, tp 1"}``."""
    names, grid = list(mesh.mesh_dim_names), mesh.mesh
    return {
        int(grid[index]): ", ".join(f"{name} {i}" for name, i in zip(names, index))
        for index in product(*(range(n) for n in grid.shape))
    }


def parallel_size(
    data_parallel: int | str | None, mesh: Any, dims: MeshDims | None, group: Any
) -> tuple[int, int, str | None]:
    """``(ranks of the pipeline grid, replicas D, sharding)`` for the Pipeline's ``data_parallel``.

    Without a mesh ``data_parallel`` is the replica count (None: 1) over ``group``'s ranks.  With one
    it is ``"replicate"`` (None: the default), ``"fsdp"`` (sharded along the one data-parallel
    dimension), ``"hsdp"`` (sharded along ``dp_shard``, replicated along ``dp_replicate``) or the
    replica count; ``sharding`` is ``"fsdp"``, ``"hsdp"`` or None (replicated).
    """
    if mesh is None or dims is None:
        if isinstance(data_parallel, str):
            raise PipelineError(
                f'data_parallel={data_parallel!r} names how a mesh\'s "dp" dimension holds the parameters: '
                'pass mesh=init_device_mesh(..., mesh_dim_names=("pp", "dp")) too, or an integer '
                "replica count"
            )
        return dist.get_world_size(group), 1 if data_parallel is None else data_parallel, None
    names, sizes = list(mesh.mesh_dim_names), _dim_sizes(mesh)
    pipeline = sizes[dims.pp]
    replicas = math.prod(sizes[name] for name in dims.data)
    if data_parallel is None or data_parallel in DATA_PARALLEL_MODES:
        sharding = None if data_parallel in (None, "replicate") else str(data_parallel)
        _check_data_dims(sharding, dims, names)
        return pipeline * replicas, replicas, sharding
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel != replicas:
        along = " × ".join(dims.data) or "no data-parallel dimension"
        raise PipelineError(
            f'data_parallel={data_parallel!r} with mesh=: pass "replicate" (the default), "fsdp" or '
            f'"hsdp"; the replica count comes from the mesh ({replicas} along {along})'
        )
    return pipeline * replicas, replicas, None


def _check_data_dims(sharding: str | None, dims: MeshDims, names: list[str]) -> None:
    """``"fsdp"`` needs one data-parallel dimension to shard over, ``"hsdp"`` the pair."""
    if sharding == "fsdp" and (len(dims.data) != 1 or dims.dp_replicate is not None):
        hint = (
            'the mesh has "dp_replicate" × "dp_shard": pass data_parallel="hsdp" to shard within '
            "a row and replicate across rows"
            if dims.dp_replicate is not None and dims.dp_shard is not None
            else "add a \"dp\" dimension (or name it with mesh_dims={'dp': ...})"
        )
        raise PipelineError(
            'data_parallel="fsdp" shards over the mesh\'s one data-parallel dimension ("dp" or '
            f'"dp_shard"), but the mesh has {names}: {hint}'
        )
    if sharding == "hsdp" and (dims.dp_replicate is None or dims.dp_shard is None):
        raise PipelineError(
            'data_parallel="hsdp" shards along "dp_shard" and replicates along "dp_replicate", but the '
            f'mesh has {names}: build it with mesh_dim_names=("pp", "dp_replicate", "dp_shard"[, "tp"]) '
            "(or name them with mesh_dims={'dp_replicate': ..., 'dp_shard': ...})"
        )
