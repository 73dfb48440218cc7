"""The validator rejects each kind of broken schedule with a message naming rank, op and reason."""

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from zerobubble.schedule import (
    BW,
    B,
    CostModel,
    F,
    Placement,
    Schedule,
    ValidationError,
    W,
    build_schedule,
    validate_schedule,
)
from zerobubble.schedule.ir import Kind, dependencies


def two_rank(programs, microbatches=1):
    return Schedule("hand", Placement.loop(2), microbatches, programs)


GOOD = [[F(0, 0), B(0, 0), W(0, 0)], [F(1, 0), B(1, 0), W(1, 0)]]


def test_good_schedule_passes():
    timeline = validate_schedule(two_rank(GOOD))
    assert timeline.makespan == pytest.approx(5)


def test_missing_op():
    broken = [GOOD[0][:2], GOOD[1]]
    with pytest.raises(ValidationError, match=r"rank 0: W0\.0 is missing") as error:
        validate_schedule(two_rank(broken))
    assert error.value.rank == 0 and error.value.op == W(0, 0)


def test_duplicated_op():
    broken = [GOOD[0] + [W(0, 0)], GOOD[1]]
    with pytest.raises(ValidationError, match=r"rank 0: W0\.0 appears 2 times"):
        validate_schedule(two_rank(broken))


def test_op_on_wrong_rank():
    broken = [[F(0, 0), B(0, 0), W(0, 0), F(1, 0)], [B(1, 0), W(1, 0)]]
    with pytest.raises(ValidationError, match=r"rank 0: F1\.0 is of stage 1, which rank 1 holds"):
        validate_schedule(two_rank(broken))


def test_op_outside_microbatches():
    broken = [GOOD[0] + [F(0, 1)], GOOD[1]]
    with pytest.raises(ValidationError, match=r"rank 0: F0\.1 names microbatch 1"):
        validate_schedule(two_rank(broken))


def test_w_before_its_b():
    broken = [[F(0, 0), W(0, 0), B(0, 0)], GOOD[1]]
    with pytest.raises(ValidationError, match=r"rank 0: W0\.0 \(position 1\) comes before B0\.0"):
        validate_schedule(two_rank(broken))


def test_b_before_its_f():
    broken = [GOOD[0], [B(1, 0), F(1, 0), W(1, 0)]]
    with pytest.raises(ValidationError, match=r"rank 1: B1\.0 \(position 0\) comes before F1\.0"):
        validate_schedule(two_rank(broken))


def test_mixed_fused_and_split_backward_is_rejected():
    broken = [[F(0, 0), BW(0, 0), B(0, 0), W(0, 0)], GOOD[1]]
    with pytest.raises(ValidationError, match="both a fused BW and a split B/W"):
        validate_schedule(two_rank(broken))


def test_cross_rank_deadlock_reports_the_cycle():
    # rank 0 runs microbatch 1's backward before microbatch 0's forward reaches rank 1
    programs = [
        [F(0, 1), BW(0, 1), F(0, 0), BW(0, 0)],
        [F(1, 0), BW(1, 0), F(1, 1), BW(1, 1)],
    ]
    with pytest.raises(ValidationError, match="deadlock") as error:
        validate_schedule(two_rank(programs, microbatches=2))
    message = str(error.value)
    assert "rank 0 at BW0.1 waits for BW1.1 (rank 1)" in message
    assert "rank 1 at F1.0 waits for F0.0 (rank 0)" in message


def test_memory_above_limit():
    costs = CostModel(mem_b=1.0, memory_limit=2.0)
    schedule = build_schedule("gpipe", 2, 3)
    with pytest.raises(
        ValidationError, match=r"rank 0: activation memory reaches 3 after F0\.2, above the limit 2"
    ):
        validate_schedule(schedule, costs)


def test_memory_within_limit_passes():
    costs = CostModel(mem_b=1.0, memory_limit=2.0)
    validate_schedule(build_schedule("1f1b", 2, 6), costs)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["1f1b", "zb-h1", "zb-v", "v-half", "interleaved-1f1b"]),
    p=st.integers(2, 5),
    data=st.data(),
)
def test_an_op_moved_before_its_own_dependency_is_named(name, p, data):
    """The order check runs only when the simulation deadlocks (validate.py); an op moved ahead of
    an op it depends on, on the same rank, must still be reported as exactly that."""
    schedule = build_schedule(name, p, 2 * p)
    rank = data.draw(st.integers(0, p - 1))
    program = list(schedule.programs[rank])
    later = data.draw(st.integers(1, len(program) - 1))
    op = program[later]
    needs = {(role, stage, mb) for role, stage, mb in dependencies(op, schedule.num_stages)}
    earlier = [
        i
        for i, other in enumerate(program[:later])
        if (other.kind if other.kind is not Kind.BW else Kind.B, other.stage, other.microbatch) in needs
    ]
    assume(earlier)
    position = data.draw(st.sampled_from(earlier))
    program.insert(position, program.pop(later))  # ahead of the op it depends on
    programs = [program if r == rank else list(prog) for r, prog in enumerate(schedule.programs)]
    broken = Schedule(schedule.name, schedule.placement, schedule.microbatches, programs)
    with pytest.raises(ValidationError, match=rf"rank {rank}: {op} \(position {position}\) comes before"):
        validate_schedule(broken)
