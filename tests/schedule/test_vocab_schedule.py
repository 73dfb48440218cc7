"""The vocabulary-parallel output layer in the schedule layer: S and T ops in the IR, their placement
into every registry schedule, the simulator's and validator's view of them, and the head's costs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerobubble.schedule import (
    REGISTRY,
    CostModel,
    Kind,
    Op,
    Schedule,
    ScheduleError,
    ValidationError,
    build_schedule,
    simulate,
    validate_schedule,
)
from zerobubble.schedule.builders import get_spec
from zerobubble.schedule.vocab import RESERVED_MICROBATCHES, add_vocab_ops, head_costs, vocab_budgets

SCHEDULES = [name for name in REGISTRY if name != "zb-ilp"]  # dualpipe-v's pairs included


def _vocab_costs(s: float = 0.8, t: float = 0.4, comm: float = 0.1, mem: float = 0.3) -> CostModel:
    return CostModel(f=1.0, b=1.0, w=1.0, comm=0.05, vocab_s=s, vocab_t=t, vocab_comm=comm, vocab_mem=mem)


def test_vocab_ops_parse_and_print():
    assert Op.parse("S2.7") == Op(Kind.S, 2, 7) and str(Op(Kind.T, 1, 3)) == "T1.3"
    assert Op(Kind.S, 0, 0).is_vocab and not Op(Kind.F, 0, 0).is_vocab


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(SCHEDULES),
    p=st.integers(2, 4),
    m=st.integers(1, 9),
    s=st.floats(0.0, 3.0),
    t=st.floats(0.0, 2.0),
    comm=st.floats(0.0, 1.0),
)
def test_every_schedule_gets_valid_vocab_ops(name, p, m, s, t, comm):
    """Any registry schedule, any vocabulary costs: every shard's S and T of every microbatch on its
    rank, S in microbatch order, the base program kept as it was, and the result valid."""
    costs = _vocab_costs(s, t, comm)
    try:
        plain = build_schedule(name, p, m, costs)
    except ScheduleError:
        return  # the builder refuses this (p, m) without vocabulary ops too
    schedule = build_schedule(name, p, m, costs, vocab_parallel=True)
    validate_schedule(schedule, costs.with_memory_limit(None))
    assert schedule.vocab_shards == p
    for rank, program in enumerate(schedule.programs):
        shards = [op for op in program if op.is_vocab]
        assert {op.stage for op in shards} == {rank}
        assert [op.microbatch for op in shards if op.kind is Kind.S] == list(range(m))
        assert sorted(op.microbatch for op in shards if op.kind is Kind.T) == list(range(m))
    spec = get_spec(name)
    base_costs = vocab_budgets(spec.resolve_costs(costs, p), p, budget_given=False)[0]
    held_less = schedule.meta["vocab"].get("base_held_less", 0.0)
    if held_less:  # built under less memory, to leave room for a deeper warm-up
        limits = base_costs.memory_limit
        limits = limits if isinstance(limits, tuple) else (limits,) * p
        base_costs = base_costs.with_memory_limit(tuple(x - held_less for x in limits))
    base = spec.load()(p, m, base_costs, spec.resolve_chunks(None), **spec.options)
    for rank in range(p):  # the base program's ops, each stage's in order (forwards may run ahead)
        for kind in (Kind.F, Kind.B, Kind.W, Kind.BW):
            for stage in schedule.placement.stages_of(rank):
                ours = [op for op in schedule.programs[rank] if op.kind is kind and op.stage == stage]
                assert ours == [op for op in base.programs[rank] if op.kind is kind and op.stage == stage]
        ours = [op for op in schedule.programs[rank] if not op.is_vocab and op.kind is not Kind.F]
        assert ours == [op for op in base.programs[rank] if op.kind is not Kind.F]
    assert plain.num_ops + 2 * p * m == schedule.num_ops


def test_simulator_counts_vocab_time_memory_and_dependencies():
    costs = _vocab_costs(s=2.0, t=1.0, comm=0.5, mem=4.0)
    schedule = build_schedule("1f1b", 2, 3, costs, vocab_parallel=True)
    timeline = simulate(schedule, costs)
    assert timeline.ideal == pytest.approx(3 * (1 + 1 + 1 + 2 + 1))  # F + B + W per microbatch, S + T
    times = {op: (start, end) for rank, op, start, end in timeline.events()}
    last = schedule.num_stages - 1
    for j in range(3):
        f_end = times[Op(Kind.F, last, j)][1]
        assert times[Op(Kind.S, 0, j)][0] >= f_end + 0.5 - 1e-12  # the broadcast to rank 0
        assert times[Op(Kind.S, 1, j)][0] >= f_end - 1e-12  # the last stage's own rank: no wait
        reduced = max(times[Op(Kind.S, r, j)][1] for r in range(2)) + 0.5
        assert times[Op(Kind.BW, last, j)][0] >= reduced - 1e-12
        assert min(times[Op(Kind.T, r, j)][0] for r in range(2)) >= reduced - 1e-12
    assert max(timeline.peak_memory) >= 1 + 4.0


def _with(schedule: Schedule, rank: int, program: list[Op]) -> Schedule:
    programs = [list(p) for p in schedule.programs]
    programs[rank] = program
    return Schedule(schedule.name, schedule.placement, schedule.microbatches, programs)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda prog: [op for op in prog if op != Op(Kind.T, 0, 1)], "T0.1 is missing"),
        (lambda prog: [Op(Kind.S, 1, 0) if op == Op(Kind.S, 0, 0) else op for op in prog], "shard 1"),
        (lambda prog: _swap(prog, Op(Kind.S, 0, 0), Op(Kind.S, 0, 1)), "microbatch order"),
        (lambda prog: _swap(prog, Op(Kind.S, 0, 0), Op(Kind.T, 0, 0)), "depends on|deadlock|order"),
    ],
)
def test_validator_names_bad_vocab_ops(edit, message):
    costs = _vocab_costs()
    schedule = build_schedule("zb-h1", 2, 3, costs, vocab_parallel=True)
    with pytest.raises(ValidationError, match=message):
        validate_schedule(_with(schedule, 0, edit(list(schedule.programs[0]))), costs)


def _swap(program: list[Op], a: Op, b: Op) -> list[Op]:
    i, k = program.index(a), program.index(b)
    program[i], program[k] = program[k], program[i]
    return program


def test_add_vocab_ops_refuses_a_schedule_that_has_them():
    schedule = build_schedule("1f1b", 2, 2, _vocab_costs(), vocab_parallel=True)
    with pytest.raises(ScheduleError, match="already has vocabulary ops"):
        add_vocab_ops(schedule, _vocab_costs())


def test_budgets_reserve_the_vocab_memory():
    costs = _vocab_costs(mem=2.0).with_memory_limit(10.0)
    base, final = vocab_budgets(costs, 2, budget_given=True)
    assert base.memory_limit == (10.0 - RESERVED_MICROBATCHES * 2.0,) * 2 and final.memory_limit == 10.0
    base, final = vocab_budgets(costs, 2, budget_given=False)
    assert base.memory_limit == 10.0 and final.memory_limit == (10.0 + RESERVED_MICROBATCHES * 2.0,) * 2
    with pytest.raises(ScheduleError, match="leaves nothing for the pipeline"):
        vocab_budgets(_vocab_costs(mem=6.0).with_memory_limit(10.0), 2, budget_given=True)
    # a user's budget holds the whole schedule, vocabulary memory included
    user = _vocab_costs(mem=0.5).replace(mem_b=1.0, mem_w=0.5).with_memory_limit(6.0)
    schedule = build_schedule("zb-auto", 4, 8, user, vocab_parallel=True)
    assert max(simulate(schedule, user).peak_memory) <= 6.0 + 1e-9


def test_head_costs_follow_the_flop_counts():
    costs = head_costs(hidden=8, vocab=10, tokens=3, shards=4)
    assert (costs.plain_f, costs.plain_b, costs.plain_w) == (2 * 3 * 8 * 10,) * 3
    assert costs.vocab_s == 4 * 3 * 8 * 3 and costs.vocab_t == 2 * 3 * 8 * 3  # ceil(10 / 4) = 3 rows
    assert costs.plain_mem == 3 * 10 * 4 and costs.vocab_mem == 3 * 3 * 4 + 3 * 8 * 2
    plain = costs.plain(CostModel(), 4)
    assert plain.f == (1.0, 1.0, 1.0, 1.0 + 480.0)
    with pytest.raises(ScheduleError, match="cannot be cut into 4 shards"):
        head_costs(hidden=8, vocab=3, tokens=3, shards=4)


def test_a_large_head_pipelines_faster_vocab_parallel():
    """A head of three layers' work: vocabulary-parallel beats the head on the last stage."""
    head = head_costs(hidden=64, vocab=9216, tokens=128, shards=4, flops_per_time_unit=128 * 24 * 64 * 64)
    base = CostModel(f=1.0, b=1.0, w=1.0)
    for name in ("1f1b", "zb-h1", "zb-v"):
        vocab = head.vocab(base, comm=0.05)
        fast = simulate(build_schedule(name, 4, 8, vocab, vocab_parallel=True), vocab).iteration_time
        plain_costs = head.plain(base, 4)
        slow = simulate(build_schedule(name, 4, 8, plain_costs), plain_costs).iteration_time
        assert fast < 0.8 * slow, (name, fast, slow)


def test_pictures_show_the_vocab_ops_and_torch_export_refuses_them(tmp_path):
    from zerobubble.schedule.export import to_torch_csv
    from zerobubble.schedule.render import render_image, render_text

    costs = _vocab_costs()
    schedule = build_schedule("zb-v", 2, 4, costs, vocab_parallel=True)
    timeline = simulate(schedule, costs)
    text = render_text(timeline)
    assert "S vocab shard" in text and "T vocab shard" in text
    rows = [line for line in text.splitlines() if line.startswith("rank")]
    assert all("S" in row and "T" in row for row in rows)
    render_image(timeline, tmp_path / "vocab.svg")
    assert "vocab shard" in (tmp_path / "vocab.svg").read_text()
    with pytest.raises(ScheduleError, match="no action for"):
        to_torch_csv(schedule)


def test_polish_refuses_vocab_ops_but_runs_before_they_are_placed():
    pytest.importorskip("ortools")
    from zerobubble.schedule import polish_schedule

    costs = _vocab_costs()
    schedule = build_schedule("zb-h1", 2, 4, costs, vocab_parallel=True)
    with pytest.raises(ScheduleError, match="polish the schedule before placing them"):
        polish_schedule(schedule, costs, seconds=1.0)
    polished = build_schedule("zb-h1", 2, 4, costs, vocab_parallel=True, polish_seconds=1.0)
    assert polished.vocab_shards == 2
