"""The memory of a lowered program: activations as the source schedule holds them, plus parameters.

A unit's parameters take its full bytes from the issue of its unshard (the gather's buffer) to its
reshard, and ``1/shard`` of them otherwise; replicated parameters (or none sharded) take their full
bytes throughout.  Activations change as :meth:`~..costs.StageCosts.memory_delta` says, at the end
of each op's last part.  Levels are taken in program order, which is the compute stream's time order.
Activations are in the cost model's memory unit and parameters in the bytes of
:class:`~.layout.StageBytes`: give ``mem_b`` in bytes to read ``total`` as bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..costs import StageCosts
from .actions import CommKind, Compute, Issue, LoweredSchedule


@dataclass(frozen=True)
class ParameterMemory:
    """Per rank: the peak of the activations, of the parameters, and of their sum."""

    activations: tuple[float, ...]
    parameters: tuple[float, ...]
    total: tuple[float, ...]


def memory_levels(lowered: LoweredSchedule, costs: StageCosts) -> ParameterMemory:
    """The peaks of every rank's activation and parameter memory along its program."""
    fsdp = lowered.data_parallel == "fsdp"
    shard = lowered.shard if fsdp else 1
    placement = lowered.source.placement
    activations, parameters, totals = [], [], []
    for rank in range(lowered.source.num_ranks):
        held = sum(sum(lowered.part_bytes[stage]) for stage in placement.stages_of(rank)) / shard
        active = 0.0
        peaks = [0.0, held, held]
        for action in lowered.programs[rank]:
            if isinstance(action, Compute) and action.last:
                active += costs.memory_delta(action.op)
            elif (
                fsdp
                and isinstance(action, Issue)
                and action.comm.kind in (CommKind.UNSHARD, CommKind.RESHARD)
            ):
                full = lowered.part_bytes[action.comm.stage][action.comm.index]
                change = full - full / shard
                held += change if action.comm.kind is CommKind.UNSHARD else -change
            else:
                continue
            peaks = [max(peaks[0], active), max(peaks[1], held), max(peaks[2], active + held)]
        activations.append(peaks[0])
        parameters.append(peaks[1])
        totals.append(peaks[2])
    return ParameterMemory(tuple(activations), tuple(parameters), tuple(totals))
