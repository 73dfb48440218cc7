"""The V schedules against the authors' own schedulers on the paper's Table 5 setups.

The package ships them (:func:`zerobubble.schedule.paper.authors_reference`):
``data/authors_zbv_table5.json`` holds the iteration times of the authors' public ZB-V heuristic,
``data/authors_vhalf_vmin_table5.json`` those of their V-Half / V-Min orders timed by our simulator
(each file's ``source`` field says how they were made).  Ours must never be slower.
"""

from __future__ import annotations

import pytest
from _cost_strategies import per_stage_costs
from hypothesis import given, settings
from hypothesis import strategies as st

from zerobubble.schedule.builders import build_schedule
from zerobubble.schedule.builders.planning.v_equalised import EQUALISED_VARIANTS, equalised_plan
from zerobubble.schedule.ir import Placement
from zerobubble.schedule.paper import authors_reference, authors_reference_source, paper_rows
from zerobubble.schedule.simulate import simulate

ROWS = paper_rows()
EPS = 1e-9
AUTHORS_ZBV = authors_reference("zb-v")
AUTHORS_VHALF = authors_reference("v-half")
AUTHORS_VMIN = authors_reference("v-min")


def _row_id(row) -> str:
    return f"{row.model}-p{row.stages}-m{row.microbatches}"


def test_references_keep_their_provenance():
    for name in ("zb-v", "v-half", "v-min"):
        assert "sail-sg/zero-bubble-pipeline-parallelism" in authors_reference_source(name)


def test_references_cover_every_table5_row():
    keys = {(row.model, row.microbatches) for row in ROWS}
    assert keys == set(AUTHORS_ZBV) == set(AUTHORS_VHALF) == set(AUTHORS_VMIN)
    assert len(keys) == 12


@pytest.mark.parametrize("row", ROWS, ids=[_row_id(row) for row in ROWS])
def test_zb_v_at_least_as_fast_as_the_authors(row):
    p, m, costs = row.stages, row.microbatches, row.costs
    schedule = build_schedule("zb-v", p, m, costs)  # validated under p·M_B
    timeline = simulate(schedule, costs)
    assert timeline.iteration_time <= AUTHORS_ZBV[(row.model, m)] * (1 + EPS)
    assert max(timeline.peak_memory_mb) <= p * (1 + EPS)
    assert schedule.meta["iteration_time"] == pytest.approx(timeline.iteration_time, rel=1e-12)


@pytest.mark.parametrize("row", ROWS, ids=[_row_id(row) for row in ROWS])
@pytest.mark.parametrize("name", ["v-half", "v-min"])
def test_v_half_and_v_min_at_least_as_fast_as_the_authors(row, name):
    p, m, costs = row.stages, row.microbatches, row.costs
    cap = (p + 2) // 2 if name == "v-half" else (p + 4) // 3
    reference = (AUTHORS_VHALF if name == "v-half" else AUTHORS_VMIN)[(row.model, m)]
    schedule = build_schedule(name, p, m, costs)
    timeline = simulate(schedule, costs)
    assert timeline.iteration_time <= reference * (1 + EPS)
    assert max(timeline.peak_memory_mb) <= cap * (1 + EPS)


@pytest.mark.parametrize("p", [4, 8, 16])
@pytest.mark.parametrize("m_per_p", [2, 4])
def test_v_half_and_v_min_closed_forms_with_equal_costs(p, m_per_p):
    """Equal F/B/W costs, no transfer time (the papers' setting): V-Half holds ⌊(p+2)/2⌋·M_B with at
    most half of 1F1B's bubble, V-Min ⌊(p+4)/3⌋·M_B with at most two thirds, at every m (the
    authors' orders give 0.28-0.48 and 0.61-0.66 of it)."""
    m = m_per_p * p
    baseline = simulate(build_schedule("1f1b", p, m))
    baseline_bubble = baseline.iteration_time - baseline.ideal
    for name, cap, share in (("v-half", (p + 2) // 2, 0.5), ("v-min", (p + 4) // 3, 2 / 3)):
        timeline = simulate(build_schedule(name, p, m))
        assert max(timeline.peak_memory_mb) <= cap * (1 + EPS), name
        assert timeline.iteration_time - timeline.ideal <= share * baseline_bubble * (1 + EPS), name


# Rows where ours is strictly faster than the authors' V-Min order (iteration time ours / theirs):
# 1.5B m24 0.9940 (the paced greedy, replayed, then one local move), 1.5B m64 0.9903 (a building
# block, then local moves).  The margin locks the gain in; elsewhere ours ties.
STRICTLY_FASTER = {("v-min", "1.5B", 24): 0.997, ("v-min", "1.5B", 64): 0.995}


@pytest.mark.parametrize("key", sorted(STRICTLY_FASTER), ids=lambda key: "-".join(map(str, key)))
def test_v_min_strictly_faster_than_the_authors_on_named_rows(key):
    name, model, m = key
    row = next(row for row in ROWS if row.model == model and row.microbatches == m)
    schedule = build_schedule(name, row.stages, m, row.costs)  # validated under its cap
    timeline = simulate(schedule, row.costs)
    assert timeline.iteration_time <= AUTHORS_VMIN[(model, m)] * STRICTLY_FASTER[key]


@settings(max_examples=6, deadline=None)
@given(
    p=st.integers(2, 5),
    per_rank=st.integers(2, 3),
    data=st.data(),
)
def test_zb_v_never_loses_to_the_authors_heuristic(p, per_rank, data):
    """The authors' ZB-V heuristic (zbv.py, best of its four fill variants) is our equalised planner
    (it reproduces their Table 5 times exactly); zb-v runs it among its candidates."""
    model = data.draw(per_stage_costs(p))
    m = per_rank * p
    resolved = model.with_memory_limit(float(p)).resolve(Placement.vshape(p))
    plans = [equalised_plan(resolved, m, variant)[0] for variant in EQUALISED_VARIANTS]
    theirs = min(plan.iteration_time() for plan in plans if plan is not None)
    ours = simulate(build_schedule("zb-v", p, m, model), model).iteration_time
    assert ours <= theirs * (1 + 1e-9)
