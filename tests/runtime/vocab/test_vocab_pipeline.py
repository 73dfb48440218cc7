"""The vocabulary-parallel head and embedding on spawned gloo ranks: loss and gradients equal the
unsharded model's in float64 on every schedule, tied or not, with soft-capping and ignored labels, over
several steps; bad labels and tokens raise on every rank and leave the pipeline usable."""

from __future__ import annotations

import pytest
from _dist import RUNTIME_SCHEDULES, run_ranks
from _vocab_models import auto_cases as _auto_cases
from _vocab_models import checkpoint_cases as _checkpoint_cases
from _vocab_models import feature_cases as _feature_cases
from _vocab_models import vocab_cases

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-10

TWO_RANKS = [
    # every schedule, dualpipe-v's overlapped pairs with the S and T ops placed around them included
    *({"schedule": name, "microbatches": 4, "vocab": 13, "steps": 2} for name in RUNTIME_SCHEDULES),
    {
        "schedule": "zb-v",
        "microbatches": 4,
        "vocab": 13,
        "tied": True,
        "softcap": 2.0,
        "ignored": 0.3,
        "steps": 2,
    },
    {"schedule": "zb-h1", "microbatches": 3, "vocab": 2, "tied": True, "steps": 1},  # one row per shard
    {"error": "label", "vocab": 13},
    {"error": "token", "vocab": 13},
    {"error": "sizes", "vocab": 1},
]
FOUR_RANKS = [
    {"schedule": name, "microbatches": 8, "vocab": 23, "blocks": 8, "steps": 2}
    for name in ("1f1b", "zb-h1", "zb-2p", "zb-v", "v-half", "dualpipe-v")
] + [
    {
        "schedule": "zb-v",
        "microbatches": 5,
        "vocab": 10,
        "blocks": 8,
        "tied": True,
        "ignored": 0.4,
        "steps": 1,
    },
]


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(vocab_cases, 2, TWO_RANKS)


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(vocab_cases, 4, FOUR_RANKS)


@pytest.mark.parametrize("index", range(len(TWO_RANKS) - 3), ids=lambda i: str(TWO_RANKS[i].get("schedule")))
def test_two_ranks_match_the_unsharded_model(two_ranks, index):
    for rank, results in enumerate(two_ranks):
        assert results[index]["loss"] <= TOLERANCE and results[index]["grads"] <= TOLERANCE, (
            rank,
            results[index],
        )


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(FOUR_RANKS)), ids=lambda i: FOUR_RANKS[i]["schedule"])
def test_four_ranks_match_the_unsharded_model(four_ranks, index):
    for rank, results in enumerate(four_ranks):
        assert results[index]["loss"] <= TOLERANCE and results[index]["grads"] <= TOLERANCE, (
            rank,
            results[index],
        )


def _messages(two_ranks, kind: str) -> list[str]:
    index = next(i for i, case in enumerate(TWO_RANKS) if case.get("error") == kind)
    return [results[index]["error"] for results in two_ranks]


def test_a_bad_label_raises_on_every_rank_and_the_pipeline_goes_on(two_ranks):
    messages = _messages(two_ranks, "label")
    assert all("16" in m and "13" in m and m.endswith("the next step ran") for m in messages), messages


def test_a_bad_token_raises_on_every_rank_and_the_pipeline_goes_on(two_ranks):
    messages = _messages(two_ranks, "token")
    assert all("-1" in m and "13" in m and m.endswith("the next step ran") for m in messages), messages


def test_a_vocabulary_smaller_than_the_ranks_is_refused_naming_the_sizes(two_ranks):
    messages = _messages(two_ranks, "sizes")
    assert all("vocabulary of 1" in m and "2 shards" in m for m in messages), messages


@pytest.mark.parametrize("tied", [False, True])
def test_checkpoints_hold_each_ranks_rows_of_the_vocabulary_weights(tied):
    per_rank = run_ranks(_checkpoint_cases, 2, [{"schedule": "zb-h1", "tied": tied}])
    for rank, results in enumerate(per_rank):
        assert max(results[0]["errors"]) <= TOLERANCE, (rank, results)
    # every rank holds both weights as (11, 6) DTensor shards whose data are its own rows
    for results in per_rank:
        assert results[0]["keys"] == ["vocab_embedding.weight", "vocab_head.weight"], results
        assert results[0]["shapes"] == [(11, 6)] and results[0]["own rows"], results


AUTO = [{"vocab": 4000, "blocks": 4}, {"vocab": 4000, "blocks": 4, "budget": "vocab only"}]


@pytest.fixture(scope="module")
def planned():
    return run_ranks(_auto_cases, 2, AUTO)


def test_auto_weighs_both_layouts_and_runs_the_winner_exactly(planned):
    for results in planned:
        first, budgeted = results
        assert "ahead of the best" in first["reason"] or "+vocab" in first["reason"], first
        for result in results:
            assert result["grads"] <= TOLERANCE, result
            assert result["loss"] is None or result["loss"] <= TOLERANCE, result
        # under a budget only its smaller peak fits, the vocabulary-parallel layout runs
        assert budgeted["budget"] is not None and budgeted["vocab_parallel"], budgeted
    assert any(results[0]["loss"] is not None for results in planned)


def test_trace_dynamic_shapes_and_outputs_work_with_the_vocab_layers():
    cases = [{"trace": True}, {"static_shapes": False}]
    per_rank = run_ranks(_feature_cases, 2, cases)
    for rank, results in enumerate(per_rank):
        for result in results:
            assert result["loss"] is None or result["loss"] <= TOLERANCE, (rank, result)
    traced = per_rank[0][0]  # the measured timelines and the report are rank 0's
    assert {"S", "T"} <= set(traced["recorded"]) and traced["report"], traced
    last = per_rank[1]  # zb-h1: the last stage on rank 1 returns its hidden states
    assert all(result["outputs"] == [4, 5, 6] for result in last), last
