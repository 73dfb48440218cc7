"""The V schedules against the authors' own schedulers on the paper's Table 5 setups.

The package ships them (:func:`zerobubble.schedule.paper.authors_reference`):
``data/authors_zbv_table5.json`` holds the iteration times of the authors' public ZB-V heuristic,
``data/authors_vhalf_vmin_table5.json`` those of their V-Half / V-Min orders timed by our simulator
(each file's ``source`` field says how they were made).  Ours must never be slower.
"""

from __future__ import annotations

import pytest

from zerobubble.schedule.builders import build_schedule
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
