"""The validator of lowered programs catches each kind of broken lowering, naming rank and reason."""

from dataclasses import replace

import pytest
from _lowering import built, stage_bytes
from hypothesis import given, settings

from zerobubble.schedule import CostModel, build_schedule
from zerobubble.schedule.grid import Grid
from zerobubble.schedule.lowering import (
    CommKind,
    Issue,
    LoweringError,
    Wait,
    lower,
    validate_lowered,
)
from zerobubble.schedule.sharding import FSDPOptions
from zerobubble.schedule.vocab import add_vocab_ops

KEPT = {"reshard_after_forward": False, "reshard_after_backward": False}

VOCAB_COSTS = CostModel(vocab_s=0.5, vocab_t=0.5, vocab_mem=0.1)


def fsdp(name="zb-h1", p=3, m=4, **choices):
    schedule = build_schedule(name, p, m)
    options = FSDPOptions(units="layer", **(KEPT | choices))
    return lower(schedule, options, grid=Grid(dp=2, sharding="fsdp"), model=stage_bytes(schedule, 3))


def with_program(lowered, rank, program):
    programs = list(lowered.programs)
    programs[rank] = tuple(program)
    return replace(lowered, programs=tuple(programs))


def drop(lowered, rank, predicate):
    program = list(lowered.programs[rank])
    index = next(i for i, action in enumerate(program) if predicate(action))
    return with_program(lowered, rank, program[:index] + program[index + 1 :])


def test_a_dropped_unshard_wait_is_a_read_before_the_wait():
    lowered = fsdp()
    broken = drop(lowered, 1, lambda a: isinstance(a, Wait) and a.comm.kind is CommKind.UNSHARD)
    with pytest.raises(
        LoweringError, match=r"rank 1 .*(before its unshard is waited for|never waited)"
    ) as caught:
        validate_lowered(broken)
    assert caught.value.rank == 1


def test_a_dropped_unshard_is_a_read_while_resharded():
    lowered = fsdp(reshard_after_forward=True)
    unshards = [
        i
        for i, a in enumerate(lowered.programs[0])
        if isinstance(a, (Issue, Wait)) and a.comm.kind is CommKind.UNSHARD and a.comm.round == 1
    ]
    program = [a for i, a in enumerate(lowered.programs[0]) if i not in unshards[:2]]
    with pytest.raises(LoweringError, match=r"rank 0 at .*reads unit .* while it is resharded"):
        validate_lowered(with_program(lowered, 0, program))


def test_a_dropped_reduction_is_caught():
    lowered = fsdp()
    broken = drop(lowered, 2, lambda a: isinstance(a, Issue) and a.comm.kind is CommKind.REDUCE_SCATTER)
    with pytest.raises(LoweringError, match=r"rank 2.*(reduced 0 times|before issuing)"):
        validate_lowered(broken)


def test_a_reduction_without_its_wait_is_caught():
    lowered = fsdp()
    broken = drop(lowered, 0, lambda a: isinstance(a, Wait) and a.comm.kind is CommKind.REDUCE_SCATTER)
    with pytest.raises(LoweringError, match=r"rank 0.*never waited for"):
        validate_lowered(broken)


def test_a_reduction_issued_twice_or_too_early_is_caught():
    lowered = fsdp()
    program = list(lowered.programs[0])
    at = next(
        i for i, a in enumerate(program) if isinstance(a, Issue) and a.comm.kind is CommKind.REDUCE_SCATTER
    )
    early = program[at]
    moved = [early, *program[:at], *program[at + 1 :]]
    with pytest.raises(LoweringError, match="before its last gradient part"):
        validate_lowered(with_program(lowered, 0, moved))


def test_replicas_issuing_their_collectives_in_two_orders_are_caught():
    lowered = fsdp()
    program = list(lowered.programs[1])
    gathers = [i for i, a in enumerate(program) if isinstance(a, Issue) and a.comm.kind is CommKind.UNSHARD]
    a, b = gathers[0], gathers[1]
    program[a], program[b] = program[b], program[a]
    mismatched = replace(lowered, replica_programs={(1, 1): tuple(program)})
    with pytest.raises(
        LoweringError, match=r"rank 1 \(replica 1\): collective 0 on the dp communicator"
    ) as caught:
        validate_lowered(mismatched)
    assert caught.value.rank == 1


def test_ranks_issuing_the_output_layers_reductions_in_two_orders_are_caught():
    schedule = add_vocab_ops(build_schedule("1f1b", 2, 4, VOCAB_COSTS), VOCAB_COSTS)
    lowered = lower(schedule)
    validate_lowered(lowered)
    program = list(lowered.programs[0])
    reductions = [
        i for i, a in enumerate(program) if isinstance(a, Issue) and a.comm.kind is CommKind.VOCAB_REDUCE
    ]
    a, b = reductions[0], reductions[1]
    program[a], program[b] = program[b], program[a]
    with pytest.raises(LoweringError, match="vocab-reduce communicator"):
        validate_lowered(with_program(lowered, 0, program))


def test_a_missing_receive_wait_is_caught_before_the_consumer_runs():
    lowered = lower(build_schedule("1f1b", 2, 3))
    broken = drop(lowered, 1, lambda a: isinstance(a, Wait) and a.comm.kind is CommKind.RECV)
    with pytest.raises(LoweringError, match=r"rank 1 at F1\.0: runs before recv\(act 0->1 mb 0\)"):
        validate_lowered(broken)


def test_receives_posted_out_of_the_senders_order_are_caught():
    lowered = lower(build_schedule("gpipe", 2, 3))
    program = list(lowered.programs[1])
    posts = [i for i, a in enumerate(program) if isinstance(a, Issue) and a.comm.kind is CommKind.RECV]
    program[posts[0]], program[posts[1]] = program[posts[1]], program[posts[0]]
    with pytest.raises(LoweringError, match="FIFO"):
        validate_lowered(with_program(lowered, 1, program))


def test_a_wait_on_a_send_never_issued_deadlocks_and_is_reported():
    lowered = lower(build_schedule("1f1b", 2, 2))
    broken = drop(lowered, 0, lambda a: isinstance(a, Issue) and a.comm.kind is CommKind.SEND)
    with pytest.raises(LoweringError, match="rank 0"):
        validate_lowered(broken)  # rank 0 waits for a send it never issued


@settings(max_examples=25, deadline=None)
@given(setup=built())
def test_dropping_any_wait_is_caught(setup):
    schedule, _ = setup
    lowered = lower(
        schedule,
        FSDPOptions(units="layer", **KEPT),
        grid=Grid(dp=2, sharding="fsdp"),
        model=stage_bytes(schedule),
    )
    rank = max(range(schedule.num_ranks), key=lambda r: len(lowered.programs[r]))
    waits = [i for i, a in enumerate(lowered.programs[rank]) if isinstance(a, Wait)]
    index = waits[len(waits) // 2]
    program = list(lowered.programs[rank])
    del program[index]
    with pytest.raises(LoweringError) as caught:
        validate_lowered(with_program(lowered, rank, program))
    assert caught.value.rank == rank
