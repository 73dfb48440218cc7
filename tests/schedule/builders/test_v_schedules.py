"""Tests of the V-shape schedules: zb-v (ZB paper's V-schedule), v-half and v-min (arXiv 2405.15362).

Expectations come from the papers, not from the code: ZB-V has zero bubble for T_F = T_B = T_W,
T_comm = 0 and m ≥ 2p within p·M_B; V-Half holds ⌊(p+2)/2⌋·M_B with about half of 1F1B's bubble,
V-Min ⌊(p+4)/3⌋·M_B with about two thirds of it (the table of the authors' V-shape release).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zerobubble
from zerobubble.schedule.builders import build_schedule
from zerobubble.schedule.builders.planning.v_blocks import BLOCK_VARIANTS, block_programs
from zerobubble.schedule.costs import CostModel
from zerobubble.schedule.ir import Kind, Placement, Schedule, ScheduleError
from zerobubble.schedule.paper import row_costs
from zerobubble.schedule.simulate import simulate
from zerobubble.schedule.validate import validate_schedule

TABLE5 = Path(zerobubble.__file__).parent / "data" / "paper_table5.json"  # the paper's Table 5, shipped
EPS = 1e-9


def bubble_time(timeline) -> float:
    """Idle time of the slowest rank within the iteration: iteration time − ideal."""
    return timeline.iteration_time - timeline.ideal


def paper_row(model: str, microbatches: int) -> dict:
    if not TABLE5.exists():
        pytest.skip("paper table 5 reference is not available")
    rows = json.loads(TABLE5.read_text())["rows"]
    return next(r for r in rows if r["model"] == model and r["microbatches"] == microbatches)


# -- zb-v -------------------------------------------------------------------------------------


@pytest.mark.parametrize("p, m", [(2, 4), (2, 7), (4, 8), (4, 12), (4, 17), (8, 16), (8, 24)])
def test_zb_v_zero_bubble_with_equal_costs(p, m):
    schedule = build_schedule("zb-v", p, m)
    timeline = simulate(schedule)
    assert schedule.placement == Placement.vshape(p)
    assert schedule.splits_backward
    assert timeline.bubble_rate == pytest.approx(0.0, abs=EPS)
    assert timeline.iteration_time == pytest.approx(3.0 * m)
    assert max(timeline.peak_memory_mb) <= p + EPS


@pytest.mark.parametrize(
    "costs",
    [
        CostModel(),
        CostModel(f=1.0, b=1.3, w=0.6, comm=0.1, mem_w=0.4),
        CostModel(
            f=[1.0, 1.4, 0.8, 1.1],
            b=[1.2, 1.0, 1.5, 1.0],
            w=0.5,
            comm=0.05,
            mem_b=[1.0, 2.0, 1.0, 1.5],
            mem_w=0.3,
        ),
    ],
)
def test_zb_v_peak_memory_within_p_mb(costs):
    p, m = 4, 13
    schedule = build_schedule("zb-v", p, m, costs)
    timeline = simulate(schedule, costs)
    mean_mem_b = costs.mem_b if isinstance(costs.mem_b, float) else sum(costs.mem_b) / len(costs.mem_b)
    assert max(timeline.peak_memory) <= p * mean_mem_b * (1 + EPS)
    assert schedule.meta["memory_limit"] == pytest.approx([p * mean_mem_b] * p)


@pytest.mark.parametrize("p, m", [(1, 1), (1, 3), (2, 1), (4, 1), (4, 3), (8, 1), (8, 5), (8, 15)])
def test_zb_v_small_microbatch_counts_are_valid(p, m):
    schedule = build_schedule("zb-v", p, m)  # validates
    assert schedule.num_ops == 3 * 2 * p * m
    timeline = simulate(schedule)
    # Never worse than running the microbatches one after another through the V.
    assert timeline.iteration_time <= m * 2 * p * 1.5 + EPS


def test_zb_v_beats_1f1b_and_matches_interleaved_on_paper_costs():
    row = paper_row("1.5B", 24)
    p, m, costs = row["stages"], row["microbatches"], row_costs(row)
    zbv = simulate(build_schedule("zb-v", p, m, costs), costs)
    one_f_one_b = simulate(build_schedule("1f1b", p, m, costs), costs)
    interleaved = simulate(
        build_schedule("interleaved-1f1b", p, m, costs, chunks=row["interleaved_chunks"]), costs
    )
    assert zbv.bubble_rate < 0.5 * one_f_one_b.bubble_rate
    assert zbv.bubble_rate <= interleaved.bubble_rate + 0.01
    assert max(zbv.peak_memory_mb) <= p + EPS < max(interleaved.peak_memory_mb)


@pytest.mark.parametrize(
    "costs",
    [
        CostModel(f=1.0, b=2.0, w=1.0, comm=0.2),
        CostModel(
            f=[1.0, 1.2, 0.9, 1.1, 1.0, 1.3], b=[1.5, 1.4, 1.6, 1.2, 1.5, 1.5], w=0.7, comm=0.15, mem_w=0.3
        ),
    ],
)
def test_zb_v_beats_1f1b_with_unequal_costs_and_transfers(costs):
    p = 4 if isinstance(costs.f, float) else 6
    m = 3 * p
    zbv = simulate(build_schedule("zb-v", p, m, costs), costs)
    baseline = simulate(build_schedule("1f1b", p, m, costs), costs)
    assert zbv.iteration_time < baseline.iteration_time
    assert bubble_time(zbv) < 0.6 * bubble_time(baseline)


def test_zb_v_takes_the_users_memory_limit():
    p, m = 4, 16
    roomy = build_schedule("zb-v", p, m, CostModel(comm=0.1, memory_limit=6.0))
    tight = build_schedule("zb-v", p, m, CostModel(comm=0.1, memory_limit=2.0))
    assert max(simulate(tight).peak_memory) <= 2.0 + EPS
    assert tight.meta["memory_limit"] == [2.0] * p and roomy.meta["memory_limit"] == [6.0] * p
    assert (
        simulate(roomy, CostModel(comm=0.1)).iteration_time
        <= simulate(tight, CostModel(comm=0.1)).iteration_time
    )


def test_v_builders_reject_bad_requests():
    with pytest.raises(ScheduleError, match="memory limit"):
        build_schedule("zb-v", 4, 8, CostModel(memory_limit=0.5))
    for name in ("zb-v", "v-half", "v-min"):
        with pytest.raises(ScheduleError, match="2 chunk"):
            build_schedule(name, 4, 8, chunks=3)


# -- v-half / v-min ---------------------------------------------------------------------------


@pytest.mark.parametrize("p", [4, 8])
@pytest.mark.parametrize(
    "name, memory_of_p, bubble_share",
    [
        # paper: V-Half memory ⌊(p+2)/2⌋ (0.75·p at p=4, 0.625·p at p=8), bubble ≈ 1/2 of 1F1B's
        ("v-half", lambda p: (p + 2) // 2, 0.5),
        # paper: V-Min memory ⌊(p+4)/3⌋ (0.5·p at p=4 and p=8), bubble ≈ 2/3 of 1F1B's
        ("v-min", lambda p: (p + 4) // 3, 0.7),
    ],
)
def test_controllable_memory_against_1f1b(p, name, memory_of_p, bubble_share):
    m = 3 * p
    schedule = build_schedule(name, p, m)
    timeline = simulate(schedule)
    baseline = simulate(build_schedule("1f1b", p, m))
    assert max(baseline.peak_memory_mb) == pytest.approx(p)
    assert max(timeline.peak_memory_mb) <= memory_of_p(p) + EPS
    assert max(timeline.peak_memory_mb) < max(baseline.peak_memory_mb)
    assert bubble_time(timeline) <= bubble_share * bubble_time(baseline) + EPS
    assert timeline.bubble_rate <= (bubble_share + 0.05) * baseline.bubble_rate
    assert schedule.meta["memory_limit_mb"] == pytest.approx(memory_of_p(p))
    assert schedule.meta["memory_microbatches"] == memory_of_p(p)


def test_memory_ordering_of_the_v_family():
    p, m = 8, 24
    peaks = {
        name: max(simulate(build_schedule(name, p, m)).peak_memory_mb) for name in ("zb-v", "v-half", "v-min")
    }
    assert peaks["v-min"] < peaks["v-half"] < peaks["zb-v"] <= p + EPS


def test_v_half_respects_a_smaller_user_limit():
    schedule = build_schedule("v-half", 8, 16, CostModel(memory_limit=3.0))
    assert max(simulate(schedule).peak_memory) <= 3.0 + EPS
    assert schedule.meta["memory_limit"] == pytest.approx([3.0] * 8)


# -- properties -------------------------------------------------------------------------------


@st.composite
def v_requests(draw):
    p = draw(st.integers(1, 8))
    m = draw(st.integers(1, 24))
    name = draw(st.sampled_from(["zb-v", "v-half", "v-min"]))
    length = draw(st.sampled_from([None, p, 2 * p]))

    def values(low, high, size=length):
        if size is None:
            return draw(st.floats(low, high))
        return draw(st.lists(st.floats(low, high), min_size=size, max_size=size))

    # Memory per rank-stage (scalar or length p): the registry's "1p" default reads it that way.
    mem_b = values(0.5, 2.0, size=draw(st.sampled_from([None, p])))
    costs = CostModel(
        f=values(0.2, 2.0),
        b=values(0.2, 2.0),
        w=values(0.1, 2.0),
        comm=draw(st.floats(0.0, 0.5)),
        mem_b=mem_b,
        mem_w=0.0,
    )
    resolved = costs.resolve(Placement.vshape(p))
    need = max(sum(resolved.mem_b[s] for s in Placement.vshape(p).stages_of(r)) for r in range(p))
    mem_w_share = draw(st.floats(0.0, 0.9))
    costs = costs.replace(mem_w=[mem_w_share * chunk_mem_b for chunk_mem_b in resolved.mem_b])
    limit = draw(st.one_of(st.none(), st.floats(1.0, 3.0 * p).map(lambda k: k * need)))
    return name, p, m, costs.with_memory_limit(limit)


@settings(max_examples=30, deadline=None)
@given(v_requests())
def test_every_v_schedule_validates_and_respects_memory(request):
    name, p, m, costs = request
    schedule = build_schedule(name, p, m, costs)  # raises ValidationError on any defect
    timeline = simulate(schedule, costs)
    resolved = costs.resolve(schedule.placement)
    assert schedule.num_ops == 3 * 2 * p * m
    assert all(op.kind is not Kind.BW for _, op in schedule.ops())
    for rank, peak in enumerate(timeline.peak_memory):
        assert peak <= resolved.memory_limit[rank] * (1 + EPS) + EPS
        if name == "zb-v" and costs.memory_limit is None:
            assert peak <= p * resolved.memory_unit * (1 + EPS) + EPS
    assert timeline.iteration_time >= timeline.ideal * (1 - EPS)
    assert math.isfinite(schedule.meta["iteration_time"])
    assert schedule.meta["iteration_time"] == pytest.approx(timeline.iteration_time)


@pytest.mark.long
def test_zb_v_is_fast_at_scale():
    costs = CostModel(f=10402, b=10248, w=7698, comm=460, mem_b=454656, mem_w=196608)
    began = time.perf_counter()
    build_schedule("zb-v", 32, 256, costs, validate=False)
    assert time.perf_counter() - began < 4.0


@pytest.mark.parametrize("model, microbatches", [("6.2B", 24), ("14.6B", 64), ("28.3B", 96)])
def test_zb_v_beats_interleaved_and_zb_1p_on_paper_rows(model, microbatches):
    """Paper (V-schedule): ZB-V beats interleaved 1F1B and ZB-1p at no more than p·M_B."""
    row = paper_row(model, microbatches)
    p, m, costs = row["stages"], row["microbatches"], row_costs(row)
    zbv = simulate(build_schedule("zb-v", p, m, costs), costs)
    interleaved = simulate(
        build_schedule("interleaved-1f1b", p, m, costs, chunks=row["interleaved_chunks"]), costs
    )
    zb_1p = simulate(build_schedule("zb-1p", p, m, costs), costs)
    assert max(zbv.peak_memory_mb) <= p + EPS
    assert zbv.bubble_rate < interleaved.bubble_rate - 0.005
    assert zbv.bubble_rate < zb_1p.bubble_rate - 0.005


# -- building blocks (v_blocks) ---------------------------------------------------------------


@pytest.mark.parametrize("model, microbatches", [("1.5B", 24), ("6.2B", 24), ("1.5B", 64)])
def test_v_half_beats_1f1b_on_paper_rows(model, microbatches):
    """With realistic costs V-Half keeps ⌊(p+2)/2⌋·M_B and still has less bubble than 1F1B (paper)."""
    row = paper_row(model, microbatches)
    p, m, costs = row["stages"], row["microbatches"], row_costs(row)
    half = simulate(build_schedule("v-half", p, m, costs), costs)
    baseline = simulate(build_schedule("1f1b", p, m, costs), costs)
    assert max(half.peak_memory_mb) <= (p + 2) // 2 + EPS
    assert half.bubble_rate < 0.85 * baseline.bubble_rate


def test_v_min_fixed_blocks_improve_on_the_greedy_on_a_paper_row():
    """6.2B, m = 64: the memory-bounded greedy alone gave bubble 0.245 under ⌊(p+4)/3⌋·M_B; a
    repeated building block (ours or the authors' pattern) does better."""
    row = paper_row("6.2B", 64)
    p, m, costs = row["stages"], row["microbatches"], row_costs(row)
    schedule = build_schedule("v-min", p, m, costs)
    timeline = simulate(schedule, costs)
    assert max(timeline.peak_memory_mb) <= (p + 4) // 3 + EPS
    assert timeline.bubble_rate < 0.22
    assert schedule.meta["planner"] in ("block", "pattern")


@pytest.mark.parametrize("variant", BLOCK_VARIANTS)
def test_block_peak_memory_is_the_steady_states(variant):
    """A repeated block's peak memory does not grow with the number of microbatches."""
    costs = CostModel(f=1.0, b=1.1, w=0.5, comm=0.05, mem_w=0.4).resolve(Placement.vshape(4))
    peaks = [
        max(
            simulate(
                Schedule("block", costs.placement, m, block_programs(costs, m, variant)), costs
            ).peak_memory
        )
        for m in (24, 48)
    ]
    assert peaks[0] == pytest.approx(peaks[1])
    schedule = Schedule("block", costs.placement, 40, block_programs(costs, 40, variant))
    timeline = validate_schedule(schedule, costs)
    assert timeline.iteration_time < 40 * 2 * 4 * 1.3  # far below one microbatch at a time through the V
