"""The B/W split of nn.Linear: deferred weight gradients equal plain autograd, in any W order."""

from __future__ import annotations

import copy

import torch
from torch import nn

from zerobubble.runtime.wgrad import WeightGradStore, install_deferral, remove_deferral


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(13, 6), nn.Linear(6, 10), nn.LayerNorm(10), nn.GELU(), nn.Linear(10, 4, bias=False)
    )


def _batches(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(13, (3, 5), generator=generator) for _ in range(count)]


def _reference_grads(model: nn.Module, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    for tokens in batches:
        model(tokens).square().mean().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_deferred_weight_gradients_match_autograd_on_a_first_stage():
    """Integer input (no input gradient at all): B still defers the Linear weights, W adds them."""
    model, reference = _model(), copy.deepcopy(_model())
    batches = _batches(3)
    expected = _reference_grads(reference, batches)
    store = WeightGradStore()
    install_deferral([model], store)
    for j, tokens in enumerate(batches):
        loss = model(tokens).square().mean()
        store.begin((0, j), defer=True)
        loss.backward()
        store.end()
    linear_weights = {"1.weight", "1.bias", "4.weight"}
    for name, param in model.named_parameters():
        if name in linear_weights:
            assert param.grad is None, f"{name} got its gradient in B"
        else:
            torch.testing.assert_close(param.grad, expected[name], rtol=1e-6, atol=1e-7)
    assert sorted(store.pending_keys()) == [(0, 0), (0, 1), (0, 2)]
    for key in [(0, 2), (0, 0), (0, 1)]:  # any order the schedule says
        store.flush(key)
    assert store.pending_keys() == []
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-6, atol=1e-7)
        assert not param.grad.requires_grad, f"W built an autograd graph into {name}.grad"


def test_fused_mode_returns_weight_gradients_at_once_and_keeps_names():
    model, reference = _model(), _model()
    names_before = list(model.state_dict())
    store = WeightGradStore()
    linears = install_deferral([model], store)
    assert len(linears) == 2 and all(type(m) is nn.Linear for m in linears)
    assert list(model.state_dict()) == names_before
    tokens = _batches(1)
    expected = _reference_grads(reference, tokens)
    store.begin((0, 0), defer=False)
    model(tokens[0]).square().mean().backward()
    store.end()
    assert store.pending_keys() == []
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-6, atol=1e-7)
    remove_deferral(linears)
    assert "forward" not in linears[0].__dict__


def test_input_gradient_of_a_middle_stage_is_exact():
    torch.manual_seed(2)
    layer = nn.Linear(4, 3)
    x = torch.randn(2, 5, 4, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    grad_out = torch.randn(2, 5, 3)
    reference = copy.deepcopy(layer)
    reference(x_ref).backward(grad_out)
    store = WeightGradStore()
    install_deferral([layer], store)
    store.begin((1, 0), defer=True)
    layer(x).backward(grad_out)
    store.end()
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert layer.weight.grad is None
    store.flush((1, 0))
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad)
    torch.testing.assert_close(layer.bias.grad, reference.bias.grad)


def test_no_grad_forward_bypasses_the_store():
    layer = nn.Linear(3, 3)
    store = WeightGradStore()
    install_deferral([layer], store)
    with torch.no_grad():
        out = layer(torch.ones(2, 3))
    assert out.grad_fn is None
