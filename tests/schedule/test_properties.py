"""Property-based checks over every fast builder: random P, M, V and per-stage costs."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zerobubble.schedule import REGISTRY, CostModel, Schedule, ScheduleError, build_schedule, simulate
from zerobubble.schedule.compare import SLOW_SCHEDULES

FAST = [name for name in REGISTRY if name not in SLOW_SCHEDULES]


positive = st.floats(min_value=0.1, max_value=5.0, allow_nan=False)


@st.composite
def setups(draw):
    p = draw(st.integers(1, 6))
    m = draw(st.integers(1, 12))
    per_stage = draw(st.booleans())
    cost = (
        (lambda: draw(st.lists(positive, min_size=p, max_size=p))) if per_stage else (lambda: draw(positive))
    )
    costs = CostModel(
        f=cost(), b=cost(), w=cost(), comm=draw(st.floats(0, 1.0)), mem_b=1.0, mem_w=draw(st.floats(0, 1.0))
    )
    return p, m, costs


@pytest.mark.parametrize("name", FAST)
@given(setup=setups(), chunks=st.integers(1, 3))
def test_every_builder_validates_and_respects_the_ideal(name, setup, chunks):
    p, m, costs = setup
    spec = REGISTRY[name]
    take = chunks if spec.chunks is None else None
    try:
        schedule = build_schedule(name, p, m, costs, chunks=take)  # validates, memory included
    except ScheduleError as error:
        # the only refusal allowed here: interleaving needs m to be a multiple of p
        assert name == "interleaved-1f1b" and "multiple" in str(error)
        return
    timeline = simulate(schedule, costs)
    assert timeline.iteration_time >= timeline.ideal * (1 - 1e-9)
    assert timeline.makespan >= timeline.iteration_time * (1 - 1e-9)
    assert Schedule.from_json(schedule.to_json()) == schedule
