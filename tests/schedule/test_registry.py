"""Schedules defined outside the package join the registry, and leave it again (no state leaks)."""

from __future__ import annotations

import pytest

from zerobubble.schedule import (
    REGISTRY,
    CostModel,
    Placement,
    Schedule,
    ScheduleError,
    build_schedule,
    register_schedule,
    registered_schedule,
    simulate,
    unregister_schedule,
    validate_schedule,
)
from zerobubble.schedule.compare import compare_schedules
from zerobubble.schedule.ir import B, F, W
from zerobubble.schedule.modelplan import LayerProfile, ModelProfile, plan

NAME = "one-at-a-time"


def one_at_a_time(
    stages: int, microbatches: int, costs: CostModel, chunks: int = 1, w_last: bool = False
) -> Schedule:
    """One microbatch at a time through a loop pipeline, split backward (a user's own schedule)."""
    programs = []
    for rank in range(stages):
        ops = [op for j in range(microbatches) for op in (F(rank, j), B(rank, j), W(rank, j))]
        if w_last:
            ops = [op for op in ops if op.kind.value != "W"] + [W(rank, j) for j in range(microbatches)]
        programs.append(ops)
    return Schedule("anything", Placement.loop(stages), microbatches, programs)


def test_a_registered_builder_builds_validates_and_simulates():
    assert NAME not in REGISTRY
    with registered_schedule(NAME, one_at_a_time) as spec:
        assert REGISTRY[NAME] is spec and spec.summary.startswith("One microbatch at a time")
        schedule = build_schedule(NAME, 3, 4, CostModel(f=1, b=1, w=1))
        assert schedule.name == NAME  # the registry's name, whatever the builder called it
        timeline = validate_schedule(schedule, CostModel(f=1, b=1, w=1))
        assert simulate(schedule, CostModel(f=1, b=1, w=1)).makespan == timeline.makespan
        pipelined = simulate(build_schedule("1f1b", 3, 4), CostModel(f=1, b=1, w=1))
        assert timeline.makespan > pipelined.makespan  # microbatches never overlap
        assert build_schedule(NAME, 2, 3, w_last=True).programs[0][-1] == W(0, 2)  # options pass through
        rows = compare_schedules(3, 4, CostModel(), names=[NAME, "1f1b"])
        assert {row.schedule for row in rows} == {NAME, "1f1b"}
    assert NAME not in REGISTRY
    with pytest.raises(ScheduleError, match="unknown schedule"):
        build_schedule(NAME, 3, 4)


def test_the_model_level_planner_considers_a_registered_schedule():
    layers = tuple(LayerProfile(f"layer {i}", 1e-3, 1e-3, 1e-3) for i in range(4))
    with registered_schedule(NAME, one_at_a_time, "sequential"):
        result = plan(ModelProfile(layers), ranks=2, microbatches=4, schedules=[NAME, "1f1b"])
    assert {c.schedule for c in result.candidates} == {NAME, "1f1b"}
    assert result.winner.schedule == "1f1b"  # one at a time never overlaps ranks


def test_duplicate_and_built_in_names_raise_clear_errors():
    register_schedule(NAME, one_at_a_time)
    try:
        with pytest.raises(ScheduleError, match=f"{NAME!r} is already registered.*unregister_schedule"):
            register_schedule(NAME, one_at_a_time)
    finally:
        unregister_schedule(NAME)
    with pytest.raises(ScheduleError, match="'1f1b' is a built-in schedule"):
        register_schedule("1f1b", one_at_a_time)
    with pytest.raises(ScheduleError, match="built in"):
        unregister_schedule("gpipe")
    with pytest.raises(ScheduleError, match="not registered"):
        unregister_schedule(NAME)
    with pytest.raises(ScheduleError, match="callable"):
        register_schedule(NAME, "build")  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match="non-empty"):
        register_schedule(" ", one_at_a_time)
    assert NAME not in REGISTRY and "1f1b" in REGISTRY and "gpipe" in REGISTRY


def test_the_context_manager_unregisters_when_the_block_raises():
    with pytest.raises(RuntimeError), registered_schedule(NAME, one_at_a_time):
        raise RuntimeError("boom")
    assert NAME not in REGISTRY


def test_a_registered_spec_keeps_the_chunk_rule():
    with (
        registered_schedule(NAME, one_at_a_time, chunks=1),
        pytest.raises(ScheduleError, match="cannot take chunks=2"),
    ):
        build_schedule(NAME, 2, 2, chunks=2)
