"""Tests of dualpipe-v and of the overlapped F&B pair it is built from.

Expectations come from the authors, not from the code: DualPipeV needs m ≥ 2p (deepseek-ai/DualPipe's
``dualpipev.py`` and torch's ``ScheduleDualPipeV`` refuse fewer); its bubble is at most
(PP/2 − 1)(F&B + B − 3W) with PP = 2p stages and F, B (full backward), W, F&B per chunk (the
README's bubble table); and with expert all-to-all as long as the compute (DeepSeek-V3 reports
about 1:1) the pairs hide it, so an iteration takes less than zb-v's, which cannot hide it.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerobubble.schedule import CostModel, Schedule, ScheduleError, build_schedule, simulate
from zerobubble.schedule.grid import Grid
from zerobubble.schedule.ir import BW, F, Kind
from zerobubble.schedule.lowering import lower, simulate_lowered, validate_lowered
from zerobubble.schedule.render import render_text
from zerobubble.schedule.validate import ValidationError, validate_schedule
from zerobubble.schedule.vocab import work_bound

EPS = 1e-9
cost = st.floats(0.2, 3.0)


@st.composite
def shapes(draw, max_ranks: int = 8):
    p = draw(st.integers(1, max_ranks))
    return p, 2 * p + draw(st.integers(0, 3 * p + 4))


def published_bound(costs: CostModel) -> float:
    """(PP/2 − 1)(F&B + B − 3W) per chunk: F = f/2, B = (b + w)/2, W = w/2, F&B = F + B (no
    all-to-all to hide, so the pair's time is its halves' sum) and PP/2 = p."""
    f, b, w = (float(getattr(costs, name)) / 2 for name in "fbw")
    return (f + b + w) + (b + w) - 3 * w


@settings(max_examples=40, deadline=None)
@given(shape=shapes(), f=cost, b=cost, w=cost, hop=st.floats(0, 0.5), a2a=st.floats(0, 3.0))
def test_dualpipe_v_validates_with_pairs_over_shapes_and_costs(shape, f, b, w, hop, a2a):
    p, m = shape
    costs = CostModel(f=f, b=b, w=w, comm=hop, a2a=a2a)
    schedule = build_schedule("dualpipe-v", p, m, costs)  # validated
    assert schedule.placement == build_schedule("zb-v", p, m).placement  # the V
    assert schedule.overlapped and all(first.kind is Kind.F for first, _ in schedule.overlapped)
    timeline = simulate(schedule, costs)
    assert timeline.iteration_time >= timeline.ideal * (1 - EPS)
    assert simulate(schedule, costs, cores=max(1, p - 1)).iteration_time >= timeline.iteration_time * (
        1 - EPS
    )
    assert Schedule.from_json(schedule.to_json()) == schedule


@settings(max_examples=40, deadline=None)
@given(shape=shapes(), unit=cost)
def test_bubble_is_within_the_published_bound_at_unit_costs(shape, unit):
    # the bound is the authors' for F = B = W (docs/schedulers.md: other ratios can exceed it)
    p, m = shape
    costs = CostModel(f=unit, b=unit, w=unit)
    timeline = simulate(build_schedule("dualpipe-v", p, m, costs), costs)
    bubble = timeline.iteration_time - timeline.ideal
    assert bubble <= (p - 1) * published_bound(costs) + EPS * timeline.ideal


@pytest.mark.parametrize("p", [2, 4, 8])
def test_unit_cost_bubble_reaches_the_bound_and_beats_1f1b(p):
    m = 3 * p
    dual = simulate(build_schedule("dualpipe-v", p, m))
    one_f_one_b = simulate(build_schedule("1f1b", p, m))
    assert dual.iteration_time - dual.ideal == pytest.approx((p - 1) * published_bound(CostModel()))
    # 1F1B's (PP − 1)(F + B) on p ranks of one stage each: (p − 1)(1 + 2)
    assert one_f_one_b.iteration_time - one_f_one_b.ideal == pytest.approx((p - 1) * 3)


@settings(max_examples=15, deadline=None)
@given(shape=shapes(max_ranks=6), compute=st.floats(0.5, 2.0), ratio=st.floats(0.8, 1.25))
def test_pairs_hide_all_to_all_that_zb_v_cannot(shape, compute, ratio):
    p, m = shape
    m = max(m, 3 * p)  # a steady state of pairs
    costs = CostModel(f=compute, b=compute, w=compute, a2a=compute * ratio)
    dual = simulate(build_schedule("dualpipe-v", p, m, costs), costs)
    zb_v = simulate(build_schedule("zb-v", p, m, costs), costs)
    assert dual.iteration_time < zb_v.iteration_time


def test_too_few_microbatches_is_a_clear_error():
    with pytest.raises(ScheduleError, match=r"at least 2·ranks = 8 microbatches"):
        build_schedule("dualpipe-v", 4, 7)


def _with(schedule: Schedule, programs=None, overlapped=None) -> Schedule:
    return Schedule(
        schedule.name,
        schedule.placement,
        schedule.microbatches,
        programs if programs is not None else schedule.programs,
        schedule.meta,
        schedule.overlapped if overlapped is None else overlapped,
    )


def test_mutations_are_caught():
    schedule = build_schedule("dualpipe-v", 3, 8)
    forward, backward = schedule.overlapped[0]
    rank = schedule.placement.rank_of(forward.stage)
    program = list(schedule.programs[rank])
    i = program.index(forward)
    swapped = [*program[:i], program[i + 1], program[i], *program[i + 2 :]]
    programs = [swapped if r == rank else list(p) for r, p in enumerate(schedule.programs)]
    with pytest.raises(ValidationError, match="adjacent"):  # the backward now comes first
        validate_schedule(_with(schedule, programs))
    with pytest.raises(ValidationError, match="F and then a B or BW"):
        validate_schedule(_with(schedule, overlapped=[(backward, forward), *schedule.overlapped[1:]]))
    twice = [*schedule.overlapped, (schedule.overlapped[1][0], schedule.overlapped[0][1])]
    with pytest.raises(ValidationError):
        validate_schedule(_with(schedule, overlapped=twice))
    programs = schedule.programs
    dropped = [p if r != rank else [op for op in p if op != backward] for r, p in enumerate(programs)]
    with pytest.raises(ValidationError):
        validate_schedule(_with(schedule, dropped))
    with pytest.raises(ScheduleError, match="cannot read overlapped pair"):
        Schedule.from_dict({**schedule.to_dict(), "overlapped": ["F0.1 BW5.0"]})


def test_a_pair_whose_backward_needs_its_forward_is_refused():
    schedule = build_schedule("1f1b", 1, 2)  # F0.0 BW0.0 F0.1 BW0.1 on one rank
    paired = _with(schedule, overlapped=[(F(0, 0), BW(0, 0))])
    with pytest.raises(ValidationError, match=r"needs F0\.0"):
        validate_schedule(paired)


def test_pairs_time_as_one_slot():
    costs = CostModel(f=1.0, b=1.0, w=1.0, a2a=0.5)
    schedule = build_schedule("dualpipe-v", 2, 6, costs)
    timeline = simulate(schedule, costs)
    resolved = timeline.costs
    for forward, backward in schedule.overlapped:
        rank = schedule.placement.rank_of(forward.stage)
        i = schedule.programs[rank].index(forward)
        start, end = timeline.start[rank][i], timeline.end[rank][i]
        assert (start, end) == (timeline.start[rank][i + 1], timeline.end[rank][i + 1])
        # halves per chunk: F 0.5 + 0.25 all-to-all, BW 1.0 + 0.25: compute 1.5 against 0.5
        assert end - start == pytest.approx(resolved.pair_duration(forward, backward)) == pytest.approx(1.5)
    busy = sum(end - start for end, start in zip(timeline.end[0], timeline.start[0]))
    assert timeline.busy[0] < busy  # a pair's span counted once


def test_lowered_on_an_ep_grid_pairs_hide_the_all_to_all():
    p, m = 4, 12
    costs = CostModel(f=1.0, b=1.0, w=1.0, a2a=1.0)
    grid = Grid.of_mesh(("pp", "ep"), (p, 8))
    assert grid.ep == 8
    spans = {}
    for name in ("dualpipe-v", "zb-v"):
        lowered = lower(build_schedule(name, p, m, costs), grid=grid)
        validate_lowered(lowered)
        text = lowered.format_programs()
        assert "issue all_to_all(F" in text and "wait all_to_all(B" in text
        timeline = simulate_lowered(lowered, costs)
        spans[name] = timeline.makespan
        exposed = sum(rank_exposed["ep"] for rank_exposed in timeline.exposed)
        if name == "dualpipe-v":
            hidden_plain = simulate_lowered(lower(build_schedule(name, p, m, costs)), costs).makespan
            assert timeline.makespan < hidden_plain  # without an ep grid the all-to-all is compute
        else:
            assert exposed == pytest.approx(2 * m * 2 * 1.0 / 2 * p)  # zb-v: every all-to-all waited out
    assert spans["dualpipe-v"] < spans["zb-v"]


def test_picture_draws_pairs():
    schedule = build_schedule("dualpipe-v", 2, 4)
    text = render_text(simulate(schedule), width=120)
    assert "&" in text and "overlapped F&B pair" in text
    assert "F0.2&BW3.0" in schedule.format_programs() or "&" in schedule.format_programs()


@settings(max_examples=12, deadline=None)
@given(
    p=st.integers(1, 3),
    extra=st.integers(0, 4),
    s=st.floats(0.05, 2.0),
    t=st.floats(0.05, 2.0),
    a2a=st.sampled_from([0.0, 0.5, 1.0]),
)
def test_a_vocabulary_parallel_head_goes_into_dualpipe_v_with_its_pairs_kept(p, extra, s, t, a2a):
    """The S and T ops are placed around the pairs: every pair of the plain build is still a pair of
    adjacent ops, the schedule validates (built with validate=True), every rank runs its S and T of
    every microbatch, and without all-to-all (nothing for a pair to hide) the iteration is no shorter
    than the busiest rank's work."""
    m = 2 * p + extra
    costs = CostModel(vocab_s=s, vocab_t=t, vocab_comm=0.05, vocab_mem=0.2, a2a=a2a)
    plain = build_schedule("dualpipe-v", p, m, costs)
    placed = build_schedule("dualpipe-v", p, m, costs, vocab_parallel=True)
    assert set(placed.overlapped) == set(plain.overlapped)
    placed.pair_starts()  # raises unless every pair is two adjacent ops of one rank
    for kind in (Kind.S, Kind.T):
        assert all(sum(op.kind is kind for op in program) == m for program in placed.programs)
    if a2a == 0:
        assert simulate(placed, costs).iteration_time >= work_bound("dualpipe-v", p, m, costs) - 1e-9


def test_with_the_all_to_all_dualpipe_v_keeps_its_lead_over_zb_v_with_a_vocabulary_parallel_head():
    """At DeepSeek-V3's all-to-all (as long as the compute) the pairs hide it with the head's S and T
    placed around them: p = 4, m = 16, S = 1, T = ½."""
    costs = CostModel(vocab_s=1.0, vocab_t=0.5, vocab_comm=0.05, vocab_mem=0.2, a2a=1.0)
    times = {
        name: simulate(build_schedule(name, 4, 16, costs, vocab_parallel=True), costs).iteration_time
        for name in ("dualpipe-v", "zb-v")
    }
    assert times["dualpipe-v"] < 0.9 * times["zb-v"], times
