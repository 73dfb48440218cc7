"""The model planner with a vocabulary-parallel output layer: it chooses between a plain last-stage
head and a vocabulary-parallel one from the profile, and says why."""

from __future__ import annotations

import pytest

from zerobubble.schedule import ScheduleError
from zerobubble.schedule.modelplan import LayerProfile, ModelProfile, plan


def _profile(head_work: float, *, blocks: int = 8) -> ModelProfile:
    layers = [
        LayerProfile(f"block{i}", 1.0, 1.0, 1.0, activation_bytes=10.0, parameter_bytes=5.0)
        for i in range(blocks)
    ]
    head = LayerProfile(
        "head", head_work, head_work, head_work, activation_bytes=40.0 * head_work, parameter_bytes=100.0
    )
    return ModelProfile(layers=(*layers, head))


@pytest.mark.parametrize(
    ("head_work", "blocks", "vocab_wins"),
    [(12.0, 8, True), (0.05, 7, False)],  # 7 blocks: the plain cut 2, 2, 2, 1 + a negligible head
)
def test_both_layouts_are_planned_and_the_faster_wins(head_work, blocks, vocab_wins):
    result = plan(_profile(head_work, blocks=blocks), 4, 8, schedules=["1f1b", "zb-h1"], head="both")
    layouts = {candidate.vocab_parallel for candidate in result.candidates}
    assert layouts == {True, False}
    assert result.winner.vocab_parallel is vocab_wins
    assert result.winner.built is not None and bool(result.winner.built.vocab_shards) is vocab_wins
    other = "plain" if vocab_wins else "vocabulary-parallel"
    assert f"ahead of the best {other} head" in result.reason
    plain = min(c.period for c in result.candidates if not c.vocab_parallel and c.period)
    vocab = min(c.period for c in result.candidates if c.vocab_parallel and c.period)
    assert (vocab < plain) is vocab_wins
    assert "+vocab" in result.table() and result.to_dict()["vocab_parallel"] is vocab_wins


def test_the_head_share_is_counted_on_every_rank():
    profile = _profile(12.0)
    vocab = plan(profile, 4, 8, schedules=["1f1b"], head="vocab-parallel")
    assert all(c.vocab_parallel for c in vocab.candidates)
    plain = plan(profile, 4, 8, schedules=["1f1b"], head="plain")
    # the plain head's 100 bytes of parameters sit on the last rank; vocabulary-parallel, 25 on each
    assert vocab.winner.peak_bytes[0] >= 25.0 and max(vocab.winner.peak_bytes) < max(plain.winner.peak_bytes)


def test_a_budget_that_only_the_vocab_parallel_head_fits():
    profile = _profile(12.0)
    plain = plan(profile, 4, 8, schedules=["1f1b"], head="plain")
    vocab = plan(profile, 4, 8, schedules=["1f1b"], head="vocab-parallel")
    budget = (max(plain.winner.peak_bytes) + max(vocab.winner.peak_bytes)) / 2
    assert plan(profile, 4, 8, budget, schedules=["1f1b"], head="both").winner.vocab_parallel
    with pytest.raises(ScheduleError, match="no schedule fits the memory budget"):
        plan(profile, 4, 8, budget, schedules=["1f1b"], head="plain")


def test_an_unknown_head_layout_is_refused():
    with pytest.raises(ScheduleError, match="unknown head layout 'sharded'"):
        plan(_profile(1.0), 2, 4, head="sharded")


def test_the_head_costs_are_the_measured_head_layers():
    """S and T are the profile's measured output layer cut in p shards: a head measured 40x slower
    makes S and T 40x longer and turns the plan from the plain head to the vocabulary-parallel one."""
    fast, slow = _profile(0.3, blocks=7), _profile(12.0, blocks=7)
    plans = {
        k: plan(prof, 4, 8, schedules=["1f1b"], head="both") for k, prof in (("fast", fast), ("slow", slow))
    }
    for name, profile in (("fast", fast), ("slow", slow)):
        head = profile.layers[-1]
        vocab = next(c for c in plans[name].candidates if c.vocab_parallel and c.timeline is not None)
        assert vocab.timeline is not None
        costs = vocab.timeline.costs
        assert costs.vocab_s == pytest.approx([(head.forward + head.backward_input) / 4] * 4)
        assert costs.vocab_t == pytest.approx([head.backward_weight / 4] * 4)
        assert "head measured: F+B" in plans[name].reason
    assert plans["fast"].winner.vocab_parallel is False and plans["slow"].winner.vocab_parallel is True
    assert (
        f"S {2 * 12.0 / 4 * 1e3:.3f} ms and T {12.0 / 4 * 1e3:.3f} ms per shard of 4" in plans["slow"].reason
    )
