"""Three-dimensional parallelism on 8 gloo ranks: pp 2 × dp 2 (FSDP2) × tp 2 on one DeviceMesh.

FSDP2 shards the tensor-parallel DTensors of each chunk over "dp" (2-D DTensors, as torchtitan
composes them); the B/W split, the clipped post-validated AdamW steps and the gradients' reduction run
on them.  One spawn runs every schedule: after 3 clipped AdamW steps the parameters equal one process
training the whole model on the whole batch, and each rank holds about 1/(dp·tp) of the replicated
bytes of parameters, gradients and AdamW state.
"""

from __future__ import annotations

import pytest

from _dist import run_ranks
from _tp import three_d_cases

pytestmark = pytest.mark.multiprocess

SCHEDULES = ["zb-h1", "zb-v", "1f1b"]


@pytest.fixture(scope="module")
def results():
    return run_ranks(three_d_cases, 8, SCHEDULES, 3, 0.5, timeout=400)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_clipped_adamw_steps_equal_one_process(results, schedule):
    for rank, per_rank in enumerate(results):
        outcome = per_rank[schedule]
        assert outcome["params"] <= 1e-10, (rank, outcome)
        assert outcome["steps"] == 3 and outcome["clipped"] >= 1, (rank, outcome)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_parameters_are_two_dimensional_shards(results, schedule):
    for per_rank in results:
        outcome = per_rank[schedule]
        assert "(Shard(dim=0), Shard(dim=1))" in outcome["placements"]  # dp rows × tp columns
        # 1/(dp·tp) = 0.25 of the replicated bytes; the norms and row-wise biases are split over dp only
        assert 0.25 <= outcome["bytes"] <= 0.32, outcome
