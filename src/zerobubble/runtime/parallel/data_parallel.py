"""Data parallelism across pipeline replicas: the process-group layout and the gradient averager.

``p`` pipeline ranks with ``data_parallel = D`` span ``p·D`` ranks (group rank
``dp_index · p + pipeline_rank``); the data-parallel group of pipeline rank ``r`` holds the same
chunks in every replica.  As soon as a chunk's last gradient op has run, its gradients are
all-reduced asynchronously over that group (a hook of the executor), overlapping the rest of the
step; the step waits at its end and divides by ``D``.  :func:`create_layout` and :mod:`.mesh` create
the layout's groups with local synchronisation (:mod:`.groups`).

Why the groups are created that way: ``docs/runtime.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...schedule.ir import Kind, Op
from .. import PipelineError
from ..tensors import local_value
from .groups import local_group

_GRADIENT_KINDS = (Kind.B, Kind.W, Kind.BW)


@dataclass(frozen=True)
class ParallelLayout:
    """Where this rank sits in a ``D × p`` grid of data-parallel pipeline replicas.

    ``span`` lists the global ranks of the grid in group-rank order (``dp_index · p + pipeline
    rank``).  ``pipeline_group`` is this replica's group, ``dp_group`` the group of the ranks holding
    the same chunks (None when ``D = 1``), ``control_group`` a group of this replica's ranks reserved
    for the optimizer's small messages and ``ties_group`` one for the sums of tied parameters (neither
    is used by the pipeline's transfers).  ``everyone`` lists every rank taking part in the Pipeline,
    sorted — the grid's ranks, and on a mesh those of its other dimensions (tensor parallelism) too;
    ``labels`` names a global rank by its mesh coordinates.  ``mesh`` is the user's mesh, if any.
    ``shard_group`` is the part of ``dp_group`` a sharded parameter is cut over: all of it, but
    under HSDP only this rank's ``dp_shard`` row (the rows hold equal copies).
    """

    pipeline_size: int
    data_parallel: int
    pipeline_rank: int
    dp_index: int
    span: tuple[int, ...]
    pipeline_group: Any
    dp_group: Any
    control_group: Any
    setup_timeout: timedelta
    ties_group: Any = None
    everyone: tuple[int, ...] = ()
    labels: Mapping[int, str] = field(default_factory=dict)
    mesh: Any = None
    shard_group: Any = None

    def global_rank(self, pipeline_rank: int, dp_index: int | None = None) -> int:
        """The global rank of ``pipeline_rank`` in replica ``dp_index`` (this rank's replica by default)."""
        replica = self.dp_index if dp_index is None else dp_index
        return self.span[replica * self.pipeline_size + pipeline_rank]

    def rank_name(self, group_rank: int) -> str:
        """How messages name the rank at position ``group_rank`` of :attr:`everyone` (the call check's
        group): its global rank, with its mesh coordinates or its replica where there are several."""
        rank = self.everyone[group_rank] if self.everyone else group_rank
        if rank in self.labels:
            return f"rank {rank} ({self.labels[rank]})"
        if self.data_parallel == 1:
            return f"rank {rank}"
        replica, pipeline_rank = divmod(self.span.index(rank), self.pipeline_size)
        return f"rank {rank} (pipeline rank {pipeline_rank} of replica {replica})"

    def replica_ranks(self, dp_index: int) -> list[int]:
        """Global ranks of replica ``dp_index`` in pipeline-rank order."""
        return [self.global_rank(r, dp_index) for r in range(self.pipeline_size)]


def create_layout(group: Any, data_parallel: int, timeout: float) -> ParallelLayout:
    """Split ``group`` (the world when None) into ``data_parallel`` pipeline replicas.

    Collective over ``group`` only: every group is created by its members (:mod:`.groups`), each rank
    creating the same sequence — its replica's group and its data-parallel column's (when ``D > 1``),
    then its replica's control and ties groups.
    """
    size = dist.get_world_size(group)
    pipeline_size_of(size, data_parallel)
    span = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(size))
    pipeline_size = size // data_parallel
    dp_index, pipeline_rank = divmod(dist.get_rank(group), pipeline_size)
    setup = timedelta(seconds=max(timeout, 60.0))
    replica = [span[dp_index * pipeline_size + r] for r in range(pipeline_size)]
    pipeline_group, dp_group = group, None
    if data_parallel > 1:
        pipeline_group = local_group(replica, timeout=setup)
        column = [span[d * pipeline_size + pipeline_rank] for d in range(data_parallel)]
        dp_group = local_group(column, timeout=setup)
    return ParallelLayout(
        pipeline_size,
        data_parallel,
        pipeline_rank,
        dp_index,
        span,
        pipeline_group,
        dp_group,
        control_group=local_group(replica, timeout=setup),
        setup_timeout=setup,
        ties_group=local_group(replica, timeout=setup),
        everyone=tuple(sorted(span)),
        shard_group=dp_group,
    )


def pipeline_size_of(size: int, data_parallel: Any) -> int:
    """Ranks per pipeline replica when ``size`` ranks run ``data_parallel`` replicas (checked)."""
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise PipelineError(f"data_parallel must be a positive integer, got {data_parallel!r}")
    if size % data_parallel:
        raise PipelineError(
            f"data_parallel={data_parallel} does not divide the {size} ranks of the process group; "
            f"start a multiple of {data_parallel} ranks (pipeline size × data_parallel)"
        )
    return size // data_parallel


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
    """Averages each chunk's gradients over the data-parallel group, chunk by chunk, asynchronously.

    ``chunks`` maps a stage index to its parameters.  :meth:`start` flattens the stage's existing
    gradients (one buffer per dtype) and posts a non-blocking sum; :meth:`finish` waits for every
    posted sum, divides by the group size and writes the averages back into ``.grad``.
    Parameters whose ``.grad`` is None are left alone (they are None on every replica alike).
    """

    def __init__(
        self,
        chunks: Mapping[int, Sequence[nn.Parameter]],
        group: Any,
        size: int,
        wait: Callable[[Any, str], None] | None = None,
    ):
        self.chunks = {stage: list(params) for stage, params in chunks.items()}
        self.group = group
        self.size = size
        self._wait = wait or (lambda work, what: work.wait())
        self._inflight: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []

    @torch.no_grad()
    def start(self, stage: int) -> None:
        """Post the all-reduce of ``stage``'s gradients (call once its last gradient op has run)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for param in self.chunks[stage]:
            if param.grad is not None:  # a DTensor (tensor parallelism): its shard, the same on every replica
                grad = local_value(param.grad)
                by_dtype.setdefault(grad.dtype, []).append(grad)
        for grads in by_dtype.values():
            flat = torch.cat([grad.reshape(-1) for grad in grads])
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            self._inflight.append((work, flat, grads))

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for the posted reductions and store the averaged gradients in place."""
        inflight, self._inflight = self._inflight, []
        for work, flat, grads in inflight:
            self._wait(work, "the data-parallel gradient average")
            flat.div_(self.size)
            for grad, piece in zip(grads, flat.split([g.numel() for g in grads])):
                grad.copy_(piece.view_as(grad))

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


def chunk_parameters(stages: Mapping[int, Any], last_ops: Mapping[int, int]) -> dict[int, list[nn.Parameter]]:
    """Each stage's parameters, a parameter shared by two stages going to the one reduced last."""
    seen: set[int] = set()
    chunks: dict[int, list[nn.Parameter]] = {}
    for stage in sorted(last_ops, key=last_ops.__getitem__, reverse=True):
        chunks[stage] = []
        for param in stages[stage].module.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                chunks[stage].append(param)
    return chunks


def mean_loss(
    losses: Sequence[torch.Tensor], layout: ParallelLayout, wait: Callable[..., Any]
) -> torch.Tensor:
    """A step's mean loss from its microbatch ``losses``, over the global batch when there are several
    replicas (an all-reduce over the data-parallel group, waited on with ``wait``)."""
    stacked = torch.stack(list(losses))  # float64 stays float64; lower precisions average in float32
    mean = stacked.to(torch.promote_types(stacked.dtype, torch.float32)).mean()
    if layout.data_parallel > 1:
        work = dist.all_reduce(mean, group=layout.dp_group, async_op=True)
        wait(work, "the data-parallel loss average")
        mean /= layout.data_parallel
    return mean
