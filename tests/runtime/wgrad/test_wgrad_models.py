"""Real models through the B/W split on 2 gloo ranks, every registry schedule: loss, every gradient and
every buffer equal one process over the same microbatches.

Models (:func:`zerobubble_demo.split_models.split_model`): transformers GPT-2 (``Conv1D``
projections) and Llama
(RMSNorm through the generic split; rotary tables cross stage boundaries as a tuple), a conv net with
BatchNorm (running statistics compared too), transformer blocks under activation checkpointing,
``nn.MultiheadAttention`` blocks (routed ``F.linear``) and blocks written on raw parameters (the
generic split with W from the frontier and the norms' parameter gradients from B).
Every B op is watched: no parameter's ``.grad`` may change in B (all of it waits for W).
All cases run in one spawn; each parametrized test reads its case from the shared result.
"""

from __future__ import annotations

import pytest
from _dist import RUNTIME_SCHEDULES, run_ranks
from _wgrad_models import model_cases

from zerobubble_demo.split_models import SPLIT_MODELS

pytest.importorskip("transformers")
pytestmark = pytest.mark.multiprocess

RELATIVE = 1e-5
ABSOLUTE = 1e-6  # floor for gradients that are zero in exact arithmetic (e.g. GPT-2's key biases)
MICROBATCHES = 4
SCHEDULES = RUNTIME_SCHEDULES


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(model_cases, 2, list(SPLIT_MODELS), SCHEDULES, MICROBATCHES, timeout=280.0)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("model", SPLIT_MODELS)
def test_pipeline_matches_one_process(results, model, schedule):
    per_rank = [rank_results[model, schedule] for rank_results in results]
    if "skipped" in per_rank[0]:
        pytest.skip(per_rank[0]["skipped"])
    losses = [r["loss"] for r in per_rank if r["loss"] is not None]
    assert len(losses) == 1 and losses[0] < RELATIVE
    grads = {name: error for r in per_rank for name, error in r["grads"].items()}
    assert len(grads) == per_rank[0]["parameters"], "every parameter lives on exactly one rank"
    for name, (error, norm) in grads.items():
        assert error <= RELATIVE * norm + ABSOLUTE, f"{name}: |error| {error:.3g}, |expected| {norm:.3g}"
    for r in per_rank:
        for name, (error, norm) in r["buffers"].items():
            assert error <= RELATIVE * norm + ABSOLUTE, f"buffer {name}: {error:.3g} vs {norm:.3g}"
        assert r["int_buffers_equal"], "num_batches_tracked differs from one process"
    for r in per_rank:
        assert r["grads_touched_in_b"] == [], f"B ops computed gradients W should: {r['grads_touched_in_b']}"
    if model == "convnet":
        assert any(r["buffers"] for r in per_rank), "the conv net's running statistics were compared"
