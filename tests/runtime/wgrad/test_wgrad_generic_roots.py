"""Where the generic split's B and W start: norm kernels' parameters in B, W from the frontier.

A module split generically (no fast path) runs on a local autograd graph.  Parameters that only
normalisation kernels use get their gradients from B's call of the kernel (one call, not two);
parameters behind expensive nodes get theirs from W starting at the frontier nodes, so W does not
run those nodes' backward a second time.  Each test counts the backward kernels that ran and
compares every gradient with plain autograd on a copy.
"""

from __future__ import annotations

import copy
import gc
import weakref
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from zerobubble.runtime.wgrad import FastPaths, WeightGradStore, install_deferral
from zerobubble.runtime.wgrad import frontier as frontier_module
from zerobubble.runtime.wgrad.frontier import find_frontier
from zerobubble.runtime.wgrad.generic import reachable_leaves

WIDTH = 8
GENERIC = FastPaths()  # an empty registry, no routing: every parameter a leaf of a local graph


class KernelCounter(TorchDispatchMode):
    """Counts the aten calls made while it is active (the autograd engine's too)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


class FunctionalNorms(nn.Module):
    """Normalisation kernels called on the module's own parameters (no fast path applies)."""

    def __init__(self):
        super().__init__()
        self.batch_weight = nn.Parameter(torch.rand(WIDTH) + 0.5)
        self.batch_bias = nn.Parameter(torch.randn(WIDTH))
        self.layer_weight = nn.Parameter(torch.rand(WIDTH) + 0.5)
        self.group_weight = nn.Parameter(torch.rand(WIDTH) + 0.5)
        self.group_bias = nn.Parameter(torch.randn(WIDTH))
        self.register_buffer("running_mean", torch.zeros(WIDTH))
        self.register_buffer("running_var", torch.ones(WIDTH))

    def forward(self, x):
        x = F.batch_norm(x, self.running_mean, self.running_var, self.batch_weight, self.batch_bias, True)
        x = F.layer_norm(torch.tanh(x), (WIDTH,), self.layer_weight)
        return F.group_norm(x.unsqueeze(-1), 2, self.group_weight, self.group_bias).squeeze(-1)


class MatmulBlock(nn.Module):
    """``gelu(x @ w_in) @ w_out``: parameters on both sides of a nonlinearity, not ``F.linear``."""

    def __init__(self, shared: bool = False):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(WIDTH, 2 * WIDTH) / WIDTH**0.5)
        self.w_out = self.w_in if shared else nn.Parameter(torch.randn(2 * WIDTH, WIDTH) / WIDTH**0.5)
        self.shared = shared

    def forward(self, x):
        hidden = F.gelu(x @ self.w_in)
        return hidden @ (self.w_out.t() if self.shared else self.w_out)


def _split_and_compare(model: nn.Module, paths: FastPaths | None, microbatches: int = 2) -> Counter[str]:
    """B of every microbatch, checks that no gradient came early, W; returns the kernels B and W ran."""
    torch.manual_seed(1)
    inputs = [torch.randn(5, WIDTH, requires_grad=True) for _ in range(microbatches)]
    reference = copy.deepcopy(model)
    for x in inputs:
        reference(x.detach()).square().sum().backward()
    store = WeightGradStore()
    install_deferral([model], store, paths)
    outputs = [model(x) for x in inputs]
    counter = KernelCounter()
    with counter:
        for j, out in enumerate(outputs):
            store.begin((0, j), defer=True)
            out.square().sum().backward()
            store.end()
        early = [name for name, p in model.named_parameters() if p.grad is not None]
        for j in range(microbatches):
            store.flush((0, j))
    assert early == [], f"gradients added in B: {early}"
    for (name, param), (_, expected) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(param.grad, expected.grad, rtol=1e-5, atol=1e-7, msg=name)
    for (name, buffer), (_, expected) in zip(model.named_buffers(), reference.named_buffers()):
        torch.testing.assert_close(buffer, expected, rtol=1e-6, atol=0, msg=name)
    return counter.calls


def test_parameters_only_norm_kernels_use_get_their_gradients_from_bs_kernel_call():
    torch.manual_seed(0)
    calls = _split_and_compare(FunctionalNorms(), GENERIC, microbatches=3)
    # one backward kernel call per norm and microbatch, as in a plain backward (not B's and W's)
    assert calls["native_batch_norm_backward"] == 3
    assert calls["native_layer_norm_backward"] == 3
    assert calls["native_group_norm_backward"] == 3


def test_nn_norm_modules_split_generically_make_one_kernel_call_too():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.LayerNorm(WIDTH))
    calls = _split_and_compare(model, GENERIC)  # every module generic
    assert calls["native_batch_norm_backward"] == 2
    assert calls["native_layer_norm_backward"] == 2
    assert calls["mm"] == 2 * 2  # the Linear's input and weight sides, once each per microbatch


def test_w_starts_at_the_frontier_and_runs_no_nonlinearity_twice():
    torch.manual_seed(0)
    calls = _split_and_compare(MatmulBlock(), GENERIC)
    assert calls["gelu_backward"] == 2, "W ran the nonlinearity's backward again to reach w_in"


class LowRank(nn.Module):
    """``x @ a @ b``: two matmuls on parameters and no nonlinearity between them."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(WIDTH, 2) / WIDTH**0.5)
        self.b = nn.Parameter(torch.randn(2, WIDTH))

    def forward(self, x):
        return x @ self.a @ self.b


def test_w_from_the_frontier_does_not_recompute_the_gradient_between_two_matmuls():
    torch.manual_seed(0)
    calls = _split_and_compare(LowRank(), GENERIC)
    # per microbatch: each matmul's input side in B and its weight side in W, as in one backward
    assert calls["mm"] == 2 * 4


class RoutedOnTop(nn.Module):
    """``F.linear(gelu(x.mm(w_in)), w_out)``: the top projection routed, the bottom one a leaf
    (``torch.mm`` is not routed; ``x @ w_in`` would be)."""

    def __init__(self):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(WIDTH, 2 * WIDTH) / WIDTH**0.5)
        self.w_out = nn.Parameter(torch.randn(WIDTH, 2 * WIDTH) / WIDTH**0.5)

    def forward(self, x):
        return F.linear(F.gelu(x.mm(self.w_in)), self.w_out)


def test_a_routed_call_above_the_frontier_is_not_run_again_by_w():
    torch.manual_seed(0)
    calls = _split_and_compare(RoutedOnTop(), None)
    assert calls["gelu_backward"] == 2
    # per microbatch: B's input sides of both projections, W's weight sides (the routed one in closed
    # form: a GEMM into .grad, addmm_, once .grad exists)
    assert calls["mm"] + calls["addmm_"] == 2 * 4


def test_without_gradient_edge_roots_w_starts_from_the_outputs(monkeypatch):
    monkeypatch.setattr(frontier_module, "EDGE_ROOTS", False)
    torch.manual_seed(0)
    calls = _split_and_compare(MatmulBlock(), GENERIC)
    assert calls["gelu_backward"] == 2 * 2  # once in B, once more in W: exact, only slower


def test_a_weight_used_on_both_sides_of_the_frontier_makes_w_start_from_the_outputs():
    torch.manual_seed(0)
    block = MatmulBlock(shared=True)
    x = torch.randn(3, WIDTH, requires_grad=True)
    out = block(x)
    leaves = reachable_leaves([out], [x])
    assert leaves.deferred == [block.w_in] and leaves.graph is not None
    assert find_frontier([out], [x], leaves.deferred, leaves.graph) is None
    calls = _split_and_compare(MatmulBlock(shared=True), GENERIC)
    assert calls["gelu_backward"] == 2 * 2


class ReturnsItsScale(MatmulBlock):
    """Returns one of its parameters as it is, next to the projection: no node leads to it."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(WIDTH) + 0.5)

    def forward(self, x):
        return super().forward(x), self.scale


def test_a_parameter_returned_as_it_is_still_gets_its_gradient():
    torch.manual_seed(0)
    model = ReturnsItsScale()
    reference = copy.deepcopy(model)
    store = WeightGradStore()
    install_deferral([model], store, GENERIC)
    x = torch.randn(3, WIDTH, requires_grad=True)
    out, scale = reference(x.detach())
    (out * scale).sum().backward()
    out, scale = model(x)
    store.begin((0, 0), defer=True)
    (out * scale).sum().backward()
    store.end()
    assert all(p.grad is None for p in model.parameters())
    store.flush((0, 0))
    for (name, param), (_, expected) in zip(model.named_parameters(), reference.named_parameters()):
        assert param.grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(param.grad, expected.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_frontier_roots_compose_with_checkpointing():
    torch.manual_seed(0)

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = MatmulBlock()

        def forward(self, x):
            return checkpoint(self.block, x, use_reentrant=False)

    calls = _split_and_compare(Checkpointed(), GENERIC)
    assert calls["gelu_backward"] == 2
    assert calls["gelu"] == 2, "B recomputes the checkpointed forward once per microbatch"


class _RecordingBlock(MatmulBlock):
    """Keeps weak references to its pre-activation (saved below the frontier, by the gelu) and to
    the projection squared at the end (saved above it), which only the local graph holds on to."""

    def forward(self, x):
        pre = x @ self.w_in
        self.pre_activation = weakref.ref(pre)
        top = F.gelu(pre) @ self.w_out
        self.projection = weakref.ref(top)
        return top * top


def test_a_forward_without_backward_frees_the_local_graph_without_the_garbage_collector():
    torch.manual_seed(0)
    block = _RecordingBlock()
    install_deferral([block], WeightGradStore(), GENERIC)
    x = torch.randn(3, WIDTH, requires_grad=True)
    gc.disable()
    try:
        out = block(x)
        assert block.pre_activation() is not None
        del out
        assert block.pre_activation() is None, "a reference cycle keeps the local graph alive"
    finally:
        gc.enable()


@pytest.mark.parametrize("shared", [False, True])
def test_fused_backward_through_a_frontier_module_adds_every_gradient_once(shared):
    torch.manual_seed(0)
    model, reference = MatmulBlock(shared), None
    reference = copy.deepcopy(model)
    store = WeightGradStore()
    install_deferral([model], store, GENERIC)
    x = torch.randn(4, WIDTH)
    for _ in range(2):
        store.begin((0, 0), defer=False)
        model(x).square().sum().backward()
        store.end()
        reference(x).square().sum().backward()
    assert store.pending_keys() == []
    for (name, param), (_, expected) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(param.grad, expected.grad, rtol=1e-5, atol=1e-7, msg=name)


def _b_of_one_microbatch(block: nn.Module) -> WeightGradStore:
    """Splits ``block`` (default fast paths) and runs B of one microbatch; W is left to the caller."""
    store = WeightGradStore()
    install_deferral([block], store, GENERIC)
    loss = block(torch.randn(3, WIDTH, requires_grad=True)).square().sum()
    store.begin((0, 0), defer=True)
    loss.backward()
    store.end()
    return store


def test_w_from_the_frontier_frees_what_b_kept():
    torch.manual_seed(0)
    block = _RecordingBlock()
    gc.disable()
    try:
        store = _b_of_one_microbatch(block)
        assert block.pre_activation() is not None, "W starts below the nonlinearity that saved it"
        assert block.projection() is None, "B must free the nodes above the frontier"
        store.flush((0, 0))
        assert block.pre_activation() is None, "W must free what B kept for it"
    finally:
        gc.enable()
    assert block.w_in.grad is not None and block.w_out.grad is not None


def test_the_store_reports_what_frontier_work_holds_and_no_parameter_as_held_by_w():
    torch.manual_seed(0)
    store = _b_of_one_microbatch(MatmulBlock())
    held = store.held_tensors((0, 0))
    # the frontier's kept gradients (one per frontier node) are what the memory meter must see
    assert any(t.shape == (3, 2 * WIDTH) for t in held) and any(t.shape == (3, WIDTH) for t in held)
    store.flush((0, 0))
    assert store.held_tensors() == []


def test_the_profile_counts_no_parameter_as_kept_for_w():
    from zerobubble.runtime.construct.profile import profile_layers

    torch.manual_seed(0)
    layers = [MatmulBlock(), nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH))]
    profile = profile_layers(layers, torch.randn(4, WIDTH), repeats=1)
    parameter_bytes = sum(p.numel() * 4 for p in layers[0].parameters())
    # gelu(x @ w_in) @ w_out keeps for W: the input, the hidden activation and two kept gradients
    assert 0 < profile.layers[0].weight_input_bytes < parameter_bytes


class RawBlockLike(nn.Module):
    """Attention and an MLP on raw parameters, with a functional layer norm (frontier and norm in B)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.Parameter(torch.rand(WIDTH) + 0.5)
        self.qkv = nn.Parameter(torch.randn(WIDTH, 3 * WIDTH) / WIDTH**0.5)
        self.up = nn.Parameter(torch.randn(WIDTH, 2 * WIDTH) / WIDTH**0.5)
        self.down = nn.Parameter(torch.randn(2 * WIDTH, WIDTH) / WIDTH**0.5)

    def forward(self, x):
        q, k, v = (F.layer_norm(x, (WIDTH,), self.norm) @ self.qkv).split(WIDTH, dim=-1)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + F.gelu(x @ self.up) @ self.down


def test_frontier_roots_under_autocast_give_float32_gradients_close_to_autograd():
    torch.manual_seed(0)
    model = RawBlockLike()
    reference = copy.deepcopy(model)
    store = WeightGradStore()
    install_deferral([model], store, GENERIC)
    inputs = [torch.randn(2, 5, WIDTH, requires_grad=True) for _ in range(2)]
    counter = KernelCounter()
    for j, x in enumerate(inputs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = reference(x.detach()).float().square().sum()
            loss = model(x).float().square().sum()
        expected.backward()
        with counter:
            store.begin((0, j), defer=True)
            loss.backward()
            store.end()
    assert all(p.grad is None for p in model.parameters())
    with counter:
        for j in range(len(inputs)):
            store.flush((0, j))
    assert counter.calls["gelu_backward"] == 2, "W started from the outputs"
    for (name, param), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        assert param.grad is not None and param.grad.dtype == torch.float32, name
        torch.testing.assert_close(param.grad, ref.grad, rtol=2e-2, atol=2e-2, msg=name)
