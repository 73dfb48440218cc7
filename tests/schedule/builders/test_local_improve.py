"""The refinements of a search's candidates: exact times for paced plans, the local improvement pass.

Expectations come from the simulator and the validator (what the schedule really does), never from
the pass's own bookkeeping.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerobubble.schedule.builders import build_schedule
from zerobubble.schedule.builders.planning import WEIGHT, as_plan_ops, replay
from zerobubble.schedule.builders.planning.local_improve import improve_programs, improve_schedule, retimed
from zerobubble.schedule.builders.planning.v_greedy import v_candidates
from zerobubble.schedule.builders.planning.v_pattern import squeezed_programs
from zerobubble.schedule.builders.v_memory import MEMORY_POLICIES, min_memory_microbatches
from zerobubble.schedule.costs import CostModel, within_limit
from zerobubble.schedule.ir import Placement, Schedule
from zerobubble.schedule.simulate import simulate
from zerobubble.schedule.validate import validate_schedule


def _weights_last(programs):
    """Every rank's W ops moved after its last F and B (a valid, wasteful order)."""
    return [
        [op for op in program if op[0] != WEIGHT] + [op for op in program if op[0] == WEIGHT]
        for program in programs
    ]


def test_the_pass_fills_idle_gaps_with_deferred_w_ops():
    p, m = 4, 8
    costs = CostModel(f=1.0, b=1.0, w=1.0, comm=0.1)
    resolved = costs.resolve(Placement.vshape(p))
    programs = _weights_last(as_plan_ops(build_schedule("zb-v", p, m, costs).programs))
    before = replay(resolved, m, programs)
    assert before is not None
    improved = improve_programs(resolved, m, programs, budget=10**6)
    assert improved is not None and improved.moves > 0
    schedule = Schedule("improved", resolved.placement, m, improved.state.programs_as_ops())
    timeline = validate_schedule(schedule, resolved)
    assert timeline.iteration_time == pytest.approx(improved.iteration_time, rel=1e-12)
    assert timeline.iteration_time < before.iteration_time() * (1 - 1e-6)


@st.composite
def _v_min_problem(draw):
    p = draw(st.integers(2, 5))
    m = draw(st.integers(2 * p, 3 * p))
    values = st.lists(st.floats(0.5, 2.0), min_size=2 * p, max_size=2 * p)
    costs = CostModel(
        f=draw(values),
        b=draw(values),
        w=draw(st.lists(st.floats(0.1, 1.5), min_size=2 * p, max_size=2 * p)),
        comm=draw(st.floats(0.0, 0.2)),
        mem_b=1.0,
        mem_w=draw(st.floats(0.0, 0.6)),
    )
    return p, m, costs


@settings(max_examples=8, deadline=None)
@given(_v_min_problem())
def test_the_pass_never_slows_a_schedule_and_keeps_its_memory_limit(problem):
    p, m, costs = problem
    limit = float(min_memory_microbatches(p))  # V-Min's cap: M_B = 1 per rank, half on each chunk
    planned = costs.with_memory_limit(limit).resolve(Placement.vshape(p))
    pattern = squeezed_programs("v-min", p, m)
    before = replay(planned, m, pattern)
    improved = improve_programs(planned, m, pattern, budget=20_000)
    if before is None:  # the pattern does not fit these per-stage costs' memory: nothing to improve
        assert improved is None
        return
    assert improved is not None
    schedule = Schedule("improved", planned.placement, m, improved.state.programs_as_ops())
    timeline = validate_schedule(schedule, planned)  # dependencies, every op once, the memory limit
    assert timeline.iteration_time == pytest.approx(improved.iteration_time, rel=1e-12)
    assert timeline.iteration_time <= before.iteration_time() * (1 + 1e-12)
    assert all(within_limit(peak, limit) for peak in timeline.peak_memory)


def test_large_schedules_are_left_as_they_are():
    costs = CostModel(f=1.0, b=1.0, w=0.5, comm=0.05)
    schedule = build_schedule("zb-v", 4, 16, costs)
    resolved = costs.with_memory_limit(schedule.meta["memory_limit"]).resolve(schedule.placement)
    assert improve_schedule(schedule, resolved, max_ops=schedule.num_ops - 1) is schedule


def test_a_paced_plan_is_ranked_by_its_replayed_time():
    """A pacing policy holds ops back: its plan's time is an upper bound, the replay's is exact."""
    p, m = 8, 24
    costs = CostModel(f=1.0, b=1.0, w=0.5, comm=0.03).with_memory_limit(float(min_memory_microbatches(p)))
    resolved = costs.resolve(Placement.vshape(p))
    paced = next(policy for policy in MEMORY_POLICIES if policy.pace)
    (candidate,) = v_candidates(resolved, m, (paced,))
    raw = candidate.run(math.inf)
    exact = retimed(candidate, resolved, m).run(math.inf)
    assert raw is not None and exact is not None and exact.exact
    timeline = simulate(Schedule("paced", resolved.placement, m, exact.programs()), resolved)
    assert exact.iteration_time == pytest.approx(timeline.iteration_time, rel=1e-12)
    assert not raw.exact  # the pacing held ops back, so its own time is only an upper bound
    assert exact.iteration_time < raw.iteration_time * (1 - 1e-9)
