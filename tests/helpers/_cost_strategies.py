"""Hypothesis strategies shared by the tests comparing our schedulers with the authors' heuristics."""

from __future__ import annotations

from hypothesis import strategies as st

from zerobubble.schedule.costs import CostModel


@st.composite
def per_stage_costs(draw: st.DrawFn, stages: int) -> CostModel:
    """A cost model of ``stages`` stages: per-stage F in 0.8–1.2, B in 0.8–1.3, W in 0.3–1.0,
    T_comm up to 0.1, M_B = 1 and M_W in 0–0.6."""

    def each(low: float, high: float) -> list[float]:
        return draw(st.lists(st.floats(low, high), min_size=stages, max_size=stages))

    f, b, w = each(0.8, 1.2), each(0.8, 1.3), each(0.3, 1.0)
    comm, mem_w = draw(st.floats(0.0, 0.1)), draw(st.floats(0.0, 0.6))
    return CostModel(f=f, b=b, w=w, comm=comm, mem_b=1.0, mem_w=mem_w)
