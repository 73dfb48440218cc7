"""The planner chooses a grid's data-parallel communication with the lowering's chooser: the options
a plan carries are what :func:`~zerobubble.schedule.lowering.choose_options` picks for the winner's
schedule, partition and bytes under the same budget."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from zerobubble.schedule.grid import Grid, Link
from zerobubble.schedule.lowering import StageBytes, choose_options
from zerobubble.schedule.lowering.choose import TIE, break_tie
from zerobubble.schedule.modelplan import LayerProfile, ModelProfile, plan
from zerobubble.schedule.modelplan.choices import planner_candidates
from zerobubble.schedule.sharding import FSDPOptions


def profile(layers: int, parameter_bytes: float) -> ModelProfile:
    layer = LayerProfile(
        "block", forward=1.0, backward_input=1.0, backward_weight=1.0, activation_bytes=100.0,
        parameter_bytes=parameter_bytes, gradient_bytes=parameter_bytes, optimizer_bytes=6 * parameter_bytes,
        output_bytes=10.0,
    )  # fmt: skip
    return ModelProfile((layer,) * layers, comm_latency=0.01, comm_bandwidth=1e4)


@settings(max_examples=8, deadline=None)
@given(
    ranks=st.integers(1, 2),
    microbatches=st.integers(2, 4),
    dp=st.sampled_from([2, 4]),
    sharding=st.sampled_from([None, "fsdp"]),
    size=st.sampled_from([100.0, 1000.0]),
)
def test_the_plan_carries_what_choose_options_picks(ranks, microbatches, dp, sharding, size):
    grid = Grid(dp=dp, sharding=sharding, dp_link=Link(0.05, 2e3), pp=ranks)
    layers = profile(4 * ranks, size)
    chosen = plan(layers, ranks, microbatches, 1e5, schedules=["1f1b", "zb-h1"], layout=grid, refine=0)
    assert chosen.comm is not None
    winner = chosen.winner
    bounds = [0, *winner.partition, len(layers.layers)]
    stages = [layers.layers[bounds[s] : bounds[s + 1]] for s in range(winner.built.num_stages)]
    model = StageBytes(tuple(tuple(x.parameter_bytes for x in stage) for stage in stages))
    optimizer = [
        sum(x.optimizer_bytes for s in winner.built.placement.stages_of(r) for x in stages[s]) / grid.shard
        for r in range(ranks)
    ]
    expected = choose_options(
        winner.built, winner.costs, grid, model, memory_cap=1e5, candidates=planner_candidates(grid),
        resident=optimizer,
    )  # fmt: skip
    assert chosen.comm.options == expected.options
    assert chosen.comm.timeline.iteration_time == expected.timeline.iteration_time
    # the reason names the choice, its step and peak against the budget, and how many were simulated
    words = expected.options.describe(grid.dp_mode)
    assert chosen.comm.reason.startswith(f"{words}: step {expected.timeline.iteration_time:.3f} s")
    assert f"of {len(expected.tried)} simulated" in chosen.comm.reason or "none of" in chosen.comm.reason
    assert chosen.comm.reason in chosen.reason
    assert chosen.to_dict()["data_parallel"]["lowering"] == expected.options.describe(grid.dp_mode)


def test_ties_are_broken_by_bytes_then_prefetch_then_candidate_order_and_named():
    forward = FSDPOptions(units="layer", reshard_after_forward=True, prefetch=2)
    both = FSDPOptions(units="layer", reshard_after_forward=True, reshard_after_backward=True, prefetch=2)
    shallow = FSDPOptions(units="layer", reshard_after_forward=True, prefetch=1)
    slower = FSDPOptions(units="chunk", prefetch=0)
    index, tie = break_tie([(slower, 2.0, 1.0), (forward, 1.0, 5.0), (both, 1.0, 4.0)], "fsdp")
    assert index == 2 and tie.startswith(f"tied with {forward.describe()} at the same step")
    assert tie.endswith("kept for fewer bytes (4 against 5)")
    index, tie = break_tie([(forward, 1.0, 4.0), (shallow, 1.0 + 1e-12, 4.0), (both, 1.0, 4.0)], "fsdp")
    assert index == 1 and "tied with 2 others" in tie and "a shallower prefetch (1 against 2)" in tie
    index, tie = break_tie([(forward, 1.0, 4.0), (both, 1.0, 4.0)], "fsdp")
    assert index == 0 and "comes first (coarser units, less resharding)" in tie
    assert break_tie([(forward, 1.0, 4.0), (both, 1.1, 4.0)], "fsdp") == (0, "")


@settings(max_examples=8, deadline=None)
@given(
    microbatches=st.integers(2, 4),
    dp=st.sampled_from([2, 4]),
    size=st.sampled_from([1.0, 100.0, 1000.0]),
    latency=st.sampled_from([0.0, 0.05]),
)
def test_the_choice_is_the_least_step_then_bytes_then_prefetch_and_the_reason_says_so(
    microbatches, dp, size, latency
):
    grid = Grid(dp=dp, sharding="fsdp", dp_link=Link(latency, 2e3), pp=2)
    chosen = plan(profile(8, size), 2, microbatches, 1e5, schedules=["1f1b"], layout=grid, refine=0)
    assert chosen.comm is not None
    fits = [t for t in chosen.comm.tried if t[2] <= 1e5 * (1 + 1e-9)]
    step, peak = chosen.comm.timeline.iteration_time, max(chosen.comm.timeline.peak_memory)
    tied = [t for t in fits if t[1] <= min(t[1] for t in fits) * (1 + TIE)]
    assert (peak, chosen.comm.options.prefetch) == min((t[2], t[0].prefetch) for t in tied)
    assert step <= min(t[1] for t in fits) * (1 + TIE)
    assert "+0.000 s" not in chosen.comm.reason
    assert ("; tied with " in chosen.comm.reason) == (len(tied) > 1)
