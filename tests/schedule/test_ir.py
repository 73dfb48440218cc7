"""The IR: ops, placements, schedules and their JSON form."""

import pytest

from zerobubble.schedule import BW, B, F, Kind, Op, Placement, Schedule, ScheduleError, W, build_schedule


def test_op_string_round_trip():
    for op in (F(0, 3), B(12, 0), W(1, 255), BW(7, 7)):
        assert Op.parse(str(op)) == op
    assert str(F(0, 3)) == "F0.3"
    assert str(BW(2, 5)) == "BW2.5"


def test_op_parse_rejects_garbage():
    with pytest.raises(ScheduleError, match="cannot read op"):
        Op.parse("X1.2")


def test_loop_and_vshape_placements():
    loop = Placement.loop(4, 2)
    assert loop.stage_ranks == (0, 1, 2, 3, 0, 1, 2, 3)
    assert loop.stages_of(1) == (1, 5)
    assert loop.chunks == 2
    v = Placement.vshape(4)
    assert v.stage_ranks == (0, 1, 2, 3, 3, 2, 1, 0)
    assert v.stages_of(0) == (0, 7)
    assert v.chunk_index(7) == 1


def test_placement_rejects_uneven_mapping():
    with pytest.raises(ScheduleError, match="same number of stages"):
        Placement.explicit([0, 0, 1])
    with pytest.raises(ScheduleError, match="outside"):
        Placement((0, 5), 2)


def test_schedule_needs_one_program_per_rank():
    with pytest.raises(ScheduleError, match="one program per rank"):
        Schedule("x", Placement.loop(2), 1, [[F(0, 0), BW(0, 0)]])


@pytest.mark.parametrize("name,chunks", [("gpipe", None), ("1f1b", None), ("interleaved-1f1b", 3)])
def test_json_round_trip_is_lossless(name, chunks):
    schedule = build_schedule(name, 3, 6, chunks=chunks)
    again = Schedule.from_json(schedule.to_json())
    assert again == schedule
    assert again.placement.style == schedule.placement.style


def test_json_errors_are_clear():
    with pytest.raises(ScheduleError, match="not valid JSON"):
        Schedule.from_json("{")
    with pytest.raises(ScheduleError, match="lacks the field"):
        Schedule.from_json('{"name": "x"}')


def test_kind_and_schedule_properties():
    schedule = build_schedule("1f1b", 2, 2)
    assert schedule.num_ops == 8
    assert not schedule.splits_backward
    assert Kind("BW") is Kind.BW
    assert "rank 1:" in schedule.format_programs()
