"""A Pipeline on a ``DeviceMesh``: which dimension does what, and this rank's layout on it.

The mesh's ``"pp"`` dimension carries the pipeline (its stages, in rank order along it), the
optional ``"dp"`` dimension the data-parallel replicas (replicated or FSDP2-sharded), and every other
dimension (``"tp"``, or any the user adds) lives *inside* a stage: each coordinate along them runs its
own copy of the pipeline grid, with the stages' layers parallelised over it by ``parallelize``.  The
role names are configurable (``mesh_dims={"pp": "pipe", "dp": "data"}``).

The pipeline and data-parallel groups are the mesh's own; the few others the Pipeline needs
(control, ties, channels, the call check) are created by their members only (:mod:`.groups`), so a
Pipeline never makes a world-wide ``new_group`` call and builds on any slice of a larger mesh.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from itertools import product
from typing import Any

import torch.distributed as dist

from . import PipelineError
from .data_parallel import ParallelLayout
from .groups import local_group

ROLES = ("pp", "dp", "tp")
"""The dimensions a Pipeline knows by role: pipeline, data parallelism, tensor parallelism."""


@dataclass(frozen=True)
class MeshDims:
    """The names of the mesh dimensions in each role (``dp`` and ``tp`` None when the mesh lacks them)."""

    pp: str
    dp: str | None
    tp: str | None


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
    for role in ("dp", "tp"):
        if role in given and chosen[role] not in dims:
            raise PipelineError(
                f"mesh_dims: the mesh has no dimension {chosen[role]!r} (it has {list(dims)})"
            )
    picked = [name for name in chosen.values() if name in dims]
    if len(set(picked)) != len(picked):
        raise PipelineError(f"mesh_dims: one dimension cannot play two roles ({chosen})")
    return MeshDims(
        pp=chosen["pp"],
        dp=chosen["dp"] if chosen["dp"] in dims else None,
        tp=chosen["tp"] if chosen["tp"] in dims else None,
    )


def mesh_groups(mesh: Any) -> list[Any]:
    """The mesh's process groups, one per dimension (together they connect all its ranks)."""
    return [mesh.get_group(name) for name in mesh.mesh_dim_names]


def mesh_ranks(mesh: Any) -> list[int]:
    """Every global rank of ``mesh``, sorted."""
    return sorted(int(rank) for rank in mesh.mesh.flatten().tolist())


def layout_of_mesh(mesh: Any, dims: MeshDims, timeout: float) -> ParallelLayout:
    """This rank's :class:`ParallelLayout` on ``mesh``: its pipeline along ``dims.pp``, its replicas
    along ``dims.dp``, at its own coordinates on every other dimension.

    Collective over this rank's replica (its control and ties groups, :mod:`.groups`).  Pipeline rank
    ``r`` is the ``r``-th lowest global rank along the pipeline dimension — the rank order of the
    mesh's own pipeline group.
    """
    names = list(mesh.mesh_dim_names)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise PipelineError(f"rank {dist.get_rank()} is not in the mesh passed as mesh=")
    grid = mesh.mesh
    pp_axis = names.index(dims.pp)
    dp_axis = names.index(dims.dp) if dims.dp is not None else None
    replicas = int(grid.shape[dp_axis]) if dp_axis is not None else 1

    def line(dp_index: int) -> list[int]:
        ranks = []
        for r in range(int(grid.shape[pp_axis])):
            index = list(coordinate)
            index[pp_axis] = r
            if dp_axis is not None:
                index[dp_axis] = dp_index
            ranks.append(int(grid[tuple(index)]))
        return sorted(ranks)

    dp_index = coordinate[dp_axis] if dp_axis is not None else 0
    span = tuple(rank for d in range(replicas) for rank in line(d))
    pipeline_size = len(span) // replicas
    me = dist.get_rank()
    replica = list(span[dp_index * pipeline_size : (dp_index + 1) * pipeline_size])
    setup = timedelta(seconds=max(timeout, 60.0))
    return ParallelLayout(
        pipeline_size,
        replicas,
        replica.index(me),
        dp_index,
        span,
        mesh.get_group(dims.pp),
        mesh.get_group(dims.dp) if dims.dp is not None and replicas > 1 else None,
        control_group=local_group(replica, timeout=setup),
        setup_timeout=setup,
        ties_group=local_group(replica, timeout=setup),
        everyone=tuple(mesh_ranks(mesh)),
        labels=_labels(mesh),
        mesh=mesh,
    )


def _labels(mesh: Any) -> dict[int, str]:
    """Each rank of ``mesh`` named by its coordinates: ``{5: "pp 1, dp 0, tp 1"}``."""
    names, grid = list(mesh.mesh_dim_names), mesh.mesh
    return {
        int(grid[index]): ", ".join(f"{name} {i}" for name, i in zip(names, index))
        for index in product(*(range(n) for n in grid.shape))
    }


DATA_PARALLEL_MODES = ("replicate", "fsdp")
"""How the replicas along a mesh's data-parallel dimension hold the parameters."""


def parallel_size(
    data_parallel: int | str | None, mesh: Any, dims: MeshDims | None, group: Any
) -> tuple[int, int, str | None]:
    """``(ranks of the pipeline grid, replicas D, sharding)`` for the Pipeline's ``data_parallel``.

    Without a mesh ``data_parallel`` is the replica count (None: 1) over ``group``'s ranks.  With one
    it is ``"replicate"`` (None: the default) or ``"fsdp"`` along the mesh's data-parallel dimension,
    or that dimension's size; ``sharding`` is ``"fsdp"`` or None (replicated).
    """
    if mesh is None or dims is None:
        if isinstance(data_parallel, str):
            raise PipelineError(
                f'data_parallel={data_parallel!r} names how a mesh\'s "dp" dimension holds the parameters: '
                'pass mesh=init_device_mesh(..., mesh_dim_names=("pp", "dp")) too, or an integer '
                "replica count"
            )
        return dist.get_world_size(group), 1 if data_parallel is None else data_parallel, None
    names = list(mesh.mesh_dim_names)
    pipeline = int(mesh.mesh.shape[names.index(dims.pp)])
    replicas = int(mesh.mesh.shape[names.index(dims.dp)]) if dims.dp is not None else 1
    if data_parallel is None or data_parallel in DATA_PARALLEL_MODES:
        sharding = "fsdp" if data_parallel == "fsdp" else None
        if sharding is not None and dims.dp is None:
            raise PipelineError(
                f'data_parallel="fsdp" shards over the mesh\'s data-parallel dimension, but the mesh has '
                f"only {names}: add a \"dp\" dimension (or name it with mesh_dims={{'dp': ...}})"
            )
        return pipeline * replicas, replicas, sharding
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel != replicas:
        raise PipelineError(
            f'data_parallel={data_parallel!r} with mesh=: pass "replicate" (the default) or "fsdp"; the '
            f"replica count comes from the mesh ({replicas} along {dims.dp or 'no data-parallel dimension'})"
        )
    return pipeline * replicas, replicas, None
