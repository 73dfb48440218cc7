"""The memory of a lowered program: activations as the source schedule holds them, plus parameters
and gradients.

A unit's parameters take its full bytes from the issue of its unshard (the gather's buffer) to its
reshard, and ``1/shard`` of them otherwise; its gradients ``1/shard`` (the reduced shard) plus the
rest of its full bytes from its first gradient part (the unsharded buffer microbatches accumulate
into) to the issue of its reduce-scatter.  Replicated parameters and gradients (or none sharded) take
their full bytes throughout.  Optimizer state is not the lowering's: the planner adds it.
Activations change as :meth:`~..costs.StageCosts.memory_delta` says, at the end of each op's last
part.  Levels are taken in program order, which is the compute stream's time order.
Activations are in the cost model's memory unit and parameters in the bytes of
:class:`~.layout.StageBytes`: give ``mem_b`` in bytes to read ``total`` as bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..costs import StageCosts
from .actions import CommKind, Compute, Issue, LoweredSchedule


@dataclass(frozen=True)
class ParameterMemory:
    """Per rank: the peak of the activations, of the parameters and gradients, and of their sum."""

    activations: tuple[float, ...]
    parameters: tuple[float, ...]
    total: tuple[float, ...]


def memory_levels(lowered: LoweredSchedule, costs: StageCosts) -> ParameterMemory:
    """The peaks of every rank's activation, parameter-and-gradient memory and their sum along its
    program."""
    placement = lowered.source.placement
    activations, parameters, totals = [], [], []
    for rank in range(lowered.source.num_ranks):
        shard = lowered.shard if lowered.data_parallel == "fsdp" else 1
        stages = placement.stages_of(rank)
        held = sum(sum(lowered.part_bytes[s]) + sum(lowered.part_grad_bytes[s]) for s in stages) / shard
        active = 0.0
        peaks = [0.0, held, held]
        buffered: set[tuple[int, int]] = set()
        for action in lowered.programs[rank]:
            held += _gathered_change(lowered, action, buffered, shard)
            if isinstance(action, Compute) and action.last:
                active += costs.memory_delta(action.op)
            peaks = [max(peaks[0], active), max(peaks[1], held), max(peaks[2], active + held)]
        activations.append(peaks[0])
        parameters.append(peaks[1])
        totals.append(peaks[2])
    return ParameterMemory(tuple(activations), tuple(parameters), tuple(totals))


def _gathered_change(
    lowered: LoweredSchedule, action: object, buffered: set[tuple[int, int]], shard: int
) -> float:
    """The bytes ``action`` adds beyond the shards (negative: frees): a gathered unit's parameters
    from its unshard to its reshard, its gradient buffer from its first gradient part (recorded in
    ``buffered``) to its reduce-scatter.  Nothing without sharding."""
    if shard == 1:
        return 0.0
    if isinstance(action, Compute):
        unit = (action.op.stage, action.part)
        if action.op.is_vocab or not action.op.computes_weight_grad or unit in buffered:
            return 0.0
        buffered.add(unit)
        full = lowered.part_grad_bytes[unit[0]][unit[1]]
        return full - full / shard
    if not isinstance(action, Issue):
        return 0.0
    comm = action.comm
    if comm.kind is CommKind.REDUCE_SCATTER:
        full = lowered.part_grad_bytes[comm.stage][comm.index]
        return -(full - full / shard)
    if comm.kind in (CommKind.UNSHARD, CommKind.RESHARD):
        full = lowered.part_bytes[comm.stage][comm.index]
        return (full - full / shard) * (1 if comm.kind is CommKind.UNSHARD else -1)
    return 0.0
