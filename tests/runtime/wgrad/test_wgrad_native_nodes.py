"""B through autograd's own nodes (the fast paths' default) and keyed forwards.

Native nodes give the input gradient in B and a capture hook queues W's work; a first stage's first
Linear still needs the autograd function.  In a keyed forward (the executor's) the norms' alias
parameters take autograd's own accumulation instead of a hook.  Each case is compared with plain
autograd on a copy.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _graphs import node_names
from _split_checks import WIDTH, Gate, GateRule, assert_grads_equal, split_backward, w_after_b
from torch import nn

from zerobubble.runtime.wgrad import WeightGradStore, default_fast_paths, fast, install_deferral


def _stage_with_shared_and_in_place_layers() -> tuple[nn.Sequential, nn.Sequential]:
    """A first stage (input without gradient) whose first Linear is used again later."""
    shared = nn.Linear(WIDTH, WIDTH)
    first = nn.Sequential(
        shared,
        nn.ReLU(inplace=True),
        nn.LayerNorm(WIDTH),
        nn.Linear(WIDTH, WIDTH),
        nn.BatchNorm1d(WIDTH),
        shared,
    )
    norm_first = nn.Sequential(
        nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.GroupNorm(2, WIDTH)
    )
    return first, norm_first


@pytest.mark.parametrize("defer", [True, False], ids=["deferred W", "fused BW"])
def test_autograd_native_nodes_split_exactly_and_the_function_covers_an_input_without_gradient(defer):
    torch.manual_seed(9)
    for model in _stage_with_shared_and_in_place_layers():
        reference = copy.deepcopy(model)
        batches = [torch.randn(5, WIDTH) for _ in range(2)]  # a first stage: no input gradient
        for x in batches:
            reference(x).square().sum().backward()
        store = WeightGradStore()
        install_deferral([model], store)
        losses = [model(x).square().sum() for x in batches]
        names = node_names(losses[0])
        split_nodes = names.count("SplitFunctionBackward")
        # the first layer's input has no gradient: only a first Linear needs the autograd function;
        # every other layer is autograd's own node (LayerNorm on aliases even as the first layer)
        assert split_nodes == (1 if isinstance(model[0], nn.Linear) else 0), names
        assert "NativeLayerNormBackward0" in names
        for j, loss in enumerate(losses):
            store.begin((0, j), defer=defer)
            loss.backward()
            store.end()
        if defer:
            assert all(p.grad is None for p in model.parameters()), "no .grad may be written in B"
            assert sorted(store.pending_keys()) == [(0, 0), (0, 1)]
            store.flush((0, 1))
            store.flush((0, 0))
        assert store.pending_keys() == []
        assert_grads_equal(model, reference)
        for (name, buffer), (_, expected) in zip(model.named_buffers(), reference.named_buffers()):
            torch.testing.assert_close(buffer, expected, rtol=1e-6, atol=0, msg=name)


def test_a_fused_backward_through_native_nodes_twice_with_a_retained_graph_adds_twice():
    torch.manual_seed(10)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH))
    reference = copy.deepcopy(model)
    x = torch.randn(3, WIDTH, requires_grad=True)
    loss = reference(x).square().sum()
    loss.backward(retain_graph=True)
    loss.backward()
    store = WeightGradStore()
    install_deferral([model], store)
    loss = model(x).square().sum()
    store.begin((0, 0), defer=False)
    loss.backward(retain_graph=True)
    loss.backward()
    store.end()
    assert_grads_equal(model, reference)


class _GenericAroundNative(nn.Module):
    """A generic module whose own parameter feeds its fast-path children: its W walks their nodes."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(WIDTH) + 0.5)
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.fc(self.norm(x * self.scale)) * self.scale


def test_generic_w_passing_through_native_nodes_adds_their_gradients_once():
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), _GenericAroundNative())
    reference = copy.deepcopy(model)
    batches = [torch.randn(4, WIDTH) for _ in range(2)]
    for x in batches:
        reference(x).square().sum().backward()
    store = WeightGradStore()
    deferral = install_deferral([model], store)
    assert deferral.summary() == {"fast Linear": 2, "fast LayerNorm": 1, "generic _GenericAroundNative": 1}
    split_backward(model, store, [model(x).square().sum() for x in batches])
    w_after_b(model, store, reference)


class NativeGateRule(GateRule):
    """The same closed form; its forward on a detached gate is autograd's own ``x * sigmoid(gate)``."""

    native_backward = True


def test_a_registered_rule_with_native_backward_runs_b_in_autograd_nodes():
    torch.manual_seed(12)
    paths = default_fast_paths()
    paths.register(Gate, NativeGateRule())
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), Gate())
    reference = copy.deepcopy(model)
    batches = [torch.randn(3, WIDTH) for _ in range(2)]
    for x in batches:
        reference(x).square().sum().backward()
    store = WeightGradStore()
    install_deferral([model], store, paths)
    losses = [model(x).square().sum() for x in batches]
    names = node_names(losses[0])
    assert "MulBackward0" in names and names.count("SplitFunctionBackward") == 1, names  # the Linear's
    split_backward(model, store, losses)
    w_after_b(model, store, reference)


def _norms() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.BatchNorm1d(6), nn.GroupNorm(2, 6))


@pytest.mark.parametrize("defer", [True, False], ids=["B then W", "fused BW"])
def test_norms_in_a_keyed_forward_need_no_hook_and_end_as_plain_autograd(defer, monkeypatch):
    """In a forward between ``begin_forward`` and ``end_forward`` (the executor's) the norms' alias
    parameters get their gradients from autograd's own accumulation and the store hands them to W
    (or adds them at a fused backward's end): no hook on their nodes, the same ``.grad`` and
    parameter hooks, once per microbatch, as plain autograd."""
    torch.manual_seed(9)
    model = _norms()
    reference = copy.deepcopy(model)
    store = WeightGradStore()
    install_deferral([model], store)

    def no_hook(*args):
        raise AssertionError("a norm's node was hooked in a keyed forward")

    monkeypatch.setattr(fast._GradsOfAliases, "__call__", no_hook)
    calls: list[str] = []
    model[1].weight.register_hook(lambda grad: calls.append("hook"))
    model[1].weight.register_post_accumulate_grad_hook(lambda param: calls.append("post"))
    for j in range(2):
        x = torch.randn(5, 4, requires_grad=True)
        reference(x).sin().sum().backward()
        store.begin_forward((0, j))
        out = model(x)
        store.end_forward()
        assert store.pending_keys() == [(0, j)], "the norms left no work for the backward"
        store.begin((0, j), defer=defer)
        out.sin().sum().backward()
        store.end()
        if defer:
            assert model[1].weight.grad is None or j > 0, "B added into .grad"
            store.flush((0, j))
        assert store.pending_keys() == []
    assert calls == ["hook", "post"] * 2
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, expected.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_keyed_forward_without_its_backward_is_pending_until_cleared():
    model = _norms()
    store = WeightGradStore()
    install_deferral([model], store)
    store.begin_forward((0, 0))
    model(torch.randn(5, 4, requires_grad=True))
    store.end_forward()
    assert store.pending_keys() == [(0, 0)]
    store.clear()  # a failed step
    assert store.pending_keys() == []
