"""Issue 29's cost grid, its recorded baseline and ``bench schedulers --grid`` (tiny problems here;
``ZEROBUBBLE_TESTS=long`` also rebuilds every schedule of the recorded grid against its baseline)."""

import json
import statistics

import pytest

from zerobubble.schedule import REGISTRY
from zerobubble_bench.cost_grid import (
    BASELINE_PATH,
    DEFAULT_GRID,
    GRID_SCHEDULES,
    cost_grid,
    load_baseline,
    measure,
    record_baseline,
)
from zerobubble_bench.schedulers import scheduler_grid_times

TINY = {"stages": 4, "microbatches": 8, "count": 3, "seed": 3}


def test_the_grid_is_seeded_and_spans_the_issue_ranges():
    grid = cost_grid(stages=8, count=30, seed=1)
    assert [s.costs for s in grid] == [s.costs for s in cost_grid(stages=8, count=30, seed=1)]
    assert grid[0].costs != cost_grid(stages=8, count=1, seed=2)[0].costs
    for setting in grid:
        costs = setting.costs
        f, b, w = (statistics.mean(values) for values in (costs.f, costs.b, costs.w))
        assert all(700 <= value <= 1300 for value in costs.f)
        assert 0.8 * 0.7 / 1.3 <= b / f <= 1.5 * 1.3 / 0.7 and 0.3 * 0.7 / 1.3 <= w / f <= 1.2 * 1.3 / 0.7
        assert 0 <= costs.comm <= 100
        assert all(0 <= mw <= mb for mb, mw in zip(costs.mem_b, costs.mem_w))
        limit_factor = costs.memory_limit / (8 * statistics.mean(costs.mem_b))
        assert 1 - 1e-9 <= limit_factor <= 3 + 1e-9
        assert setting.costs_for("zb-1p").memory_limit is None and setting.costs_for("zb-v") == costs


@pytest.mark.slow
def test_grid_table_compares_with_the_recorded_baseline(tmp_path):
    path = tmp_path / "baseline.json"
    schedules = ("zb-1p", "v-half")
    record_baseline(path, TINY, schedules)
    grid, recorded = load_baseline(path)
    assert grid == TINY and [len(recorded[name]) for name in schedules] == [3, 3]
    table = scheduler_grid_times(
        stages=4, microbatches=8, settings=3, seed=3, rounds=1, schedules=schedules, baseline=path
    )
    assert [row[0] for row in table.rows] == list(schedules)
    assert all(row[-1] == "1.0000, 1.0000" for row in table.rows)
    # a baseline twice as fast shows as ratio 2 (and one for another grid shows no ratio at all)
    data = json.loads(path.read_text())
    data["iteration_time"] = {name: [t / 2 for t in times] for name, times in data["iteration_time"].items()}
    path.write_text(json.dumps(data))
    table = scheduler_grid_times(
        stages=4, microbatches=8, settings=3, seed=3, rounds=1, schedules=schedules, baseline=path
    )
    assert all(row[-1] == "2.0000, 2.0000" for row in table.rows)
    table = scheduler_grid_times(
        stages=4, microbatches=8, settings=3, seed=4, rounds=1, schedules=schedules, baseline=path
    )
    assert all(row[-1] == "–" for row in table.rows)


def test_the_recorded_baseline_covers_the_default_grid():
    grid, recorded = load_baseline(BASELINE_PATH)
    assert grid == DEFAULT_GRID
    assert set(recorded) == set(GRID_SCHEDULES) <= set(REGISTRY)
    assert all(len(times) == DEFAULT_GRID["count"] for times in recorded.values())


@pytest.mark.long
def test_no_schedule_is_slower_than_its_baseline_on_the_grid():
    grid, recorded = load_baseline(BASELINE_PATH)
    stages, microbatches = grid["stages"], grid["microbatches"]
    for setting in cost_grid(stages=stages, count=grid["count"], seed=grid["seed"]):
        for name, times in recorded.items():
            built = measure(setting, name, stages=stages, microbatches=microbatches)
            assert built.iteration_time <= times[setting.index] * (1 + 1e-9), (name, setting.label)
