"""polish_schedule: CP-SAT reorders a built schedule's last ops, never for the worse.

The properties hold for any schedule and costs (hypothesis draws them, fractional per-stage costs
included, which take the rounded-scale path): the result is valid, no slower, no hungrier on any
rank, runs the same ops, and its report says what happened.  Two exact answers pin the solver's
model down: a small V-Half whose optimum is known, and zb-ilp's proven optimum, which no polish may
beat (were the two integer models to disagree, one of them would be wrong).
"""

from __future__ import annotations

import json
import math
import sys

import pytest
from _cost_strategies import per_stage_costs
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from zerobubble.cli import main
from zerobubble.schedule import (
    CostModel,
    ScheduleError,
    build_schedule,
    get_spec,
    polish_schedule,
    simulate,
    solver_available,
    validate_schedule,
)
from zerobubble.schedule.paper import authors_reference, paper_setup

pytestmark = pytest.mark.skipif(not solver_available(), reason="OR-tools is not installed")

INTEGRAL = CostModel(f=10, b=11, w=7, comm=1, mem_b=4, mem_w=2)
EPS = 1e-9


def polished_and_original(name, stages, microbatches, costs, **polish):
    planned = get_spec(name).resolve_costs(costs, stages)
    original = build_schedule(name, stages, microbatches, costs)
    return polish_schedule(original, planned, **polish), original, planned


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(["1f1b", "zb-h1", "zb-1p", "zb-v", "v-half", "v-min"]),
    stages=st.integers(2, 3),
    microbatches=st.integers(2, 6),
    window=st.integers(1, 12),
    data=st.data(),
)
def test_a_polish_is_valid_never_slower_and_never_hungrier(name, stages, microbatches, window, data):
    costs = data.draw(st.one_of(per_stage_costs(stages), st.just(INTEGRAL)))
    try:
        polished, original, planned = polished_and_original(
            name, stages, microbatches, costs, seconds=1.0, window=window
        )
    except ScheduleError:  # a setup the builder cannot take (e.g. V shapes with too few microbatches)
        assume(False)
    report = polished.meta["polish"]
    event(f"kept: {report['kept']}, status: {report['status']}")
    before, after = simulate(original, planned), validate_schedule(polished, planned)
    assert report["before"] == pytest.approx(before.iteration_time)
    assert report["after"] == pytest.approx(after.iteration_time)
    assert after.iteration_time <= before.iteration_time + EPS
    assert report["kept"] == (after.iteration_time < before.iteration_time)
    assert all(new <= old + EPS for new, old in zip(after.peak_memory, before.peak_memory))
    for new, old in zip(polished.programs, original.programs):
        assert sorted(map(str, new)) == sorted(map(str, old))  # the same ops, only reordered
        assert new[:1] == old[:1]  # a rank's first op anchors its span and is never moved
    if not report["kept"]:
        assert polished.programs == original.programs


def test_a_small_v_half_is_polished_to_its_proven_optimum():
    polished, original, _ = polished_and_original("v-half", 3, 6, INTEGRAL, seconds=60.0)
    report = polished.meta["polish"]
    assert simulate(original, INTEGRAL).iteration_time == 213.5
    assert report["status"] == "OPTIMAL" and report["kept"]
    assert report["after"] == 211.5 == polished.meta["iteration_time"]
    # it frees all it can: every op that starts once each rank has started (a rank's first op never)
    timeline = simulate(original, INTEGRAL)
    last_first = max(starts[0] for starts in timeline.start)
    movable = sum(start > last_first for starts in timeline.start for start in starts)
    assert report["freed_ops"] == movable and report["rounds"] == 1


@pytest.mark.parametrize(("stages", "microbatches", "limit"), [(2, 4, 2.0), (3, 5, 3.0)])
def test_no_polish_beats_the_integer_programs_proven_optimum(stages, microbatches, limit):
    costs = CostModel(f=[1.0, 1.2, 0.9][:stages], b=1.1, w=0.6, comm=0.05, mem_b=1.0, mem_w=0.3)
    costs = costs.with_memory_limit(limit)
    optimum = build_schedule("zb-ilp", stages, microbatches, costs, time_limit=60)
    assert optimum.meta["optimal"]
    best = simulate(optimum, costs).iteration_time
    again = polish_schedule(optimum, costs, seconds=20.0)
    assert not again.meta["polish"]["kept"]
    for name in ("1f1b", "zb-h1", "zb-1p"):
        polished = polish_schedule(build_schedule(name, stages, microbatches, costs), costs, seconds=20.0)
        assert validate_schedule(polished, costs).iteration_time >= best - EPS


def test_build_schedule_polishes_when_asked_and_validates_the_result():
    schedule = build_schedule("v-min", 3, 6, INTEGRAL, polish_seconds=30.0)
    report = schedule.meta["polish"]
    assert report["rounds"] >= 1 and report["after"] <= report["before"]
    assert validate_schedule(schedule, INTEGRAL).iteration_time == pytest.approx(report["after"])
    assert "polish" not in build_schedule("v-min", 3, 6, INTEGRAL).meta


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"seconds": 0}, "seconds must be a positive"),
        ({"seconds": math.nan}, "seconds must be a positive"),
        ({"seconds": math.inf}, "finite"),
        ({"seconds": True}, "seconds must be a positive"),
        ({"seconds": 1, "window": 0}, "window must be a positive integer"),
        ({"seconds": 1, "window": 2.5}, "window must be a positive integer"),
        ({"seconds": 1, "workers": 0}, "workers must be a positive integer"),
    ],
)
def test_bad_polish_arguments_are_rejected_with_the_reason(options, message):
    schedule = build_schedule("zb-h1", 2, 4)
    with pytest.raises(ScheduleError, match=message):
        polish_schedule(schedule, **options)


def test_without_ortools_the_error_says_what_to_install(monkeypatch, capsys):
    for module in ("ortools", "ortools.sat", "ortools.sat.python", "ortools.sat.python.cp_model"):
        monkeypatch.setitem(sys.modules, module, None)  # None in sys.modules makes the import fail
    assert not solver_available()
    with pytest.raises(ScheduleError, match=r"pip install 'zerobubble\[solver\]'"):
        polish_schedule(build_schedule("zb-h1", 2, 4), seconds=1.0)
    assert main(["simulate", "--schedule", "zb-h1", "-p", "2", "-m", "4", "--polish", "1"]) == 2
    assert "zerobubble[solver]" in capsys.readouterr().err
    # a comparison says it once and stops, instead of one failed row per schedule
    assert main(["compare", "-p", "2", "-m", "4", "--polish", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("zerobubble[solver]") == 1


def test_the_cli_polishes_and_reports_it(capsys):
    setup = ["-p", "3", "-m", "6", "--cost", "10,11,7,1", "--memory", "4,2", "--polish", "30", "--json"]
    assert main(["simulate", "--schedule", "v-half", *setup]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["polish"]["kept"] and report["iteration_time"] == 211.5
    assert main(["compare", "--schedules", "1f1b,v-half", *setup]) == 0
    rows = {row["schedule"]: row for row in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["v-half"]["polished"] and rows["v-half"]["iteration_time"] == 211.5
    assert rows["v-half"]["speedup_vs_1f1b"] == pytest.approx(234 / 211.5)  # against the plain 1F1B


@pytest.mark.slow
@pytest.mark.parametrize(("name", "model", "microbatches"), [("v-half", "1.5B", 24), ("v-min", "6.2B", 32)])
def test_polished_v_schedules_beat_the_authors_orders_where_ours_tie(name, model, microbatches):
    """On these Table 5 rows our search ties the authors' published order; the polish goes below it
    (`zerobubble bench schedulers --table5 --polish 10` prints every row)."""
    setup = paper_setup(model, microbatches)
    theirs = authors_reference(name)[(model, microbatches)]
    built = build_schedule(name, setup.stages, microbatches, setup.costs)
    assert simulate(built, setup.costs).iteration_time == pytest.approx(theirs, rel=1e-9)
    polished = polish_schedule(built, setup.costs, seconds=15.0)
    assert validate_schedule(polished, setup.costs).iteration_time < theirs * (1 - 1e-4)
