"""Tensor parallelism inside a stage: ``Pipeline(..., mesh=mesh, parallelize=fn)`` on DTensor layers.

One spawn of 4 gloo ranks (pp 2 × tp 2) runs every schedule: gradients and the parameters after
clipped AdamW steps equal one process on the whole batch, and the parallelized Linear layers keep
their fast-path split (checked by the split guard, not fallen back).
"""

from __future__ import annotations

import pytest
from _dist import run_ranks
from _tp import pipeline_cases, split_cases

SCHEDULES = ["zb-h1", "zb-v", "1f1b", "dp:1f1b"]  # dp: pp 1 × dp 2 × tp 2, replicated tp stages


@pytest.fixture(scope="module")
def results():
    return run_ranks(pipeline_cases, 4, SCHEDULES, 3, 0.5)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gradients_and_clipped_adamw_steps_equal_one_process(results, schedule):
    for rank_results in results:
        case = rank_results[schedule]
        assert case["grads"] <= 1e-8, case  # float64: ~2e-12 measured
        assert case["params"] <= 1e-8, case  # ~7e-11 measured
        assert case["steps"] == 3 and case["clipped"] >= 1, case


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_parallelized_linears_keep_their_split(results, schedule):
    for rank_results in results:
        case = rank_results[schedule]
        assert case["dtensors"], "the blocks' q/k/v/o and fc1/fc2 are DTensors"
        paths = {path for _, kind, path, verified in case["report"] if verified}
        assert paths == {"fast path (MatmulRule)"}, case["report"]


@pytest.fixture(scope="module")
def split_results():
    return run_ranks(split_cases, 2)


PATHS = {
    "fast": ["fast path (LayerNormRule)", "fast path (MatmulRule)"],
    "generic": ["generic"],
    "routed": ["generic", "generic, routed, on the stage's graph"],
}


@pytest.mark.parametrize("kind", sorted(PATHS))
@pytest.mark.parametrize("first", [True, False], ids=["first-stage", "middle-stage"])
@pytest.mark.parametrize("defer", [True, False], ids=["B-then-W", "fused-BW"])
def test_the_split_of_a_tensor_parallel_block_is_exact(split_results, kind, first, defer):
    """Every path computes DTensor gradients with the parameters' placements, equal to plain
    autograd on the unparallelized block; B leaves every one to W; the strict guard agrees."""
    for rank_results in split_results:
        case = rank_results[(kind, first, defer)]
        assert case["paths"] == PATHS[kind]
        assert case["dtensors"] == 12  # q/k/v/o and fc1/fc2, weight and bias
        # float64; the key bias's gradient is zero in exact arithmetic (1e-10 is its rounding noise)
        assert case["grads"] <= 1e-8 and case["input"] <= 1e-8, case
        assert case["placements"] and case["verified"], case
        assert case["early"] == [], "a parameter got its gradient before W"
        assert case["hooks"] == 1.0, case


def test_the_optimizer_norm_counts_full_dtensor_gradients(split_results):
    for rank_results in split_results:
        error, nonfinite = rank_results["norm"]
        assert error <= 1e-12 and nonfinite == 0.0
        assert rank_results["nonfinite"] == 1.0  # an inf in one rank's shard shows on both
