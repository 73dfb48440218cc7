"""The partition program and the planner (pure Python: no ranks, no torch)."""

from __future__ import annotations

import json

import pytest
from _model_profiles import MiB, lm_profile
from hypothesis import given
from hypothesis import strategies as st

from zerobubble.schedule import ScheduleError
from zerobubble.schedule.modelplan import ModelProfile, format_bytes, parse_bytes, plan
from zerobubble.schedule.partition import (
    MemoryCap,
    brute_force_partition,
    optimal_partition,
    rank_loads,
    rank_memory,
)


def _placement(style: str, ranks: int) -> list[int]:
    if style == "loop":
        return list(range(ranks))
    if style == "v":
        return [*range(ranks), *range(ranks - 1, -1, -1)]
    return [stage % ranks for stage in range(2 * ranks)]  # interleaved, two chunks


@st.composite
def _instances(draw, with_memory: bool):
    style = draw(st.sampled_from(["loop", "v", "interleaved"]))
    ranks = draw(st.integers(1, 3))
    stage_ranks = _placement(style, ranks)
    count = draw(st.integers(len(stage_ranks), len(stage_ranks) + 5))
    costs = st.one_of(st.integers(0, 6).map(float), st.floats(0, 10, allow_nan=False))
    work = draw(st.lists(costs, min_size=count, max_size=count))
    memory = None
    if with_memory:
        fixed = draw(st.lists(st.floats(0, 3), min_size=count, max_size=count))
        scaled = draw(st.lists(st.floats(0, 1), min_size=count, max_size=count))
        inflight = draw(
            st.lists(st.integers(1, 4).map(float), min_size=len(stage_ranks), max_size=len(stage_ranks))
        )
        capacity = draw(st.floats(1, 14))
        memory = MemoryCap(fixed, scaled, inflight, [capacity] * ranks)
    return work, stage_ranks, memory


def _check_optimal(work, stage_ranks, memory) -> None:
    found = optimal_partition(work, stage_ranks, memory)
    expected = brute_force_partition(work, stage_ranks, memory)
    assert (found is None) == (expected is None)
    if found is None:
        return
    ranks = max(stage_ranks) + 1
    assert found.proven
    assert len(found.cuts) == len(stage_ranks) - 1
    assert max(rank_loads(work, found.cuts, stage_ranks, ranks)) == pytest.approx(found.bottleneck, abs=1e-9)
    assert found.bottleneck == pytest.approx(expected.bottleneck, rel=1e-9, abs=1e-9)
    if memory is not None:
        needs = rank_memory(memory, found.cuts, stage_ranks, ranks)
        assert all(need <= cap + 1e-9 for need, cap in zip(needs, memory.capacity))


@given(_instances(with_memory=False))
def test_partition_is_optimal_against_brute_force(instance):
    _check_optimal(*instance)


@given(_instances(with_memory=True))
def test_memory_capped_partition_is_optimal_against_brute_force(instance):
    _check_optimal(*instance)


def test_uneven_model_gets_an_uneven_partition():
    # a heavy head: the even split [4] loads rank 1 with 25, the optimum moves blocks to rank 0
    work = [1.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 16.0]
    assert optimal_partition(work, [0, 1]).bottleneck == 19.0
    vshape = optimal_partition(work, [0, 1, 1, 0])
    assert vshape.cuts[0] == 1 and vshape.cuts[2] == 7  # embedding + head on rank 0 (17), blocks on rank 1
    assert vshape.bottleneck == 18.0


def test_partition_needs_enough_layers():
    with pytest.raises(ScheduleError, match="3 layers cannot fill 4"):
        optimal_partition([1.0, 1.0, 1.0], [0, 1, 1, 0])


def test_large_vshape_is_fast_and_proven():
    work = [float((7 * i) % 11 + 1) for i in range(48)]
    found = optimal_partition(work, _placement("v", 6))
    assert found is not None and found.proven
    assert found.bottleneck >= sum(work) / 6


# -- bytes ------------------------------------------------------------------------------------------


def test_parse_bytes():
    assert parse_bytes("24GiB") == 24 * 2**30
    assert parse_bytes("1.5 GB") == 1.5e9
    assert parse_bytes("512MiB") == 512 * MiB
    assert parse_bytes(1000) == 1000.0
    assert parse_bytes("80%", device_memory=100.0) == pytest.approx(80.0)
    assert parse_bytes(None) is None
    with pytest.raises(ScheduleError, match="only known on a GPU"):
        parse_bytes("80%")
    with pytest.raises(ScheduleError, match="cannot read memory budget"):
        parse_bytes("lots")
    assert format_bytes(3 * 2**30) == "3.00 GiB"


# -- planning ---------------------------------------------------------------------------------------


def test_plan_beats_the_even_split_and_names_its_choice():
    result = plan(lm_profile(), 2, 8)
    winner = result.winner
    even_zbv = next(c for c in result.candidates if c.schedule == "zb-v")
    assert winner.fits and winner.period == min(c.period for c in result.candidates if c.fits)
    assert result.predicted_iteration_time == winner.period
    assert winner.partition != (2, 4, 6)  # not the even split: the head is heavy
    assert result.schedule.name == winner.schedule and result.schedule.num_ranks == 2
    assert winner.schedule in result.reason and "ms" in result.reason
    assert "*" in result.table()
    data = result.to_dict()
    for key in ("schedule", "chunks", "partition", "predicted_iteration_time", "peak_bytes"):
        assert key in data
    json.dumps(data)
    assert even_zbv.period >= winner.period


def test_budget_between_two_schedules_picks_the_one_that_fits():
    profile = lm_profile()
    free = plan(profile, 2, 8, schedules=["zb-h2", "v-min"])
    needs = {c.schedule: max(c.peak_bytes) for c in free.candidates}
    assert needs["v-min"] < needs["zb-h2"]
    assert free.winner.schedule == "zb-h2"  # fastest without a budget
    budget = (needs["v-min"] + needs["zb-h2"]) / 2
    tight = plan(profile, 2, 8, memory_limit=budget, schedules=["zb-h2", "v-min"])
    assert tight.winner.schedule == "v-min"
    assert max(tight.winner.peak_bytes) <= budget
    over = next(c for c in tight.candidates if c.schedule == "zb-h2")
    assert not over.fits or max(over.peak_bytes) <= budget


def test_nothing_fits_names_rank_bytes_and_budget():
    with pytest.raises(ScheduleError, match=r"rank \d needs .* against the budget of 10485760 bytes"):
        plan(lm_profile(), 2, 8, memory_limit="10MiB")


def test_profile_round_trips_through_json(tmp_path):
    profile = lm_profile()
    path = tmp_path / "profile.json"
    profile.save(path)
    assert ModelProfile.load(path) == profile
    path.write_text("{}")
    with pytest.raises(ScheduleError, match="not a layer profile"):
        ModelProfile.load(path)


def test_fewer_chunks_win_a_near_tie():
    from zerobubble.schedule.modelplan import PlanCandidate
    from zerobubble.schedule.modelplan.search import _choose

    vshape = PlanCandidate("zb-v", 2, (1, 2, 3), period=1.00, peak_bytes=(1.0,), fits=True)
    single = PlanCandidate("zb-2p", 1, (2,), period=1.015, peak_bytes=(2.0,), fits=True)
    slower = PlanCandidate("1f1b", 1, (2,), period=1.10, peak_bytes=(1.0,), fits=True)
    assert _choose([vshape, single, slower], tie_margin=0.02) is single
    assert _choose([vshape, single, slower], tie_margin=0.0) is vshape
    assert _choose([vshape, slower], tie_margin=0.02) is vshape


def test_fused_schedules_are_predicted_with_the_measured_fused_backward():
    from dataclasses import replace

    profile = lm_profile()
    slow = replace(
        profile, layers=tuple(replace(layer, backward_fused=2 * layer.fused) for layer in profile.layers)
    )
    period = {}
    for name, candidate_profile in (("split", profile), ("slow fused", slow)):
        result = plan(candidate_profile, 2, 8, schedules=["1f1b", "zb-h1"])
        period[name] = {c.schedule: c.period for c in result.candidates}
    assert period["slow fused"]["1f1b"] > 1.3 * period["split"]["1f1b"]  # 1F1B runs BW ops
    assert period["slow fused"]["zb-h1"] == period["split"]["zb-h1"]  # ZB-H1 runs B and W


def test_median_profile_takes_each_time_from_the_middle_rank():
    from dataclasses import replace

    from zerobubble.schedule.modelplan import median_profile

    base = lm_profile()
    slower = replace(base, layers=tuple(replace(layer, forward=2 * layer.forward) for layer in base.layers))
    slowest = replace(base, layers=tuple(replace(layer, forward=9 * layer.forward) for layer in base.layers))
    combined = median_profile([slowest, base, slower])
    assert [layer.forward for layer in combined.layers] == [2 * layer.forward for layer in base.layers]
    assert combined.layers[0].activation_bytes == base.layers[0].activation_bytes
    with pytest.raises(ScheduleError, match="different numbers of layers"):
        median_profile([base, replace(base, layers=base.layers[:3])])


def test_search_out_of_budget_returns_its_best_partition_unproven():
    import itertools

    from zerobubble.schedule.partition import _branch_and_bound

    work = [float((5 * i) % 7 + 1) for i in range(20)]
    stage_ranks = _placement("interleaved", 3)
    prefix = list(itertools.accumulate(work, initial=0.0))
    cut_short = _branch_and_bound(prefix, stage_ranks, 3, None, node_budget=50)
    complete = _branch_and_bound(prefix, stage_ranks, 3, None)
    assert not cut_short.proven and complete.proven
    assert len(cut_short.cuts) == len(stage_ranks) - 1
    assert complete.bottleneck <= cut_short.bottleneck
    assert max(rank_loads(work, cut_short.cuts, stage_ranks, 3)) == pytest.approx(cut_short.bottleneck)


# -- calibration from a run's recorded steps -------------------------------------------------------


def _stage_times(result, profile: ModelProfile, scale=lambda stage: 1.0) -> dict[str, list[float]]:
    """What a run of ``result`` would record per chunk when its ops took ``scale(s)`` × the profile."""
    from zerobubble.schedule.modelplan import stage_costs

    schedule = result.schedule
    costs = stage_costs(profile, result.partition, schedule.num_stages, fused=not schedule.splits_backward)
    stages = range(schedule.num_stages)
    return {key: [getattr(costs, key)[s] * scale(s) for s in stages] for key in ("f", "b", "w")}


def _bounds(result) -> list[int]:
    return [0, *result.partition, len(lm_profile().layers)]


def test_calibration_with_the_profiled_times_keeps_plan_and_prediction():
    from zerobubble.schedule.modelplan import calibrate

    profile = lm_profile()
    running = plan(profile, 2, 8, optimizer="sync")
    calibrated = calibrate(running, profile, _bounds(running), _stage_times(running, profile), 1e-4, 3)
    calibration = calibrated.calibration
    assert calibration is not None and running.calibration is None
    assert calibration.keeps_plan and calibration.steps == 3
    assert calibration.replan.winner.schedule == running.winner.schedule
    assert calibration.replan.partition == running.partition
    # no size term any more (the run's latency is per message): equal up to the bandwidth term
    assert calibration.predicted_iteration_time == pytest.approx(running.predicted_iteration_time, rel=0.01)
    assert calibration.initial_iteration_time == running.predicted_iteration_time
    assert calibrated.winner is running.winner  # the running plan stays what runs


def test_calibration_from_slower_ops_replans_to_the_same_or_a_better_plan():
    from zerobubble.schedule.modelplan import calibrate

    profile = lm_profile()
    running = plan(profile, 2, 8, optimizer="sync")
    # the last chunk (the head's) measured 3x slower than profiled, the others as profiled
    last = running.schedule.num_stages - 1
    measured = _stage_times(running, profile, lambda stage: 3.0 if stage == last else 1.0)
    calibration = calibrate(running, profile, _bounds(running), measured, 2e-4, 2).calibration
    assert calibration is not None
    assert calibration.predicted_iteration_time > running.predicted_iteration_time
    replanned = calibration.replan.predicted_iteration_time
    assert replanned <= calibration.predicted_iteration_time * (1 + 1e-9)  # same or better
    # the heavy last chunk should shed a layer: the re-plan moves the cut and says so
    assert not calibration.keeps_plan
    assert replanned < calibration.predicted_iteration_time * 0.98
    assert calibration.replan.partition != running.partition
    assert "prefers" in calibration.describe()
    assert calibration.profile.comm_latency == 2e-4
    head = calibration.profile.layers[-1]
    assert head.forward == pytest.approx(3 * profile.layers[-1].forward)
    assert calibration.profile.layers[0].forward == pytest.approx(profile.layers[0].forward)


def test_calibrated_plan_json_fields():
    from zerobubble.schedule.modelplan import calibrate

    profile = lm_profile()
    running = plan(profile, 2, 8)
    assert running.to_dict()["calibration"] is None
    calibrated = calibrate(running, profile, _bounds(running), _stage_times(running, profile), 1e-4, 2)
    data = json.loads(json.dumps(calibrated.to_dict()))
    section = data["calibration"]
    for key in ("steps", "transfer_latency", "initial_iteration_time", "predicted_iteration_time"):
        assert key in section
    assert set(section["measured_seconds"]) == {"f", "b", "w"}
    assert len(section["measured_seconds"]["f"]) == running.schedule.num_stages
    assert set(section["replan"]) == {
        "schedule",
        "vocab_parallel",
        "chunks",
        "partition",
        "predicted_iteration_time",
    }
    assert section["keeps_plan"] is True
    assert data["predicted_iteration_time"] == running.predicted_iteration_time
    assert "calibrated on 2 recorded steps" in calibrated.calibration.describe()


def test_calibration_refuses_bounds_of_another_model():
    from zerobubble.schedule.modelplan import calibrated_profile

    with pytest.raises(ScheduleError, match="cannot calibrate a profile of 8 layers"):
        calibrated_profile(lm_profile(), [0, 4, 9], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0], 0.0)


# -- ranks sharing cores ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v", "interleaved-1f1b"])
def test_shared_cores_simulation_matches_own_cores_and_total_work(name):
    from zerobubble.schedule import CostModel, build_schedule, simulate
    from zerobubble.schedule.simulate import _run, _run_shared, encode_programs, resolve_costs_for

    schedule = build_schedule(name, 4, 8)
    costs = CostModel(f=[1, 2, 1.5, 1], b=[2, 1, 1, 3], w=[1, 1, 1, 1], comm=0.1)
    resolved = resolve_costs_for(schedule, costs)
    encoded = encode_programs(schedule)
    own_starts, own_ends = _run(schedule, resolved, encoded)
    # a core per rank: the same timeline
    shared_starts, shared_ends = _run_shared(schedule, resolved, encoded, 4)
    for own, shared in ((own_starts, shared_starts), (own_ends, shared_ends)):
        assert [list(map(pytest.approx, r)) for r in own] == [list(r) for r in shared]
    work = sum(simulate(schedule, costs).busy)
    one_core = simulate(schedule, costs.replace(comm=0.0), cores=1)
    assert one_core.makespan == pytest.approx(work)  # one core: every op's work one after another
    two = simulate(schedule, costs, cores=2).makespan
    assert max(work / 2, simulate(schedule, costs).makespan) <= two * (1 + 1e-9) < work
    with pytest.raises(ScheduleError, match="cores must be at least 1"):
        simulate(schedule, costs, cores=0)


def test_plan_on_shared_cores_predicts_longer_and_says_so():
    own = plan(lm_profile(), 4, 8)
    shared = plan(lm_profile(), 4, 8, cores=2)
    assert shared.cores == 2 and own.cores is None
    assert shared.predicted_iteration_time > own.predicted_iteration_time
    assert "4 ranks predicted on 2 shared cores" in shared.reason
    assert shared.to_dict()["cores"] == 2
