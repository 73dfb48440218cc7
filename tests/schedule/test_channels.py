"""The per-channel message plan (schedule layer): which messages cross which channel, in which order.

A receiver posts its receives in the order its sender sends, both derived from the schedule alone;
a wrong plan shows in the runtime as a transfer that never completes.  Checked here without ranks.
"""

from __future__ import annotations

import pytest

from zerobubble.schedule import REGISTRY, Kind, build_schedule
from zerobubble.schedule.channels import (
    ACTIVATIONS,
    GRADIENTS,
    MessageKey,
    channel_messages,
    delivered_before,
    directed_pairs,
    received_message,
    receiving_stage,
    sending_stage,
    sent_message,
)

RUNTIME_SCHEDULES = [name for name in REGISTRY if name != "zb-ilp"]


def test_message_key_fields_and_words():
    key = MessageKey(GRADIENTS, 2, 5)
    assert (key.direction, key.boundary, key.microbatch) == (1, 2, 5)
    assert key == (1, 2, 5) and hash(key) == hash((1, 2, 5)), "interchangeable with the bare tuple"
    assert key.describe() == "grad 3->2 mb 5"
    assert MessageKey(ACTIVATIONS, 2, 5).describe() == "act 2->3 mb 5"
    assert receiving_stage(key) == 2 and receiving_stage(MessageKey(ACTIVATIONS, 2, 5)) == 3


def test_1f1b_on_two_ranks_by_hand():
    schedule = build_schedule("1f1b", 2, 3)
    assert directed_pairs(schedule) == [(0, 1), (1, 0)]
    assert channel_messages(schedule, 0, 1) == [(0, 0, 0), (0, 0, 1), (0, 0, 2)]
    assert channel_messages(schedule, 1, 0) == [(1, 0, 0), (1, 0, 1), (1, 0, 2)]


def test_ends_of_the_pipeline_send_nothing():
    schedule = build_schedule("zb-h1", 3, 3)
    last = schedule.num_stages - 1
    for program in schedule.programs:
        for op in program:
            key = sent_message(op, schedule.num_stages)
            if (
                op.kind is Kind.W
                or (op.kind is Kind.F and op.stage == last)
                or (op.stage == 0 and op.kind != Kind.F)
            ):
                assert key is None, op
            else:
                assert key is not None and key.microbatch == op.microbatch, op


@pytest.mark.parametrize("name", RUNTIME_SCHEDULES)
@pytest.mark.parametrize("ranks", [2, 4])
def test_every_cross_rank_message_on_exactly_one_channel_in_program_order(name, ranks):
    schedule = build_schedule(name, ranks, 2 * ranks)
    placement = schedule.placement
    pairs = directed_pairs(schedule)
    assert pairs == sorted(pairs) and all((dst, src) in pairs for src, dst in pairs), "both directions"
    # every message whose producer and consumer live on different ranks, as (src, dst) -> keys in order
    expected: dict[tuple[int, int], list[MessageKey]] = {}
    for src, program in enumerate(schedule.programs):
        for op in program:
            key = sent_message(op, schedule.num_stages)
            if key is not None and placement.rank_of(receiving_stage(key)) != src:
                expected.setdefault((src, placement.rank_of(receiving_stage(key))), []).append(key)
    assert sorted(expected) == pairs
    for src, dst in pairs:
        assert channel_messages(schedule, src, dst) == expected[src, dst]
    # each consumed message appears once: m activations and m gradients per cross-rank boundary
    boundaries = sum(placement.rank_of(s) != placement.rank_of(s + 1) for s in range(schedule.num_stages - 1))
    total = sum(len(keys) for keys in expected.values())
    assert total == 2 * boundaries * schedule.microbatches
    assert len({key for keys in expected.values() for key in keys}) == total


def test_1f1b_delivery_proofs_by_hand():
    """Rank 1 of 1F1B receives activation j in F1.j and sends gradient j in BW1.j right after."""
    schedule = build_schedule("1f1b", 2, 3)
    assert delivered_before(schedule, 0, 1) == {
        MessageKey(GRADIENTS, 0, j): [MessageKey(ACTIVATIONS, 0, j)] for j in range(3)
    }
    # rank 0 sends activations 0 and 1 (warm-up) before it receives gradient 0 in BW0.0
    assert delivered_before(schedule, 1, 0) == {
        MessageKey(ACTIVATIONS, 0, 0): [],
        MessageKey(ACTIVATIONS, 0, 1): [],
        MessageKey(ACTIVATIONS, 0, 2): [MessageKey(GRADIENTS, 0, 0)],
    }


def test_received_and_sending_stage_mirror_sent_and_receiving_stage():
    schedule = build_schedule("zb-v", 2, 4)
    for program in schedule.programs:
        for op in program:
            key = received_message(op, schedule.num_stages)
            if key is not None:
                assert receiving_stage(key) == op.stage and key.microbatch == op.microbatch
            sent = sent_message(op, schedule.num_stages)
            if sent is not None:
                assert sending_stage(sent) == op.stage


@pytest.mark.parametrize("name", RUNTIME_SCHEDULES)
@pytest.mark.parametrize("ranks", [2, 4])
def test_a_delivery_proof_lists_messages_the_peer_received_before_sending(name, ranks):
    """What :func:`delivered_before` lists for a message of ``dst`` are messages of ``src`` that
    ``dst``'s program waits for before it sends that message (at an earlier op, or at the start of
    the sending op itself), each listed once."""
    schedule = build_schedule(name, ranks, 2 * ranks)
    for src, dst in directed_pairs(schedule):
        proofs = delivered_before(schedule, src, dst)
        assert list(proofs) == channel_messages(schedule, dst, src)
        listed = [key for keys in proofs.values() for key in keys]
        assert len(listed) == len(set(listed)) and set(listed) <= set(channel_messages(schedule, src, dst))
        program = schedule.programs[dst]
        waits = {received_message(op, schedule.num_stages): i for i, op in enumerate(program)}
        sends = {sent_message(op, schedule.num_stages): i for i, op in enumerate(program)}
        for key, delivered in proofs.items():
            assert all(waits[earlier] <= sends[key] for earlier in delivered), (src, dst, key)
