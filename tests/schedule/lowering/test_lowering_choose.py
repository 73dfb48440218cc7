"""Collective costs, the choice of lowering under a memory cap, and the communication lanes."""

import json

import pytest

from zerobubble.schedule import CostModel, ScheduleError, build_schedule
from zerobubble.schedule.grid import Grid, Link
from zerobubble.schedule.lowering import (
    CollectiveCosts,
    CommKind,
    CommProfile,
    StageBytes,
    candidate_options,
    choose_options,
    lower,
    render_comm_svg,
    render_comm_text,
    simulate_lowered,
    to_comm_chrome_trace,
)
from zerobubble.schedule.sharding import ONCE_PER_STEP

LINK = Link(latency=0.5, bandwidth=2.0)


def test_ring_volumes_follow_the_alpha_beta_model():
    replicated = CollectiveCosts(dp=4, shard=1, dp_link=LINK, shard_link=LINK)
    assert replicated.time(CommKind.ALL_REDUCE, 8.0) == pytest.approx(0.5 + 2 * 3 / 4 * 8 / 2)
    fsdp = CollectiveCosts(dp=4, shard=4, dp_link=LINK, shard_link=LINK)
    assert fsdp.time(CommKind.UNSHARD, 8.0) == pytest.approx(0.5 + 3 / 4 * 8 / 2)
    assert fsdp.time(CommKind.REDUCE_SCATTER, 8.0) == pytest.approx(0.5 + 3 / 4 * 8 / 2)
    hsdp = CollectiveCosts(dp=4, shard=2, dp_link=LINK, shard_link=LINK)  # + the rows' all-reduce of a shard
    assert hsdp.time(CommKind.REDUCE_SCATTER, 8.0) == pytest.approx((0.5 + 4 / 2) + (0.5 + 4 / 2))


def test_a_group_spanning_nodes_runs_at_the_inter_node_link():
    slow = Link(1.0, 1.0)
    grid = Grid(dp=4, sharding="fsdp", dp_link=LINK)
    inside = CollectiveCosts.from_grid(grid, gpus_per_node=8, inter_node=slow)
    across = CollectiveCosts.from_grid(
        Grid(dp=4, tp=4, sharding="fsdp", dp_link=LINK), gpus_per_node=8, inter_node=slow
    )
    assert inside.shard_link == LINK and across.shard_link == slow


def test_a_measured_profile_overrides_the_model():
    profile = CommProfile({"unshard": [(0.0, 0.1), (10.0, 1.1)]})
    costs = CollectiveCosts(dp=2, shard=2, dp_link=LINK, shard_link=LINK, profile=profile)
    assert costs.time(CommKind.UNSHARD, 5.0) == pytest.approx(0.6)
    assert costs.time(CommKind.UNSHARD, 20.0) == pytest.approx(2.1)  # extrapolated
    assert costs.time(CommKind.REDUCE_SCATTER, 4.0) == pytest.approx(0.5 + 1 / 2 * 4 / 2)  # not measured
    with pytest.raises(ScheduleError, match="unknown kind"):
        CommProfile({"gather": [(1.0, 1.0)]})


def test_candidates_cover_granularity_reshard_and_prefetch():
    grid = Grid(dp=2, sharding="fsdp")
    options = candidate_options(grid)
    assert {o.units for o in options} == {"chunk", "layer", 2}
    assert {o.prefetch for o in options} == {1, 2}
    assert {o.reshard_after_forward for o in options} == {False, True}
    replicated = candidate_options(Grid(dp=2), bucket_bytes=(0.0, 4.0))
    assert [o.bucket_bytes for o in replicated] == [0.0, 4.0]
    assert candidate_options(Grid()) == [ONCE_PER_STEP]


def test_the_choice_is_the_fastest_that_fits_and_says_why():
    costs = CostModel(f=1.0, b=1.0, w=1.0, mem_b=2.0)
    schedule = build_schedule("1f1b", 2, 4, costs)
    grid = Grid(dp=2, sharding="fsdp", dp_link=Link(0.05, 4.0))
    model = StageBytes.uniform(2, 4, 2.0)
    free = choose_options(schedule, costs, grid, model)
    fastest = min(time for _, time, _ in free.tried)
    assert free.timeline.iteration_time == fastest
    lowest = min(peak for _, _, peak in free.tried)
    capped = choose_options(schedule, costs, grid, model, memory_cap=lowest)
    assert max(capped.timeline.peak_memory) <= lowest
    assert capped.options.reshard_after_forward and capped.options.units != "chunk"
    assert "within the cap" in capped.reason
    impossible = choose_options(schedule, costs, grid, model, memory_cap=lowest / 10)
    assert "no candidate fits" in impossible.reason


def test_communication_has_lanes_of_its_own():
    schedule = build_schedule("1f1b", 2, 3)
    lowered = lower(schedule, grid=Grid(dp=2), model=StageBytes.uniform(2, 2, 1.0))
    timeline = simulate_lowered(lowered, CostModel(comm=0.2), CollectiveCosts(2, 1, LINK, LINK))
    text = render_comm_text(timeline, 60)
    assert "rank 0" in text and "      pp |" in text and "      dp |" in text and "a" in text.split("dp |")[1]
    trace = json.loads(to_comm_chrome_trace(timeline))
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"rank 0", "rank 0 pp", "rank 0 dp", "rank 1 dp"} <= names
    assert any(e.get("cat") == "dp" and e["name"].startswith("all_reduce") for e in trace["traceEvents"])
    assert render_comm_svg(timeline).count("<rect") == sum(
        len(s)
        for _, _, s in __import__("zerobubble.schedule.lowering.pictures", fromlist=["lanes"]).lanes(timeline)
    )
