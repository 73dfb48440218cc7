"""The vocabulary-parallel head and embedding on a mesh of pp 2 × dp 2 gloo ranks, replicated and FSDP2
data parallelism: three clipped, post-validated AdamW steps in float64 train every parameter and loss
as the unsharded model in one process; the state dicts and a DCP checkpoint round-trip; a mesh with
ranks inside a stage is refused on every rank.  One spawn of four ranks."""

from __future__ import annotations

import pytest
from _dist import run_ranks
from _training_equivalence import Case
from _vocab_grid import grid_cases

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-10


def _case(layout: str, *, tied: bool, schedule: str = "zb-h1") -> Case:
    return Case(
        schedule, 4, 4, True, tied, False, "adamw", 0.05, 0.05, True, "zero-first", layout, steps=3, seed=3
    )


CASES = [
    {"case": _case("mesh-replicate", tied=True), "checkpoint": True},
    {"case": _case("mesh-fsdp", tied=False, schedule="zb-v"), "checkpoint": True},
    {"case": _case("replicas", tied=False, schedule="1f1b")},
    {"case": _case("mesh-tp", tied=False), "refused": True},
]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[list]:
    return run_ranks(grid_cases, 4, CASES, str(tmp_path_factory.mktemp("vocab-grid")), timeout=400)


@pytest.mark.parametrize("index", range(3), ids=lambda i: CASES[i]["case"].layout)
def test_replicas_train_like_one_process(results, index):
    for rank, per_rank in enumerate(results):
        result = per_rank[index]
        for what in ("loss", "grads", "params"):
            assert result[what] <= TOLERANCE, (rank, what, result)
        assert result["steps"] == 3 and result["clipped"] == 3, (rank, result)  # max_norm 0.05 clips


@pytest.mark.parametrize("index", range(2), ids=lambda i: CASES[i]["case"].layout)
def test_state_dicts_and_dcp_round_trip_on_the_grid(results, index):
    for rank, per_rank in enumerate(results):
        result = per_rank[index]
        for what in ("full_state_dict", "dcp", "dcp, one more step"):
            assert result[what] <= TOLERANCE, (rank, what, result)


def test_ranks_inside_a_stage_are_refused_on_every_rank(results):
    for per_rank in results:
        message = per_rank[3]
        assert "2 ranks inside each stage" in message and "pipeline and data-parallel" in message, message
