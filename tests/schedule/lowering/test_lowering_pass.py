"""The lowering pass and the overlapping simulator over registry schedules (hypothesis)."""

from collections import Counter
from dataclasses import replace

import pytest
from _lowering import any_options, built, fsdp_options, stage_bytes
from hypothesis import given, settings
from hypothesis import strategies as st

from zerobubble.schedule import ScheduleError, build_schedule, simulate
from zerobubble.schedule.grid import Grid, Link
from zerobubble.schedule.lowering import (
    CollectiveCosts,
    CommKind,
    Compute,
    Issue,
    StageBytes,
    Wait,
    lower,
    simulate_lowered,
    validate_lowered,
)
from zerobubble.schedule.sharding import ONCE_PER_STEP, FSDPOptions

FAST_SETTINGS = settings(max_examples=40, deadline=None)
FSDP2 = Grid(dp=2, sharding="fsdp")


@FAST_SETTINGS
@given(setup=built(), choice=any_options(), layers=st.integers(1, 5))
def test_every_lowering_validates_and_reduces_each_gradient_once(setup, choice, layers):
    schedule, _ = setup
    options, grid = choice
    lowered = lower(schedule, options, grid=grid, model=stage_bytes(schedule, layers))
    validate_lowered(lowered)
    if lowered.data_parallel == "none":
        return
    for rank, program in enumerate(lowered.programs):
        reduced = Counter(
            (a.comm.stage, a.comm.index)
            for a in program
            if isinstance(a, Issue) and a.comm.kind in (CommKind.REDUCE_SCATTER, CommKind.ALL_REDUCE)
        )
        stages = schedule.placement.stages_of(rank)
        expected = {(s, i) for s in stages for i in range(len(lowered.part_layers[s]))}
        assert set(reduced) == expected and set(reduced.values()) == {1}


@FAST_SETTINGS
@given(setup=built(), options=fsdp_options())
def test_no_part_reads_a_resharded_unit(setup, options):
    schedule, _ = setup
    lowered = lower(schedule, options, grid=FSDP2, model=stage_bytes(schedule))
    for program in lowered.programs:
        ready = set()
        for action in program:
            if isinstance(action, Wait) and action.comm.kind is CommKind.UNSHARD:
                ready.add((action.comm.stage, action.comm.index))
            elif isinstance(action, Issue) and action.comm.kind is CommKind.RESHARD:
                ready.discard((action.comm.stage, action.comm.index))
            elif isinstance(action, Compute) and not action.op.is_vocab:
                assert (action.op.stage, action.part) in ready


@FAST_SETTINGS
@given(setup=built(comm=False))
def test_without_data_parallelism_or_comm_cost_it_is_simulate(setup):
    schedule, costs = setup
    plain = simulate(schedule, costs)
    timeline = simulate_lowered(lower(schedule), costs)
    spans = timeline.op_spans()
    assert spans.start == plain.start and spans.end == plain.end
    assert timeline.iteration_time == plain.iteration_time
    assert timeline.memory.activations == plain.peak_memory


@FAST_SETTINGS
@given(setup=built())
def test_with_hop_costs_it_is_never_faster_than_simulate(setup):
    schedule, costs = setup  # a channel carries one message at a time: only queueing can add
    plain = simulate(schedule, costs)
    assert simulate_lowered(lower(schedule), costs).iteration_time >= plain.iteration_time * (1 - 1e-9)


@FAST_SETTINGS
@given(setup=built(), choice=any_options(), latency=st.floats(0, 0.5), bandwidth=st.floats(0.5, 20))
def test_overlap_is_never_slower_than_serialising(setup, choice, latency, bandwidth):
    schedule, costs = setup
    options, grid = choice
    lowered = lower(schedule, options, grid=grid, model=stage_bytes(schedule))
    link = Link(latency, bandwidth)
    collectives = CollectiveCosts(grid.dp, grid.shard, link, link)
    overlapped = simulate_lowered(lowered, costs, collectives)
    serial = simulate_lowered(lowered, costs, collectives, overlap=False)
    assert overlapped.iteration_time <= serial.iteration_time * (1 + 1e-9) + 1e-12
    no_comm = simulate_lowered(lowered, costs)
    assert overlapped.iteration_time >= no_comm.iteration_time * (1 - 1e-9) - 1e-12


@FAST_SETTINGS
@given(setup=built())
def test_per_layer_units_resharded_peak_below_per_chunk(setup):
    schedule, costs = setup
    model = stage_bytes(schedule, layers=4)

    def peak(**choices):
        lowered = lower(schedule, FSDPOptions(**choices), grid=FSDP2, model=model)
        return max(simulate_lowered(lowered, costs).memory.parameters)

    chunk = peak(units="chunk", reshard_after_forward=False)
    layer = peak(units="layer", reshard_after_forward=True, reshard_after_backward=True)
    assert layer < chunk


def test_fsdp_peak_counts_full_units_while_unsharded():
    schedule = build_schedule("1f1b", 2, 4)
    model = StageBytes.uniform(2, 2, 8.0)
    whole = lower(schedule, ONCE_PER_STEP, grid=Grid(dp=4, sharding="fsdp"), model=model)
    # both units whole at once, and both gradient buffers (the same bytes) until the reduce-scatter
    assert simulate_lowered(whole).memory.parameters == (32.0, 32.0)
    resting = lower(schedule, ONCE_PER_STEP, grid=Grid(dp=4), model=model)
    assert simulate_lowered(resting).memory.parameters == (32.0, 32.0)  # replicated: always whole


def test_exposed_collectives_lengthen_the_step_by_what_is_not_hidden():
    schedule = build_schedule("gpipe", 1, 2)
    lowered = lower(schedule, grid=Grid(dp=2), model=StageBytes.uniform(1, 1, 4.0))
    link = Link(0.0, 4.0)  # all-reduce of 4 bytes over 2 ranks: 2·(1/2)·4 / 4 = 1
    timeline = simulate_lowered(lowered, None, CollectiveCosts(2, 1, link, link))
    assert timeline.iteration_time == pytest.approx(2 * 1.0 + 2 * 2.0 + 1.0)  # F F BW BW, then the reduction
    assert timeline.exposed_dp == pytest.approx(1.0)


def test_options_that_do_not_fit_are_refused():
    schedule = build_schedule("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match="byte sizes"):
        lower(schedule, grid=FSDP2)
    with pytest.raises(ScheduleError, match="dp ≥ 2"):
        lower(schedule, grid=Grid(dp=1, sharding="fsdp"), model=StageBytes.uniform(2, 1, 1.0))
    with pytest.raises(ScheduleError, match="FSDPOptions"):
        lower(schedule, FSDPOptions(units="row"))
    with pytest.raises(ScheduleError, match="an FSDPOptions record"):
        lower(schedule, {"units": "layer"})  # type: ignore[arg-type]


REDUCTIONS = (CommKind.ALL_REDUCE, CommKind.REDUCE_SCATTER)


@settings(max_examples=10, deadline=None)
@given(name=st.sampled_from(["1f1b", "interleaved-1f1b", "zb-h1"]), sharding=st.sampled_from([None, "fsdp"]))
def test_reductions_after_the_step_follow_every_compute_and_never_shorten_it(name, sharding):
    schedule = build_schedule(name, 2, 4)
    grid = Grid(dp=4, sharding=sharding, dp_link=Link(0.5, 2.0))
    model = StageBytes.uniform(schedule.num_stages, 2, 4.0)
    when_ready = replace(ONCE_PER_STEP, units="layer") if sharding else ONCE_PER_STEP
    after = replace(when_ready, reduce_after_step=True)
    lowered = lower(schedule, after, grid=grid, model=model)
    for program in lowered.programs:
        last_compute = max(i for i, a in enumerate(program) if isinstance(a, Compute))
        issues = [i for i, a in enumerate(program) if isinstance(a, Issue) and a.comm.kind in REDUCTIONS]
        assert issues and min(issues) > last_compute
    ready = simulate_lowered(lower(schedule, when_ready, grid=grid, model=model))
    assert simulate_lowered(lowered).iteration_time >= ready.iteration_time - 1e-9
