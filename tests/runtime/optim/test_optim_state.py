"""The pure parts of optimizer post-validation (zerobubble.runtime.optim), one process, no ranks.

A bug in the norm state, its combination along the chain or the decisions taken on it would
otherwise show up only in the spawned-rank tests of test_post_validation.py, as a wrong counter or
a timeout.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from zerobubble.runtime.optim import (
    OptimizerStats,
    PostValidator,
    StepOutcome,
    Verdict,
    chain_neighbours,
    clip_coefficient,
    combine_states,
    local_state,
    partial_decision,
    reduce_op,
    verdict_of,
)

CPU = torch.device("cpu")


def gradients(seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) * scale for shape in [(8, 5), (5,), (3, 8), (1,)]]


def chain_state(parts: list[list[torch.Tensor]], norm_type: float) -> torch.Tensor:
    """The state at the tail of a chain whose ranks hold ``parts``, combined rank by rank."""
    state = local_state(parts[0], norm_type, CPU)
    for part in parts[1:]:
        state = combine_states(state, local_state(part, norm_type, CPU), norm_type)
    return state


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_the_chains_state_gives_torchs_total_norm(norm_type):
    grads = gradients(0)
    state = chain_state([grads[:1], grads[1:3], grads[3:]], norm_type)
    assert state.dtype == torch.float64 and state[1].item() == 0.0
    _, norm, _ = verdict_of(state, norm_type, None, torch.float32)
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]).double(), norm_type)
    assert norm == pytest.approx(expected.item(), rel=1e-6)


def test_an_empty_rank_contributes_nothing():
    assert local_state([], 2.0, CPU).tolist() == [0.0, 0.0]
    grads = gradients(1)
    alone = local_state(grads, 2.0, CPU)
    assert torch.equal(combine_states(local_state([], 2.0, CPU), alone, 2.0), alone)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_a_non_finite_gradient_anywhere_skips_the_step(bad, norm_type):
    grads = gradients(2)
    grads[2][1, 3] = bad
    for where in range(3):  # head, middle or tail of the chain holds it
        parts = [grads[:2], grads[2:3], grads[3:]]
        parts.insert(0, parts.pop(where))
        state = chain_state(parts, norm_type)
        assert state[1].item() > 0.0
        verdict, _, coef = verdict_of(state, norm_type, 1.0, torch.float32)
        assert verdict is Verdict.SKIP and math.isnan(coef)


def test_the_verdict_clips_exactly_when_torch_would():
    grads = gradients(3)
    norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])).item()
    state = local_state(grads, 2.0, CPU)
    assert verdict_of(state, 2.0, None, torch.float32)[0] is Verdict.PLAIN
    assert verdict_of(state, 2.0, norm * 2, torch.float32)[0] is Verdict.PLAIN
    verdict, total, coef = verdict_of(state, 2.0, norm / 4, torch.float32)
    assert verdict is Verdict.CLIP and coef == clip_coefficient(total, norm / 4, torch.float32) < 1.0


@pytest.mark.parametrize("seed", range(20))
def test_a_prefix_that_clips_or_skips_decides_for_the_whole_chain(seed):
    """The prefix's norm is a lower bound of the total: its SKIP is final, its CLIP never turns PLAIN.

    (A CLIP may still become a SKIP when a later rank holds a non-finite gradient.)
    """
    generator = torch.Generator().manual_seed(seed)
    parts = [
        gradients(100 * seed + rank, scale=float(torch.rand(1, generator=generator)) * 0.6)
        for rank in range(4)
    ]
    if seed % 5 == 0:
        parts[seed % 4][0][0, 0] = math.nan
    full = verdict_of(chain_state(parts, 2.0), 2.0, 1.0, torch.float32)[0]
    for length in range(1, 5):
        prefix = verdict_of(chain_state(parts[:length], 2.0), 2.0, 1.0, torch.float32)[0]
        if prefix is Verdict.SKIP:
            assert full is Verdict.SKIP
        if prefix is Verdict.CLIP:
            assert full is not Verdict.PLAIN


def test_only_a_reversible_plain_guess_is_taken_at_once():
    assert partial_decision(Verdict.PLAIN, reversible=True) == (True, False)
    assert partial_decision(Verdict.PLAIN, reversible=False) == (False, True)
    for reversible in (True, False):
        assert partial_decision(Verdict.CLIP, reversible) == (False, True)
        assert partial_decision(Verdict.SKIP, reversible) == (False, False)


def test_reduce_op_matches_the_combination():
    assert reduce_op(2.0) == dist.ReduceOp.SUM and reduce_op(math.inf) == dist.ReduceOp.MAX


def test_chain_neighbours():
    chain = [3, 1, 0, 2]
    assert chain_neighbours(chain, 3) == (None, 1)
    assert chain_neighbours(chain, 0) == (1, 2)
    assert chain_neighbours(chain, 2) == (0, None)
    assert chain_neighbours([5], 5) == (None, None)


def test_stats_count_each_outcome_once():
    stats = OptimizerStats(pending=True)
    for outcome in [
        StepOutcome(0.5, 1.0, skipped=False, rolled_back=False, deferred=False),
        StepOutcome(3.0, 0.33, skipped=False, rolled_back=True, deferred=False),
        StepOutcome(math.inf, math.nan, skipped=True, rolled_back=True, deferred=False),
        StepOutcome(2.0, 0.5, skipped=False, rolled_back=False, deferred=True),
    ]:
        stats = stats.counted(outcome)
    assert stats == OptimizerStats(steps=4, clipped=2, skipped=1, rolled_back=2, deferred=1, pending=True)
    assert stats.plus(OptimizerStats(steps=1, pending=False)) == OptimizerStats(4 + 1, 2, 1, 2, 1, False)


def test_a_chain_of_one_rank_is_clip_grad_norm_and_step():
    """With no neighbours the validator settles at once, without any distributed call."""
    params = [torch.zeros(shape, requires_grad=True) for shape in [(8, 5), (5,), (3, 8), (1,)]]
    twins = [torch.zeros_like(p, requires_grad=True) for p in params]
    optimizer, twin_optimizer = torch.optim.AdamW(params, lr=0.1), torch.optim.AdamW(twins, lr=0.1)
    validator = PostValidator(optimizer, 1.0)
    for step, scale in enumerate([0.01, 5.0, math.nan, 1.0]):
        for param, twin, grad in zip(params, twins, gradients(step, scale)):
            param.grad, twin.grad = grad.clone(), grad.clone()
        validator.step()
        assert not validator.pending
        if not math.isnan(scale):
            torch.nn.utils.clip_grad_norm_(twins, 1.0)
            twin_optimizer.step()
        for param, twin in zip(params, twins):
            torch.testing.assert_close(param, twin, rtol=1e-6, atol=1e-7)
    assert validator.stats == OptimizerStats(steps=4, clipped=2, skipped=1, rolled_back=0, deferred=0)
