"""Data parallelism across pipeline replicas: the process-group layout and the gradient averager.

``p`` pipeline ranks with ``data_parallel = D`` span ``p·D`` ranks (group rank
``dp_index · p + pipeline_rank``); the data-parallel group of pipeline rank ``r`` holds the same
chunks in every replica.  As soon as a chunk's last gradient op has run, its gradients are
all-reduced asynchronously over that group, one bucket at a time (the lowered program's ``issue
all_reduce(bucket s.k)``; the buckets the lowering cut by ``FSDPOptions.bucket_bytes``, one per chunk
by default), overlapping the rest of the step; each ``wait`` divides by ``D``.  The expert-parallel
ranks are replicas too (``D = dp · ep``): their experts' gradients are not reduced over ``ep``, only
divided (:mod:`.experts`).  :func:`build_layout`
creates the layout's groups from the grid, on a mesh or not, with local synchronisation (:mod:`.groups`).

Why the groups are created that way: ``docs/runtime.md``.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...schedule.grid import Grid
from ...schedule.grid import pipeline_size_of as pipeline_size_of  # where resolve reads it
from ...schedule.ir import Kind, Op
from ...schedule.lowering import CommKind, Issue, Wait
from .. import PipelineError
from ..tensors import local_value
from .groups import local_group

_GRADIENT_KINDS = (Kind.B, Kind.W, Kind.BW)


@dataclass(frozen=True)
class ParallelLayout:
    """The process groups of this rank's place in a ``D × p`` grid of data-parallel pipeline replicas.

    ``grid`` (:class:`~...schedule.grid.Grid`) holds the sizes and this rank's place (``pipeline_rank``,
    ``dp_index``, ``span``, ...).  ``pipeline_group`` is this replica's group, ``dp_group`` the group
    of the ranks holding the same chunks (None when ``D = 1``), ``control_group`` a group of this
    replica's ranks reserved for the optimizer's small messages and ``ties_group`` one for the sums
    of tied parameters (neither is used by the pipeline's transfers).  ``mesh`` is the user's mesh,
    if any.  ``shard_group`` is the part of ``dp_group`` a sharded parameter is cut over: all of it,
    but under HSDP only this rank's ``dp_shard`` row (the rows hold equal copies).  With an ``"ep"``
    dimension, ``ep_group`` is its group (the experts' all-to-all) and ``expert_group`` the group of
    the ranks holding the same experts (the mesh's ``"dp"``; None without one).
    """

    grid: Grid
    pipeline_group: Any
    dp_group: Any
    control_group: Any
    setup_timeout: timedelta
    ties_group: Any = None
    mesh: Any = None
    shard_group: Any = None
    ep_group: Any = None
    expert_group: Any = None

    @property
    def pipeline_rank(self) -> int:
        """This rank's place in its pipeline replica (the grid's)."""
        return self.grid.pipeline_rank

    @property
    def dp_index(self) -> int:
        """This rank's replica (the grid's)."""
        return self.grid.dp_index

    @property
    def span(self) -> tuple[int, ...]:
        """The grid's global ranks in group-rank order, ``dp_index · p + pipeline_rank`` (the grid's)."""
        return self.grid.span


def build_layout(grid: Grid, *, group: Any, mesh: Any, timeout: float) -> ParallelLayout:
    """The process groups of ``grid``, placed at this rank (:meth:`~...schedule.grid.Grid.on_group`
    or :meth:`~...schedule.grid.Grid.on_mesh`): on ``mesh`` its pipeline and data-parallel
    dimensions' own groups, else ``group`` (the world when None) split into the replicas.

    Collective over the groups it creates, each created by its members only (:mod:`.groups`), every
    rank creating the same sequence: its replica's group (no mesh, ``D > 1``), its data-parallel
    column's (no mesh, or HSDP's two dimensions flattened; ``D > 1``), then its replica's control and
    ties groups.
    """
    setup = timedelta(seconds=max(timeout, 60.0))
    replica = grid.replica_ranks(grid.dp_index)
    if mesh is not None:
        pipeline_group = mesh.get_group(grid.dim("pp"))
    else:
        pipeline_group = local_group(replica, timeout=setup) if grid.replicas > 1 else group
    dp_group = _data_group(grid, mesh, setup)
    if mesh is not None and grid.ep == 1:
        shard_dim = grid.dim("dp_shard") or grid.dim("dp")
        shard_group = mesh.get_group(shard_dim) if shard_dim is not None and grid.dp > 1 else None
    else:  # no mesh, or expert parallelism: FSDP2 shards over every replica (parallel/experts.py)
        shard_group = dp_group
    return ParallelLayout(
        grid,
        pipeline_group,
        dp_group,
        control_group=local_group(replica, timeout=setup),
        setup_timeout=setup,
        ties_group=local_group(replica, timeout=setup),
        mesh=mesh,
        shard_group=shard_group,
        ep_group=mesh.get_group(grid.dim("ep")) if grid.ep > 1 else None,
        expert_group=mesh.get_group(grid.data_dims[0]) if grid.ep > 1 and grid.dp > 1 else None,
    )


def _data_group(grid: Grid, mesh: Any, setup: timedelta) -> Any:
    """The group of every replica's pipeline rank of this rank (None: one replica): a mesh's one
    replica dimension's (data- or expert-parallel), else a group of that column created by its members."""
    if grid.replicas == 1:
        return None
    if mesh is not None and len(grid.replica_dims) == 1:
        return mesh.get_group(grid.replica_dims[0])
    column = [grid.global_rank(grid.pipeline_rank, d) for d in range(grid.replicas)]
    return local_group(column, timeout=setup)


# -- gradient averaging --------------------------------------------------------------------------------


def last_gradient_ops(program: Sequence[Op]) -> dict[int, int]:
    """For each stage of ``program``, the position of its last op computing weight gradients (B/W/BW).

    After that op the stage's gradients for the step are final: every W(s,j) follows B(s,j), so the
    last W (or BW) of a stage comes after all of its B ops.
    """
    last: dict[int, int] = {}
    for position, op in enumerate(program):
        if op.kind in _GRADIENT_KINDS:
            last[op.stage] = position
    return last


class GradientAverager:
    """Averages each chunk's gradients over the data-parallel group, bucket by bucket, asynchronously.

    ``buckets`` maps a stage index to its buckets' parameters, in the lowered program's bucket order
    (:func:`bucket_parameters`; one bucket per chunk without a bucket size).  :meth:`start` flattens
    a bucket's existing gradients (one buffer per dtype) and posts a non-blocking sum; :meth:`wait`
    waits for it, divides by the group size and writes the averages back into ``.grad``.  As a
    :class:`~..execute.program.Communication` it binds a lowered program's all-reduce actions.
    Parameters whose ``.grad`` is None are left alone (they are None on every replica alike).
    ``experts`` (expert parallelism, :mod:`.experts`) are reduced over ``expert_group`` instead (the
    replicas holding the same experts; None: over none) and divided by ``size`` all the same.
    """

    def __init__(
        self,
        buckets: Mapping[int, Sequence[Sequence[nn.Parameter]]],
        group: Any,
        size: int,
        wait: Callable[[Any, str], None] | None = None,
        *,
        experts: Sequence[nn.Parameter] = (),
        expert_group: Any = None,
    ):
        self.buckets = {stage: [list(params) for params in parts] for stage, parts in buckets.items()}
        self.group = group
        self.size = size
        self._experts, self._expert_group = frozenset(id(p) for p in experts), expert_group
        self._wait = wait or (lambda work, what: work.wait())
        self._inflight: dict[tuple[int, int], list[tuple[Any, torch.Tensor, list[torch.Tensor]]]] = {}

    def comm_handler(self, action: Issue | Wait) -> Callable[[], None] | None:
        """A lowered program's bucket all-reduce: its issue starts it (:meth:`start`), its wait waits
        for it (:meth:`wait`); nothing else is the averager's."""
        comm = action.comm
        if comm.kind is not CommKind.ALL_REDUCE:
            return None
        held = len(self.buckets.get(comm.stage, ()))
        if not 0 <= comm.index < held:
            raise PipelineError(
                f"the lowered program all-reduces {comm}, but this rank cut stage {comm.stage}'s "
                f"gradients into {held} bucket(s): the program is not the one the averager was made "
                "from (a bug: report it)"
            )
        work = self.start if isinstance(action, Issue) else self.wait
        return functools.partial(work, comm.stage, comm.index)

    def compute_handler(self, op: Op, handler: Callable[[Any, int], None]) -> Callable[[Any, int], None]:
        """Ops run as they are."""
        return handler

    @torch.no_grad()
    def start(self, stage: int, bucket: int = 0) -> None:
        """Post the all-reduce of a bucket of ``stage``'s gradients (call once its last gradient op has
        run; every replica posts the same buckets in the same order)."""
        by_group: dict[tuple[bool, torch.dtype], list[torch.Tensor]] = {}
        for param in self.buckets[stage][bucket]:
            if param.grad is not None:  # a DTensor (tensor parallelism): its shard, the same on every replica
                grad = local_value(param.grad)
                by_group.setdefault((id(param) in self._experts, grad.dtype), []).append(grad)
        for (expert, _), grads in by_group.items():
            flat = torch.cat([grad.reshape(-1) for grad in grads])
            group = self._expert_group if expert else self.group
            work = None if group is None else dist.all_reduce(flat, group=group, async_op=True)
            self._inflight.setdefault((stage, bucket), []).append((work, flat, grads))

    @torch.no_grad()
    def wait(self, stage: int, bucket: int = 0) -> None:
        """Wait for a posted bucket of ``stage`` and store its averaged gradients in place."""
        for work, flat, grads in self._inflight.pop((stage, bucket), ()):
            if work is not None:  # None: an expert-parallel rank's own experts, nothing to reduce
                self._wait(work, "the data-parallel gradient average")
            flat.div_(self.size)
            for grad, piece in zip(grads, flat.split([g.numel() for g in grads])):
                grad.copy_(piece.view_as(grad))

    def finish(self) -> None:
        """Wait for every reduction still posted (the program's waits took the others)."""
        for stage, bucket in list(self._inflight):
            self.wait(stage, bucket)

    def discard(self) -> None:
        """Forget the posted reductions after a failed step."""
        self._inflight.clear()


# -- where the Pipeline hooks into a program ------------------------------------------------------


def first_forward(program: Sequence[Op]) -> int:
    """Position of the first F of ``program`` (where the parameters are first read in a step)."""
    for position, op in enumerate(program):
        if op.kind is Kind.F:
            return position
    raise PipelineError("a rank's program has no forward op")


def bucket_parameters(
    stages: Mapping[int, Any], last_ops: Mapping[int, int], parts: Sequence[Sequence[int]] | None = None
) -> dict[int, list[list[nn.Parameter]]]:
    """Each stage's parameters cut into its all-reduce buckets: bucket ``k`` holds those of the
    layers of the lowered program's part ``k`` (``parts[stage]``: the layer counts, in layer order,
    :attr:`~...schedule.lowering.LoweredSchedule.part_layers`; None: one bucket per stage).

    A parameter shared by two stages goes to the one reduced last (its gradient is final only
    after that stage's last gradient op), and within it to the bucket of the first layer holding it.
    """
    seen: set[int] = set()

    def unseen(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
        fresh = []
        for module in modules:
            for param in module.parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    fresh.append(param)
        return fresh

    buckets: dict[int, list[list[nn.Parameter]]] = {}
    for stage in sorted(last_ops, key=last_ops.__getitem__, reverse=True):
        module = stages[stage].module
        layers = list(getattr(module, "layers", module.children())) or [module]
        counts = [len(layers)] if parts is None or len(layers) == 1 else list(parts[stage])
        if sum(counts) != len(layers):
            raise PipelineError(
                f"stage {stage} holds {len(layers)} layers but its lowered buckets cut {sum(counts)}: "
                "the lowering was made from other layers (a bug: report it)"
            )
        ends = list(itertools.accumulate(counts))
        buckets[stage] = [unseen(layers[start:stop]) for start, stop in zip([0, *ends[:-1]], ends)]
    return buckets


def mean_loss(
    losses: Sequence[torch.Tensor], layout: ParallelLayout, wait: Callable[..., Any]
) -> torch.Tensor:
    """A step's mean loss from its microbatch ``losses``, over the global batch when there are several
    replicas (an all-reduce over the data-parallel group, waited on with ``wait``)."""
    stacked = torch.stack(list(losses))  # float64 stays float64; lower precisions average in float32
    mean = stacked.to(torch.promote_types(stacked.dtype, torch.float32)).mean()
    if layout.grid.replicas > 1:
        work = dist.all_reduce(mean, group=layout.dp_group, async_op=True)
        wait(work, "the data-parallel loss average")
        mean /= layout.grid.replicas
    return mean
