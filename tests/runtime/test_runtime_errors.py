"""User errors and failures give a clear PipelineError before or at the first step — never a hang."""

from __future__ import annotations

import re

import pytest
from _dist import error_cases, run_ranks

from zerobubble.runtime.launch import RankFailure

pytestmark = pytest.mark.multiprocess

SEQUENTIAL = [
    "world_size",
    "batch_split",
    "invalid_schedule",
    "loss_not_scalar",
    "shape_mismatch",
    "dtype_mismatch",
    "shape_changed",
    "ddp_layer",
    "dtensor_layer",
    "stalled_rank",
]


@pytest.fixture(scope="module")
def messages() -> list[dict[str, str]]:
    return run_ranks(error_cases, 2, SEQUENTIAL, timeout=150)


def test_a_ddp_wrapped_layer_is_refused_on_every_rank(messages):
    """DDP reduces from autograd's accumulation hooks, which W never fires: silently no reduction."""
    assert "is wrapped in DistributedDataParallel" in messages[1]["ddp_layer"]
    assert "data_parallel=D" in messages[1]["ddp_layer"]
    assert "rank 1" in messages[0]["ddp_layer"] and "DistributedDataParallel" in messages[0]["ddp_layer"]


def test_dtensor_parameters_are_refused_on_every_rank(messages):
    for rank_messages in messages:
        message = rank_messages["dtensor_layer"]
        assert "is a DTensor (FSDP2 fully_shard or tensor parallelism" in message
        assert "parallelize=fn" in message  # what to use instead


def test_world_size_that_the_schedule_does_not_fit(messages):
    for rank_messages in messages:
        assert "needs 4 ranks but the process group has 2" in rank_messages["world_size"]


def test_batch_that_does_not_split_into_microbatches(messages):
    for rank_messages in messages:
        assert "does not split into 3 equal microbatches" in rank_messages["batch_split"]


def test_schedule_that_fails_validation(messages):
    for rank_messages in messages:
        invalid = rank_messages["invalid_schedule"]
        assert "cannot run" in invalid and "F1.0 is missing" in invalid


def test_loss_that_is_not_a_scalar(messages):
    last_rank = messages[1]["loss_not_scalar"]
    assert "loss_fn must return a scalar tensor" in last_rank and "[6]" in last_rank
    # the peer does not wait for its timeout: it raises with rank 1's op and original error
    first_rank = messages[0]["loss_not_scalar"]
    assert "rank 1 failed in op F1.0" in first_rank and "loss_fn must return a scalar tensor" in first_rank


@pytest.mark.parametrize(
    "case, detail",
    [("shape_mismatch", "shapes cannot be multiplied"), ("dtype_mismatch", "Double and Float")],
)
def test_mismatch_between_stages_names_both_stages(case, detail, messages):
    message = messages[1][case]
    assert "forward of stage 1" in message and "from stage 0 (rank 0)" in message and detail in message
    assert "[2, 3, 8]" in message


def test_shapes_that_change_after_the_first_step(messages):
    message = messages[0]["shape_changed"]
    assert "between stages 0 and 1" in message and "changed from [2, 3, 8] float32" in message
    assert "static_shapes=False" in message


def test_stalled_rank_times_out_instead_of_hanging(messages):
    message = messages[0]["stalled_rank"]
    waited = float(re.match(r"after ([0-9.]+)s", message).group(1))
    assert 1.5 <= waited <= 4.5 and "failed (timeout 2 s)" in message and "stalled" in message


def test_killed_rank_makes_the_survivor_stop():
    with pytest.raises(RankFailure) as failure:
        run_ranks(error_cases, 2, ["killed_rank"], timeout=60)
    assert "exited with code 3" in str(failure.value)
    message = failure.value.results[0]["killed_rank"]
    waited = float(re.match(r"after ([0-9.]+)s", message).group(1))
    assert waited <= 1.5 and "a peer rank probably died" in message
