"""The shared planning core: every planner's plan is timed exactly as the simulator times it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerobubble.schedule.builders import planning, zb_auto, zb_v
from zerobubble.schedule.builders.planning import v_equalised, v_greedy, v_rounds
from zerobubble.schedule.builders.planning.v_equalised import EQUALISED_VARIANTS, equalised_plan
from zerobubble.schedule.costs import MEMORY_TOLERANCE, CostModel, within_limit
from zerobubble.schedule.ir import Placement, Schedule, ScheduleError
from zerobubble.schedule.simulate import simulate


def _check_exact(plan: planning.PlanState, costs, microbatches: int) -> None:
    schedule = Schedule("plan", costs.placement, microbatches, plan.programs_as_ops())
    timeline = simulate(schedule, costs)
    assert plan.iteration_time() == pytest.approx(timeline.iteration_time, rel=1e-12, abs=1e-12)
    assert plan.peak == pytest.approx(list(timeline.peak_memory), rel=1e-12, abs=1e-12)
    assert schedule.num_ops == 3 * costs.placement.num_stages * microbatches


@st.composite
def _costs(draw, placement_of):
    p = draw(st.integers(2, 6))
    m = draw(st.integers(1, 14))
    values = st.lists(st.floats(0.2, 3.0), min_size=p, max_size=p)
    costs = CostModel(
        f=draw(values),
        b=draw(values),
        w=draw(st.lists(st.floats(0.0, 3.0), min_size=p, max_size=p)),
        comm=draw(st.floats(0.0, 0.4)),
        mem_b=1.0,
        mem_w=draw(st.floats(0.0, 0.6)),
    )
    return p, m, costs.with_memory_limit(draw(st.floats(1.0, 2.0)) * p).resolve(placement_of(p))


@settings(max_examples=25, deadline=None)
@given(_costs(Placement.loop))
def test_zb_auto_planners_are_timed_exactly(problem):
    _, m, costs = problem
    for variant in zb_auto.ALL_VARIANTS:
        try:
            plan = variant.planner(costs, m).plan()
        except planning.Stuck:
            continue
        _check_exact(plan, costs, m)


@settings(max_examples=25, deadline=None)
@given(_costs(Placement.vshape))
def test_v_planners_are_timed_exactly(problem):
    _, m, costs = problem
    for policy in zb_v.ZB_V_POLICIES:
        plan = v_greedy._VGreedy(costs, m, policy).run()
        if plan is not None:
            _check_exact(plan, costs, m)
    for variant in zb_v.ZB_V_ROUND_VARIANTS:
        plan = v_rounds.RoundPlanner(costs, m, variant).run()
        if plan is not None:
            _check_exact(plan, costs, m)
    for variant in EQUALISED_VARIANTS:
        plan, _ = equalised_plan(costs, m, variant)
        if plan is not None:
            _check_exact(plan, costs, m)


def test_plan_state_refuses_an_op_whose_input_is_missing_or_that_overflows():
    costs = CostModel(memory_limit=1.0).resolve(Placement.loop(2))
    state = planning.PlanState(costs, 2)
    with pytest.raises(planning.Stuck):
        state.put_forward(1, 1, 0)  # F(0, 0) is not placed yet
    state.put_forward(0, 0, 0)
    with pytest.raises(planning.Stuck):
        state.put_forward(0, 0, 1)  # a second activation exceeds the limit of one
    with pytest.raises(planning.Stuck):
        state.put_weight(0)  # no B has run, so no W is pending


def test_one_memory_rule():
    assert within_limit(1.0, 1.0)
    assert within_limit(1.0 + MEMORY_TOLERANCE, 1.0)
    assert not within_limit(1.0 + 3 * MEMORY_TOLERANCE, 1.0)


@pytest.mark.parametrize("name, placement", [("zb-auto", Placement.loop(3)), ("zb-v", Placement.vshape(3))])
def test_one_microbatch_rule_names_the_rank_and_the_need(name, placement):
    costs = CostModel(mem_b=[1.0, 2.0, 1.0], mem_w=0.5, memory_limit=[4.0, 1.5, 4.0]).resolve(placement)
    with pytest.raises(ScheduleError, match=f"{name}: memory limit 1.5 on rank 1"):
        planning.check_one_microbatch_fits(costs, name)


def test_meta_schema_is_shared():
    from zerobubble.schedule.builders import build_schedule

    keys = {"memory_limit", "memory_limit_mb", "planner", "variant", "iteration_time", "candidates"}
    for name in ("zb-1p", "zb-auto", "zb-v", "v-half", "v-min"):
        meta = build_schedule(name, 4, 8, CostModel(mem_w=0.3)).meta
        assert keys <= set(meta), name
        assert isinstance(meta["memory_limit"], list) and len(meta["memory_limit"]) == 4, name


@settings(max_examples=20, deadline=None)
@given(_costs(Placement.loop), st.sampled_from([1, 2]))
def test_replay_times_fixed_programs_as_the_simulator(problem, depth):
    from zerobubble.schedule.builders.zb_handcrafted import rank_program

    p, m, costs = problem
    programs = [rank_program(rank, p, m, depth) for rank in range(p)]
    plan = planning.replay(costs, m, planning.as_plan_ops(programs))
    timeline = simulate(Schedule("h", costs.placement, m, programs), costs)
    if plan is None:  # only when the handcrafted order exceeds the limit
        assert any(peak > cap for peak, cap in zip(timeline.peak_memory, costs.memory_limit))
        return
    assert plan.programs_as_ops() == [list(program) for program in programs]
    _check_exact(plan, costs, m)


def test_replay_reports_a_deadlock_as_none():
    costs = CostModel().resolve(Placement.loop(2))
    stuck = [[(planning.BACKWARD, 0, 0), (planning.FORWARD, 0, 0), (planning.WEIGHT, 0, 0)], []]
    assert planning.replay(costs, 1, stuck) is None


@settings(max_examples=30, deadline=None)
@given(_costs(Placement.vshape))
def test_an_approval_pass_said_to_repeat_plans_the_same_ops(problem):
    """The equalised planner stops its approval passes when the next one would repeat the last
    (``repeats_with``): such a pass, run anyway, must plan exactly the same programs."""
    _, m, costs = problem
    for variant in EQUALISED_VARIANTS:
        approved = None
        for _ in range(4):
            attempt = v_equalised._EqualisedPass(costs, m, variant, approved)
            try:
                plan = attempt.run()
            except planning.Stuck:
                break
            if attempt.repeats_with(plan.idle):
                again = v_equalised._EqualisedPass(costs, m, variant, plan.idle).run()
                assert again.programs == plan.programs
            approved = plan.idle
