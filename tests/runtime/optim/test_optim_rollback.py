"""In-place rollback of one optimizer step (zerobubble.runtime.optim.rollback.ReversibleStep), one process.

The expectation is always an independent twin optimizer that never rolls back: it takes the
clipped step directly with torch's own ``optimizer.step()``.
"""

from __future__ import annotations

import pytest
import torch

from zerobubble.runtime.optim.post_validation import clip_coefficient
from zerobubble.runtime.optim.rollback import OptimizerValidationError, ReversibleStep, rollback_support

TOLERANCE = 1e-6
SHAPES = [(48, 32), (32,), (7, 48), (7,)]

CONFIGS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd-momentum-decay": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.05),
    "sgd-dampening-maximize": lambda ps: torch.optim.SGD(
        ps, lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.01, maximize=True
    ),
    "sgd-nesterov-decay": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.05
    ),
    "sgd-nesterov-foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, foreach=True),
    "sgd-foreach-decay": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, weight_decay=0.05, foreach=True
    ),
    "sgd-fused-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, fused=True),
    "sgd-plain-decay": lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.05),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adam-decay-maximize": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, maximize=True),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.99), foreach=True),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
}


def make_params(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).requires_grad_() for shape in SHAPES]


def set_grads(params: list[torch.Tensor], step: int, scale: float = 1.0) -> None:
    """Fresh gradient tensors (as after zero_grad(set_to_none=True) and a backward)."""
    generator = torch.Generator().manual_seed(1000 + step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator) * scale


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual − expected| / max |expected| (the tensor's own scale)."""
    scale = expected.abs().max().item()
    return (actual - expected).abs().max().item() / (scale if scale > 0 else 1.0)


def snapshot(params, optimizer) -> tuple[list[torch.Tensor], list[dict]]:
    """Copies of the parameters and of their optimizer state (test bookkeeping only)."""
    states = [
        {
            key: (value.clone() if isinstance(value, torch.Tensor) else value)
            for key, value in optimizer.state.get(p, {}).items()
        }
        for p in params
    ]
    return [p.detach().clone() for p in params], states


def worst_difference(params, optimizer, expected_params, expected_optimizer) -> float:
    """Largest relative error over parameters and state tensors; state keys and steps must match."""
    worst = 0.0
    for param, expected in zip(params, expected_params):
        worst = max(worst, relative_error(param.detach(), expected.detach()))
        state, expected_state = optimizer.state.get(param, {}), expected_optimizer.state.get(expected, {})
        assert sorted(state) == sorted(expected_state)
        for key, value in expected_state.items():
            if key == "step":
                assert float(state[key]) == float(value)
            elif isinstance(value, torch.Tensor):
                worst = max(worst, relative_error(state[key], value))
    return worst


def twin(config: str):
    params = make_params()
    optimizer = CONFIGS[config](params)
    twin_params = [p.detach().clone().requires_grad_() for p in params]
    twin_optimizer = CONFIGS[config](twin_params)
    return params, optimizer, twin_params, twin_optimizer


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_rollback_restores_parameters_state_and_step(config):
    params, optimizer, _, _ = twin(config)
    for step in range(3):
        set_grads(params, step)
        optimizer.step()
    before_params, before_states = snapshot(params, optimizer)
    set_grads(params, 3, scale=1.5)
    grads_before = [p.grad.clone() for p in params]
    reversible = ReversibleStep(optimizer)
    reversible.record()
    reversible.apply()
    moved = max(relative_error(p.detach(), b) for p, b in zip(params, before_params))
    assert moved > 1e-3  # the step really changed something
    reversible.rollback()
    for param, expected, state, grad, expected_grad in zip(
        params, before_params, before_states, (p.grad for p in params), grads_before
    ):
        assert relative_error(param.detach(), expected) <= TOLERANCE
        assert relative_error(grad, expected_grad) <= TOLERANCE
        assert sorted(optimizer.state[param]) == sorted(state)
        for key, value in state.items():
            if key == "step":
                assert float(optimizer.state[param][key]) == float(value) == 3.0
            else:
                assert relative_error(optimizer.state[param][key], value) <= TOLERANCE


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_first_step_rollback_removes_created_state(config):
    params, optimizer, _, _ = twin(config)
    before_params, _ = snapshot(params, optimizer)
    set_grads(params, 0)
    reversible = ReversibleStep(optimizer)
    reversible.record()
    reversible.apply()
    reversible.rollback()
    assert all(not optimizer.state.get(p) for p in params)
    assert max(relative_error(p.detach(), b) for p, b in zip(params, before_params)) <= TOLERANCE


CLIP_FACTORS = [1.0, 0.6, 0.2, 0.05, None]  # None: a gradient elsewhere was non-finite, skip


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_thirty_rounds_of_rollback_and_redo_match_torch(config):
    """Every step is taken unclipped and rolled back, then redone clipped or skipped.

    As in post-validation, the clip factor comes from the other ranks and this rank's own
    gradients keep their usual size (a rank steps optimistically only when its gradients are
    within max_norm).  The twin takes the clipped step (or none) directly.
    """
    params, optimizer, twin_params, twin_optimizer = twin(config)
    reversible = ReversibleStep(optimizer)
    worst = 0.0
    for step in range(30):
        scale = 0.5 + (step * 7 % 11) / 10
        factor = CLIP_FACTORS[step % len(CLIP_FACTORS)]
        set_grads(params, step, scale)
        set_grads(twin_params, step, scale)
        if factor is not None:
            for param in twin_params:
                param.grad.mul_(factor)
            twin_optimizer.step()
        reversible.record()
        reversible.apply()
        reversible.rollback()
        if factor is not None:
            reversible.apply(torch.tensor(factor))
        reversible.release()
        worst = max(worst, worst_difference(params, optimizer, twin_params, twin_optimizer))
        assert worst <= TOLERANCE, f"step {step}: relative error {worst:.3g}"
    for param, twin_param in zip(params, twin_params):
        assert relative_error(param.grad, twin_param.grad) <= TOLERANCE


def test_redo_uses_the_recorded_learning_rate_and_gradients():
    params, optimizer, twin_params, twin_optimizer = twin("adamw")
    set_grads(params, 0)
    set_grads(twin_params, 0)
    twin_optimizer.step()
    reversible = ReversibleStep(optimizer)
    reversible.record()
    optimizer.param_groups[0]["lr"] = 0.5  # a scheduler moved on
    for param in params:
        param.grad = None  # zero_grad(set_to_none=True)
    reversible.apply()
    assert optimizer.param_groups[0]["lr"] == 0.5
    assert all(p.grad is None for p in params)
    assert worst_difference(params, optimizer, twin_params, twin_optimizer) <= TOLERANCE


def test_gradients_changed_in_place_are_detected():
    params, optimizer, _, _ = twin("sgd-momentum")
    set_grads(params, 0)
    reversible = ReversibleStep(optimizer)
    reversible.record()
    reversible.apply()
    params[0].grad.zero_()
    with pytest.raises(OptimizerValidationError, match="modified in place"):
        reversible.rollback()


@pytest.mark.parametrize(
    "factory, words",
    [
        (lambda ps: torch.optim.Adam(ps, amsgrad=True), "amsgrad"),
        (torch.optim.RMSprop, "RMSprop"),
        (lambda ps: torch.optim.SGD(ps, lr=1.0, weight_decay=1.0), "weight_decay == 1"),
    ],
)
def test_non_invertible_optimizers_are_named_and_refused(factory, words):
    params = make_params()
    optimizer = factory(params)
    assert words in rollback_support(optimizer)
    set_grads(params, 0)
    reversible = ReversibleStep(optimizer)
    reversible.record()
    assert not reversible.reversible
    reversible.apply()
    with pytest.raises(OptimizerValidationError, match="cannot be rolled back"):
        reversible.rollback()


@pytest.mark.parametrize("max_norm", [0.5, 3.0, 1e3])
def test_clip_coefficient_is_torchs(max_norm):
    params = make_params()
    set_grads(params, 7)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.double()) for p in params]))
    originals = [p.grad.clone() for p in params]
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    coef = clip_coefficient(total.item(), max_norm, torch.float32)
    assert coef <= 1.0
    for param, original in zip(params, originals):
        assert relative_error(original * coef, param.grad) <= 1e-7
    assert clip_coefficient(total.item(), None, torch.float32) == 1.0
