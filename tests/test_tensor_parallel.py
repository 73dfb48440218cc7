"""Tensor parallelism inside a stage: ``Pipeline(..., mesh=mesh, parallelize=fn)`` on DTensor layers.

One spawn of 4 gloo ranks (pp 2 × tp 2) runs every schedule: gradients and the parameters after
clipped AdamW steps equal one process on the whole batch, and the parallelized Linear layers keep
their fast-path split (checked by the split guard, not fallen back).
"""

from __future__ import annotations

import pytest

from _dist import run_ranks
from _tp import pipeline_cases

SCHEDULES = ["zb-h1", "zb-v", "1f1b"]


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
