"""The planner's closed form of FSDP unit memory against the lowering's simulated parameter peak.

Both read one :class:`~zerobubble.schedule.sharding.FSDPOptions` record.  The closed form
(:meth:`Grid.held_bytes`) counts a gathered unit's full bytes beside its shard (FSDP2's all-gather
buffer); the lowering's memory (``lowering/memory.py``) counts the full bytes instead of the shard,
so its whole-unit term is the closed form's times ``1 − 1/shard``.  On schedules of one stage per
rank (generated: gpipe, 1f1b, zb-h1; any sizes, units, prefetch) the two agree exactly when units
stay whole from the forward to the backward, and with resharding after the forward the simulated
peak lies between the closed form's ``prefetch + 1`` units and ``2·(prefetch + 1)`` (a unit read
again within the prefetch's reach is not resharded: ``docs/auto-planning.md`` § 8).
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from zerobubble.schedule import build_schedule
from zerobubble.schedule.grid import Grid
from zerobubble.schedule.lowering import StageBytes, lower, simulate_lowered
from zerobubble.schedule.modelplan import LayerProfile
from zerobubble.schedule.sharding import FSDPOptions


def layer(parameter_bytes: float) -> LayerProfile:
    """A layer of ``parameter_bytes`` parameters and no gradient or optimizer bytes."""
    return LayerProfile(
        name="layer",
        forward=1.0,
        backward_input=1.0,
        backward_weight=1.0,
        parameter_bytes=parameter_bytes,
        gradient_bytes=0.0,
        optimizer_bytes=0.0,
    )


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["gpipe", "1f1b", "zb-h1"]),
    ranks=st.integers(1, 3),
    microbatches=st.integers(1, 5),
    layers=st.integers(1, 5),
    shard=st.sampled_from([2, 4]),
    units=st.sampled_from(["layer", 2, "chunk"]),
    prefetch=st.integers(0, 3),
    resharded=st.booleans(),
    data=st.data(),
)
def test_closed_form_memory_matches_the_lowered_parameter_peak(
    name, ranks, microbatches, layers, shard, units, prefetch, resharded, data
):
    schedule = build_schedule(name, ranks, microbatches)
    sizes = [
        tuple(data.draw(st.lists(st.integers(1, 9), min_size=layers, max_size=layers)))
        for _ in range(schedule.num_stages)
    ]
    record = FSDPOptions(
        units=units, reshard_after_forward=resharded, reshard_after_backward=True, prefetch=prefetch
    )
    grid = Grid(dp=shard, sharding="fsdp", comm=record)
    no_grads = tuple((0.0,) * layers for _ in sizes)  # as the layers above: parameters only
    model = StageBytes(tuple(map(tuple, sizes)), no_grads)
    lowered = lower(schedule, record, grid=grid, model=model)
    simulated = simulate_lowered(lowered).memory.parameters
    for rank in range(schedule.num_ranks):
        held = [layer(float(b)) for stage in schedule.placement.stages_of(rank) for b in sizes[stage]]
        shards = sum(each.parameter_bytes for each in held) / shard
        closed = shards + (grid.held_bytes(held) - shards) * (1 - 1 / shard)  # the lowering's convention
        if not resharded:
            assert math.isclose(simulated[rank], closed)
            continue
        wider = Grid(dp=shard, sharding="fsdp", comm=FSDPOptions(units=units, prefetch=2 * prefetch + 1))
        upper = shards + (wider.held_bytes(held) - shards) * (1 - 1 / shard)
        assert closed * (1 - 1e-9) <= simulated[rank] <= upper * (1 + 1e-9)
