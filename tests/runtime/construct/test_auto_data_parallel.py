"""``Pipeline(schedule="auto")`` with data parallelism runs what its plan chose for the replicas.

On a mesh of pp 2 × dp 2 (gloo): the plan carries the chosen options (``pipe.plan.comm``); without
``fsdp=`` the Pipeline lowers and shards with them (FSDP units, resharding and prefetch; or the
replicated all-reduce's bucket size), alike on every rank; with ``fsdp=`` it keeps the caller's and
the plan's reason says so.  These small layers' candidates often tie and the first (whole chunks,
the runtime's default) wins, so the planner is also offered only records the runtime would not run
by default (per-layer units that reshard; buckets of 2,000 bytes): the Pipeline runs what it chose.
Every case trains three steps exactly like one process.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from _auto_data_parallel import auto_case, train_auto, train_offered
from _rank_pool import RankPool

from zerobubble import FSDPOptions
from zerobubble.schedule.sharding import ONCE_PER_STEP

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-9
PASSED = ("layer", True, None, 1)
OFFERED = {
    "mesh-fsdp": (
        FSDPOptions(units="layer", reshard_after_forward=True, prefetch=1),
        FSDPOptions(units=2, reshard_after_forward=True, reshard_after_backward=True, prefetch=0),
    ),
    "mesh-replicate": (replace(ONCE_PER_STEP, bucket_bytes=2000.0),),
}


@pytest.fixture(scope="module")
def results():
    pool = RankPool(4)
    try:
        found = {
            (layout, fsdp): pool.call(train_auto, auto_case(layout, fsdp), timeout=240)
            for layout, fsdp in [("mesh-fsdp", None), ("mesh-replicate", None), ("mesh-fsdp", PASSED)]
        }
        for layout, offered in OFFERED.items():
            found[(layout, "offered")] = pool.call(
                train_offered, (auto_case(layout, None), offered), timeout=240
            )
        yield found
    finally:
        pool.close()


def _exact(ranks: list[dict]) -> None:
    for rank, result in enumerate(ranks):
        for what in ("loss", "grads", "params"):
            assert result[what] <= TOLERANCE, f"rank {rank}: {what} off by {result[what]:.3g}"
        assert result["steps"] == 3


@pytest.mark.parametrize("layout", ["mesh-fsdp", "mesh-replicate"])
def test_without_fsdp_the_pipeline_runs_the_planned_options_on_every_rank(results, layout):
    ranks = results[(layout, None)]
    _exact(ranks)
    planned = ranks[0]["planned"]
    assert isinstance(planned, FSDPOptions)
    assert all(r["planned"] == planned and r["lowered"] == planned for r in ranks)  # alike everywhere
    if layout == "mesh-fsdp":
        assert all(r["sharded"] == planned for r in ranks)
    else:
        assert planned.once_per_step and all(r["sharded"] is None for r in ranks)
    words = planned.describe("fsdp" if layout == "mesh-fsdp" else "replicate")
    assert f"data parallel: {words}: step " in ranks[0]["reason"]
    assert "as passed" not in ranks[0]["reason"]


def test_fsdp_passed_is_kept_and_the_reason_says_so(results):
    ranks = results[("mesh-fsdp", PASSED)]
    _exact(ranks)
    units, forward, backward, prefetch = PASSED
    passed = FSDPOptions(units=units, reshard_after_forward=forward, reshard_after_backward=backward,
                         prefetch=prefetch)  # fmt: skip
    assert all(r["lowered"] == passed == r["sharded"] for r in ranks)
    planned = ranks[0]["planned"]
    said = "the planned choice" if planned == passed else f"not the planned {planned.describe('fsdp')}"
    assert ranks[0]["reason"].endswith(f"runs fsdp= as passed ({passed.describe('fsdp')}), {said}")


@pytest.mark.parametrize("layout", ["mesh-fsdp", "mesh-replicate"])
def test_the_pipeline_runs_options_the_runtime_would_not_default_to_when_the_plan_chose_them(results, layout):
    ranks = results[(layout, "offered")]
    _exact(ranks)
    planned = ranks[0]["planned"]
    assert planned in OFFERED[layout]
    assert all(r["planned"] == planned == r["lowered"] for r in ranks)
    assert all(r["sharded"] == (planned if layout == "mesh-fsdp" else None) for r in ranks)
