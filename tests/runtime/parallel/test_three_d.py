"""Three-dimensional parallelism on 8 gloo ranks: pp 2 × dp 2 (FSDP2) × tp 2 on one DeviceMesh.

FSDP2 shards the tensor-parallel DTensors of each chunk over "dp" (2-D DTensors, as torchtitan
composes them); the B/W split, the clipped post-validated AdamW steps and the gradients' reduction run
on them.  One spawn runs every schedule: after 3 clipped AdamW steps the parameters equal one process
training the whole model on the whole batch, and each rank holds about 1/(dp·tp) of the replicated
bytes of parameters, gradients and AdamW state.  The same spawn then saves the 3-D layout with DCP
and loads it into pp 2 × dp 4 and into the unpipelined model, each continuing exactly, and trains
HSDP (pp 2 × dp_replicate 2 × dp_shard 2) against one process too.
"""

from __future__ import annotations

import pytest
from _dist import run_ranks
from _tp import three_d_all

pytestmark = pytest.mark.multiprocess

# eight ranks in one spawn: CI's profile runs it (tests/conftest.py); the 2-D layouts it combines
# have quick tests of their own (test_fsdp.py, test_tensor_parallel.py, test_mesh.py)
pytestmark = pytest.mark.slow

SCHEDULES = ["zb-h1", "zb-v", "1f1b"]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("three_d") / "checkpoint")
    return run_ranks(three_d_all, 8, SCHEDULES, 3, 0.5, root, timeout=400)


@pytest.fixture(scope="module")
def results(spawned):
    return [per_rank["steps"] for per_rank in spawned]


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


@pytest.mark.parametrize("schedule", SCHEDULES[:2])
def test_hsdp_steps_equal_one_process(spawned, schedule):
    """pp 2 × dp_replicate 2 × dp_shard 2: sharded within a row, replicated across rows; the clip's
    norm counts each row's shards once (not once per replicate row)."""
    for rank, per_rank in enumerate(spawned):
        outcome = per_rank["hsdp"][schedule]
        assert outcome["params"] <= 1e-10, (rank, outcome)
        assert outcome["steps"] == 3 and outcome["clipped"] >= 1 and outcome["replicas"] == 4, outcome
        assert outcome["placements"] == ["(Replicate(), Shard(dim=0))"], outcome
        assert 0.5 <= outcome["bytes"] <= 0.55, outcome  # 1/dp_shard of replicated


def test_the_clip_norm_of_hsdp_over_tensor_parallelism_counts_each_row_once(spawned):
    """dp_replicate × dp_shard × tp: 3-D DTensor gradients (Replicate, Shard, Shard)."""
    for per_rank in spawned:
        outcome = per_rank["hsdp tp norm"]
        assert any(p.startswith("(Replicate(), ") and p.count("Shard") == 2 for p in outcome["placements"])
        assert outcome[2.0] <= 1e-12 and outcome[float("inf")] <= 1e-12, outcome


def test_a_checkpoint_of_the_3d_layout_loads_into_other_layouts_and_continues_exactly(spawned):
    """DCP from pp 2 × dp 2 × tp 2 into pp 2 × dp 4 (FSDP2 alone) and into the unpipelined model."""
    per_rank = [outcome["checkpoint"] for outcome in spawned]
    for rank, outcome in enumerate(per_rank):
        assert outcome["saved"] <= 1e-10 and outcome["pp2 dp4"] <= 1e-10, (rank, outcome)
    assert per_rank[0]["unpipelined"] <= 1e-10, per_rank[0]
