"""Real-training safety on 2 gloo ranks: mixed precision, tied weights, rank consistency, errors
that reach every rank within seconds, evaluation, per-stage RNG streams, settled checkpoints and
the small input cases (issue 11).  Each group of checks runs in one spawn."""

from __future__ import annotations

import re

import pytest
from _dist import run_ranks
from _profile import TWO_AND_FOUR_RANKS
from _safety import behaviour_cases, construction_cases, failure_cases, precision_cases, tied_cases

from zerobubble.schedule import REGISTRY

pytestmark = pytest.mark.multiprocess

SCHEDULES = [name for name in REGISTRY if name != "zb-ilp"]


def _seconds(message: str) -> float:
    return float(re.match(r"after ([0-9.]+)s", message).group(1))


# -- mixed precision -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def precision() -> list[dict]:
    return run_ranks(precision_cases, 2, SCHEDULES, timeout=240)


@pytest.mark.parametrize("name", SCHEDULES)
def test_autocast_bf16_matches_the_unpipelined_autocast_gradients(name, precision):
    for results in precision:
        error, dtypes = results[f"autocast {name}"]
        assert error <= 2e-2 and dtypes == ["torch.float32"], (error, dtypes)


@pytest.mark.parametrize("name", SCHEDULES)
def test_bf16_weights_match_the_unpipelined_bf16_gradients(name, precision):
    for results in precision:
        assert results[f"bf16 {name}"] <= 3e-2


def test_loss_scaling_composes_with_the_optimizer_step(precision):
    for results in precision:
        scaling = results["loss scaling"]
        assert scaling["scaled vs unscaled"] <= 1e-6
        assert scaling["overflow skipped"] == 1 and scaling["overflow unchanged"]


# -- tied weights --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tied() -> list[dict]:
    return run_ranks(tied_cases, 2, ["1f1b", "zb-h1", "zb-v"], timeout=240)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v"])
def test_tied_embedding_and_head_train_like_the_unpipelined_model(name, tied):
    first, second = (results[name] for results in tied)
    for result in (first, second):
        assert result["grads"] <= 1e-5 and result["params"] <= 1e-5, result
        assert result["clipped"] == 3, "the global norm (tied weight counted once) is clipped"
    keys = first["state_keys"] + second["state_keys"]
    assert "0.embed.weight" in keys and "5.weight" in keys, (
        "both names of the tie, as in the unpipelined model"
    )
    copies = [r["tied_copy"] for r in (first, second) if r["tied_copy"] is not None]
    assert len(set(copies)) == 1, copies


# -- consistency at construction --------------------------------------------------------------------

CONSTRUCTION = [
    "layer count",
    "parameter shape",
    "microbatches",
    "bad argument on one rank",
    "data-parallel broadcast",
]


@pytest.fixture(scope="module")
def construction() -> list[dict]:
    # fresh interpreters, as torchrun starts: each rank its own hash seed and RNG state
    return run_ranks(construction_cases, 2, CONSTRUCTION, timeout=180, start_method="spawn")


@pytest.mark.parametrize(
    "case, expected",
    [
        ("layer count", "rank 1 differs from rank 0 in its number of layers: 5 there but 4 on rank 0"),
        (
            "parameter shape",
            "rank 1 differs from rank 0 in its parameters: entry 8 is ('2.0.weight', (24, 8)",
        ),
        ("microbatches", "rank 1 differs from rank 0 in its"),
    ],
)
def test_ranks_that_disagree_stop_at_construction(case, expected, construction):
    for results in construction:
        assert expected in results[case] and _seconds(results[case]) < 3, results[case]


def test_a_bad_argument_on_one_rank_is_named_on_the_others(construction):
    first, second = (results["bad argument on one rank"] for results in construction)
    assert "rank 1 could not build its part of the pipeline" in first and "nope" in first
    assert "nope" in second


def test_data_parallel_replicas_start_from_the_same_weights(construction):
    first, second = (results["data-parallel broadcast"] for results in construction)
    assert first == second


# -- errors travel ---------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=TWO_AND_FOUR_RANKS, ids=["2-ranks", "4-ranks"])
def failures(request) -> list[dict]:
    """Every rank's outcomes of :func:`_safety.failure_cases` on ``request.param`` ranks."""
    return run_ranks(failure_cases, request.param, request.param, timeout=120)


def test_a_failing_rank_that_stays_alive_stops_every_peer_within_seconds(failures):
    results, world = failures, len(failures)
    last = world - 1
    assert "CUDA out of memory (simulated)" in results[last]["step"]
    for result in results[:last]:
        message = result["step"]
        assert _seconds(message) < 3, message
        assert f"rank {last} failed in op F{last}." in message and "CUDA out of memory (simulated)" in message
    for result in results:
        assert "cannot run step() any more" in result["again"]


def test_an_optimizer_error_reaches_every_rank(failures):
    results, world = failures, len(failures)
    for result in results[: world - 1]:
        message = result["optimizer"]
        assert _seconds(message) < 3 and "optimizer state corrupted (simulated)" in message, message
        assert f"rank {world - 1} failed in optimizer_step()" in message
    assert "optimizer state corrupted (simulated)" in results[world - 1]["optimizer"]


@pytest.mark.parametrize("failures", [2], ids=["2-ranks"], indirect=True)
def test_synchronize_waits_no_longer_than_the_timeout(failures):
    message = failures[0]["stalled optimizer"]
    assert 1.0 <= _seconds(message) < 3 and "timeout 1.5 s" in message, message


# -- evaluation, RNG, checkpoints, small cases -------------------------------------------------------


@pytest.fixture(scope="module")
def behaviour() -> list[dict]:
    return run_ranks(behaviour_cases, 2, timeout=240)


def test_each_stage_draws_its_own_dropout_masks(behaviour):
    first, second = (results["masks"] for results in behaviour)
    for name in first:
        assert first[name] != second[name], name


def test_schedules_of_the_same_placement_give_identical_results_with_dropout(behaviour):
    for results in behaviour:
        for pair, difference in results["same placement"].items():
            assert difference <= 1e-6, (pair, difference)


def test_evaluate_is_forward_only_in_eval_mode_under_no_grad(behaviour):
    first, second = (results["evaluate"] for results in behaviour)
    assert first["loss error"] is not None and first["loss error"] <= 1e-5  # zb-v: the loss is on rank 0
    assert second["loss error"] is None
    for result in (first, second):
        assert result["grads unchanged"] and result["training restored"]


def test_step_under_no_grad_says_to_use_evaluate(behaviour):
    for results in behaviour:
        assert "use pipe.evaluate" in results["step under no_grad"]


def test_state_dict_settles_a_pending_clipped_step(behaviour):
    for results in behaviour:
        assert results["state after clipped step"]["error"] <= 1e-5


def test_small_input_cases_get_clear_errors_or_work(behaviour):
    first, second = (results["small cases"] for results in behaviour)
    assert "are a dict (x)" in first["dict inputs"]
    for result in (first, second):
        assert "batch is empty" in result["empty batch"]
        assert result["rank without parameters"] == "stepped 1"
    assert "returns a str as output 1; only tensors can pass between stages" in first["non-tensor output"]
    layer_error = second["layer error"]
    assert "boom from a layer" in layer_error and "check that the outputs" not in layer_error
    assert "rank 1 failed" in first["layer error"] and "boom from a layer" in first["layer error"]


# -- the B/W split under autocast, one process --------------------------------------------------------


@pytest.mark.parametrize("defer", [True, False])
def test_deferred_linear_under_autocast_gives_autograd_gradients_in_the_parameter_dtype(defer):
    import torch
    from torch import nn

    from zerobubble.runtime.wgrad import WeightGradStore, install_deferral

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    reference = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    reference.load_state_dict(model.state_dict())
    inputs = torch.randn(5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference(inputs).float().pow(2).mean().backward()
    store = WeightGradStore()
    install_deferral([model], store)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(inputs).float().pow(2).mean()
        store.begin((0, 0), defer)
        loss.backward()
        store.end()
        store.flush((0, 0))
    for param, expected in zip(model.parameters(), reference.parameters()):
        assert param.grad.dtype == torch.float32
        assert torch.equal(param.grad, expected.grad)
