"""What the ranks inside a pipeline stage do to a layer's costs: data parallelism and tensor parallelism.

A :class:`~..grid.Grid` (``MeshLayout``, its earlier name here) turns a profile measured for the
whole layer on one device into what one rank of a ``pp × dp × tp`` mesh computes, holds and sends
(``docs/auto-planning.md``, "Planning on a mesh"):

* **tensor parallelism** divides each layer's compute and parameters by ``tp`` and the share
  :data:`TP_ACTIVATION_SHARE` of its activations (the rest, the residual stream and the norms'
  inputs, stays whole on every rank), and adds :attr:`~..grid.Grid.tp_collectives` all-reduces of the
  layer's output to its F and to its B (Megatron's two per block);
* **replicated data parallelism** keeps every byte and all-reduces the gradients once per step;
* **FSDP2** (``"fsdp"``; ``"hsdp"`` with ``dp_shard`` of the ``dp`` replicas per row) as the
  runtime drives it: every chunk of a rank is all-gathered once before its first forward and stays
  whole for the step, so a rank holds in the step its whole parameters (over ``tp``) *and* their
  shards, its whole gradients until the reduce-scatter after the chunk's last gradient op, and its
  optimizer state sharded; between steps it holds ``1/(shard·tp)`` of everything.

The step's data-parallel collectives are counted as exposed in full (the runtime's all-gather and
reduce-scatter block, and the replicated all-reduce starts after the rank's last gradient op).

The arithmetic is the grid's methods (``per_rank`` .. ``memory_text``); this module reads the
``--mesh`` text into one.  Pure Python; no torch.
"""

from __future__ import annotations

from ..grid import DATA_PARALLEL_MODES, SHARDINGS, TP_ACTIVATION_SHARE, Grid, Link
from ..ir import ScheduleError

__all__ = [
    "DATA_PARALLEL_MODES",
    "SHARDINGS",
    "TP_ACTIVATION_SHARE",
    "Grid",
    "Link",
    "MeshLayout",
    "mesh_layout",
    "parse_mesh",
]

MeshLayout = Grid
"""The planner's earlier name for :class:`~..grid.Grid` (the same type): ``MeshLayout(dp=4, tp=2,
sharding="fsdp")`` places each stage on ``dp × tp`` ranks."""

_NO_COST = Link()
"""A link whose collectives take no time: :func:`mesh_layout`'s default."""


def parse_mesh(text: str) -> dict[str, int]:
    """``"pp=2,dp=2,tp=2"`` (also ``dp_replicate=``, ``dp_shard=``) as a dict; unnamed sizes are 1."""
    sizes = {"pp": 1, "dp": 1, "tp": 1, "dp_replicate": 1, "dp_shard": 1}
    for part in filter(None, (piece.strip() for piece in text.split(","))):
        name, _, value = part.partition("=")
        if name not in sizes or not value.strip().isdigit() or int(value) < 1:
            raise ScheduleError(
                f"mesh {text!r}: each part is NAME=SIZE with NAME one of {', '.join(sizes)} and SIZE ≥ 1 "
                "(e.g. pp=2,dp=2,tp=2)"
            )
        sizes[name] = int(value)
    if sizes["dp"] > 1 and sizes["dp_replicate"] * sizes["dp_shard"] > 1:
        raise ScheduleError(f"mesh {text!r}: give dp=, or dp_replicate= and dp_shard= (HSDP), not both")
    return sizes


def mesh_layout(sizes: dict[str, int], data_parallel: str = "replicate", link: Link = _NO_COST) -> Grid:
    """The :class:`~..grid.Grid` of :func:`parse_mesh`'s sizes (``pp`` included) with ``data_parallel``
    ``"replicate"``, ``"fsdp"`` or ``"hsdp"`` (over ``dp_shard``), every collective on ``link``."""
    if data_parallel not in DATA_PARALLEL_MODES:
        raise ScheduleError(f"data parallelism {data_parallel!r}: choose replicate, fsdp or hsdp")
    hsdp = sizes["dp_replicate"] * sizes["dp_shard"] > 1
    if (data_parallel == "hsdp") != hsdp and not (data_parallel == "replicate" and hsdp):
        raise ScheduleError(
            "hsdp runs on dp_replicate= and dp_shard= (e.g. pp=2,dp_replicate=2,dp_shard=2); fsdp on dp="
        )
    dp = sizes["dp"] * sizes["dp_replicate"] * sizes["dp_shard"]
    sharding = None if data_parallel == "replicate" or dp == 1 else data_parallel
    shard = sizes["dp_shard"] if sharding == "hsdp" else None
    return Grid(
        dp=dp, tp=sizes["tp"], sharding=sharding, dp_shard=shard, tp_link=link, dp_link=link, pp=sizes["pp"]
    )
