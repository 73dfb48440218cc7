"""Optimizer post-validation across spawned gloo ranks (zerobubble.runtime.optim.PostValidator).

Every rank holds a contiguous slice of a small model's parameters and its own optimizer over
them; every rank also runs the synchronous single-process reference (clip_grad_norm_ over all
parameters + step, no step when a gradient is non-finite) on the whole model, so it can compare
its slice after every step.  One spawn per world size runs all cases.
"""

from __future__ import annotations

import pytest
from _post_validation import COLLECTIVES, OPTIMIZERS, STEPS, TOLERANCE, expected_counters, rank_worker
from _profile import TWO_AND_FOUR_RANKS

from zerobubble.runtime.launch import launch

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module", params=TWO_AND_FOUR_RANKS, ids=["2-ranks", "4-ranks"])
def outcomes(request):
    world = request.param
    chain = list(range(world)) if world == 2 else list(reversed(range(world)))  # 4 ranks: last rank first
    return world, launch(rank_worker, world, (chain,), threads=1, timeout=120)


@pytest.mark.parametrize("case", [*OPTIMIZERS, "adamw-synchronous"])
def test_every_step_equals_the_synchronous_reference(outcomes, case):
    _, per_rank = outcomes
    for rank, results in enumerate(per_rank):
        assert results[case]["worst"] <= TOLERANCE, (
            f"rank {rank}: relative error {results[case]['worst']:.3g}"
        )


@pytest.mark.parametrize("case", [*OPTIMIZERS, "adamw-synchronous"])
def test_rollbacks_deferrals_and_skips_happen_exactly_where_needed(outcomes, case):
    world, per_rank = outcomes
    for results in per_rank:
        result = results[case]
        position = world - 1 if case == "adamw-synchronous" else result["position"]
        expected = expected_counters(position, world, reversible=case != "rmsprop-fallback")
        assert result["counters"] == {"steps": STEPS, **expected}


def test_post_validation_uses_point_to_point_only(outcomes):
    _, per_rank = outcomes
    for results in per_rank:
        for case in OPTIMIZERS:
            calls = results[case]["calls"]
            assert not set(calls) & set(COLLECTIVES), calls
            assert calls.get("isend", 0) > 0 and calls.get("irecv", 0) > 0
        assert results["adamw-synchronous"]["calls"] == {"all_reduce": STEPS}
