"""The replicated all-reduce in buckets (``fsdp=FSDPOptions(bucket_bytes=...)`` with replicas).

* :func:`~zerobubble.runtime.parallel.data_parallel.bucket_parameters` cuts a stage's parameters into
  the lowered program's buckets: the same layers, so the same bytes, bucket by bucket (drawn layer
  sizes and bucket sizes), a tied parameter in the chunk reduced last (one process).
* The request takes a bucket size with replicas and refuses it with FSDP or beside FSDP's fields.
* On four gloo ranks (two pipelines of two, replicated): the all-reduces posted over the
  data-parallel group are the lowered buckets, in order and size; ranks passing other bucket sizes
  are refused on every rank before anything runs; and training stays exact against
  the unsharded model over three clipped, post-validated steps: per-layer buckets under zb-h1's B/W
  split with tied ends, two-block buckets under zb-v with tied vocabulary-parallel ends, and a mesh's
  replicate dimension under 1f1b (the drawn cases: tests/runtime/test_training_equivalence.py).
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from _dp_buckets import mismatched_buckets, posted_buckets
from _training_equivalence import Case, train_case
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from zerobubble import FSDPOptions
from zerobubble.runtime import PipelineError
from zerobubble.runtime.construct.request import PipelineRequest
from zerobubble.runtime.construct.staging import StageModule
from zerobubble.runtime.execute.executor import StageState
from zerobubble.runtime.parallel.data_parallel import bucket_parameters, last_gradient_ops
from zerobubble.runtime.wgrad.store import WeightGradStore
from zerobubble.schedule import build_schedule
from zerobubble.schedule.grid import Grid
from zerobubble.schedule.lowering import StageBytes, lower
from zerobubble.schedule.sharding import ONCE_PER_STEP

TOLERANCE = 1e-10


def _stage(index: int, layers: list[nn.Module]) -> StageState:
    return StageState(index, StageModule(layers), WeightGradStore(), index == 0, False, str(index))


def _bytes(params) -> float:
    return float(sum(p.numel() * p.element_size() for p in params))


@settings(max_examples=25, deadline=None)
@given(
    widths=st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=5), min_size=4, max_size=4),
    bucket=st.sampled_from((0.0, 1.0, 100.0, 300.0, 1e9)),
)
def test_a_stage_is_cut_into_the_lowered_buckets(widths, bucket):
    """zb-v on 2 ranks (4 stages): every stage's buckets hold the bytes the lowering gave them."""
    schedule = build_schedule("zb-v", 2, 4)
    layers = [[nn.Linear(w, w) for w in stage] for stage in widths]
    model = StageBytes(tuple(tuple(_bytes(layer.parameters()) for layer in stage) for stage in layers))
    lowered = lower(schedule, FSDPOptions(bucket_bytes=bucket), grid=Grid(dp=2), model=model)
    for rank, program in enumerate(schedule.programs):
        stages = {s: _stage(s, layers[s]) for s in schedule.placement.stages_of(rank)}
        buckets = bucket_parameters(stages, last_gradient_ops(program), lowered.part_layers)
        for stage, parts in buckets.items():
            assert [_bytes(part) for part in parts] == list(lowered.part_grad_bytes[stage])
            assert len(parts) == (1 if bucket == 0 else len(lowered.part_layers[stage]))


def test_a_shared_parameter_travels_in_the_chunk_reduced_last_at_its_first_layer():
    shared = nn.Linear(2, 2)
    stages = {
        0: _stage(0, [shared, nn.Linear(2, 2)]),
        1: _stage(1, [nn.Linear(2, 2), nn.Linear(2, 2), shared]),
    }
    buckets = bucket_parameters(stages, {0: 4, 1: 9}, [(1, 1), (1, 2)])  # stage 1 reduced last
    assert [len(part) for part in buckets[1]] == [2, 4] and [len(part) for part in buckets[0]] == [0, 2]
    assert id(shared.weight) in {id(p) for p in buckets[1][1]}


def test_buckets_that_do_not_cut_the_stage_are_a_bug_named_as_such():
    with pytest.raises(PipelineError, match="holds 2 layers but its lowered buckets cut 3"):
        bucket_parameters({0: _stage(0, [nn.Linear(2, 2), nn.Linear(2, 2)])}, {0: 1}, [(1, 2)])


@pytest.mark.parametrize(
    ("fsdp", "data_parallel"),
    [
        (FSDPOptions(bucket_bytes=25e6), 2),
        (FSDPOptions(bucket_bytes=1), "replicate"),
        (ONCE_PER_STEP, 2),
        (FSDPOptions(units="chunk", reshard_after_forward=False, bucket_bytes=4e6), None),  # a mesh's
    ],
)
def test_replicas_take_a_bucket_size(fsdp, data_parallel):
    PipelineRequest(layers=[nn.Linear(2, 2)], fsdp=fsdp, data_parallel=data_parallel)


@pytest.mark.parametrize(
    ("fsdp", "data_parallel", "message"),
    [
        (FSDPOptions(units=2, bucket_bytes=1e6), 2, "replicates, where only the all-reduce's buckets apply"),
        (FSDPOptions(), "replicate", "replicates, where only the all-reduce's buckets apply"),
        (FSDPOptions(bucket_bytes=1e6), "hsdp", "buckets are the replicated all-reduce's"),
        (FSDPOptions(bucket_bytes=1e6), "fsdp", "FSDP reduce-scatters per unit: drop it"),
        (FSDPOptions(units="layer", reduce_after_step=True), "fsdp", "reduce_after_step=True) models"),
        (FSDPOptions(bucket_bytes=1e6, reduce_after_step=True), 2, "reduce_after_step=True) models"),
    ],
)
def test_a_bucket_size_where_it_cannot_apply_is_refused(fsdp, data_parallel, message):
    with pytest.raises(PipelineError, match=re.escape(message)):
        PipelineRequest(layers=[nn.Linear(2, 2)], fsdp=fsdp, data_parallel=data_parallel)


# -- four gloo ranks ---------------------------------------------------------------------------------

PER_LAYER = Case(
    "zb-h1", 4, 6, False, False, False, "sgd", 0.3, 0.05, True, "zero-after", "replicas", bucket_bytes=1.0
)
EXACT = {
    "zb-h1 per-layer buckets, tied ends": Case(
        "zb-h1", 4, 6, False, True, False, "adamw", 0.05, 0.05, True, "zero-first", "replicas",
        bucket_bytes=1.0,
    ),
    "zb-v two-block buckets, tied vocabulary-parallel ends": Case(
        "zb-v", 4, 8, True, True, True, "sgd", 0.3, 0.05, True, "zero-after", "replicas",
        bucket_bytes=4000.0,
    ),
    "1f1b a mesh's replicate dimension": Case(
        "1f1b", 2, 6, False, False, False, "adam", 0.05, 0.5, False, "zero-first", "mesh-replicate",
        bucket_bytes=2000.0,
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def outcomes():
    from _rank_pool import RankPool

    pool = RankPool(4)
    try:
        posts = pool.call(posted_buckets, PER_LAYER, timeout=120)
        trained = {name: pool.call(train_case, case, timeout=120) for name, case in EXACT.items()}
        refused = pool.call(mismatched_buckets, replace(PER_LAYER, bucket_bytes=2000.0), timeout=120)
        yield posts, trained, refused
    finally:
        pool.close()


@pytest.mark.multiprocess
def test_the_posted_all_reduces_are_the_lowered_buckets(outcomes):
    for rank, result in enumerate(outcomes[0]):
        assert len(result["expected"]) > 2, result  # a bucket a layer: several a chunk
        assert result["posted"] == result["expected"], f"rank {rank}: {result}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(EXACT))
def test_bucketed_replicas_train_like_one_process(outcomes, name):
    results = outcomes[1][name]
    for rank, result in enumerate(results):
        for what in ("loss", "grads", "params"):
            assert result[what] <= TOLERANCE, f"rank {rank}: {what} off by {result[what]:.3g} in {name}"
    assert {r["steps"] for r in results} == {EXACT[name].steps}


@pytest.mark.multiprocess
def test_ranks_passing_other_bucket_sizes_are_refused_on_every_rank(outcomes):
    for rank, message in enumerate(outcomes[2]):
        assert "differs from rank 0 in its fsdp" in message and "bucket_bytes=1.0" in message, (rank, message)
