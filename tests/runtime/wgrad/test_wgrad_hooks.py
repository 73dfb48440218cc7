"""Parameter hooks under the B/W split: they run as a plain backward runs them.

``register_hook`` hooks see (and may replace) a parameter's gradient before it is added into
``.grad``; ``register_post_accumulate_grad_hook`` hooks run after (optimizer-in-backward and
gradient offloading rely on them).  Every split path — fast paths, routed ``F.linear``, the generic
split's W, parameters only norm kernels use — must run both once per microbatch, never with a
missing gradient, and the post-accumulate ones only once ``.grad`` holds the microbatch's gradient.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zerobubble.runtime.wgrad import FastPaths, WeightGradStore, install_deferral

WIDTH = 8


class MixedStage(nn.Module):
    """One module of each split path: a fast-path Linear and Conv1d, an ``nn.LayerNorm``, a block on
    raw parameters (functional norm, ``x @ weight``, a bias added) and an ``F.linear`` call."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.norm_weight = nn.Parameter(torch.rand(WIDTH) + 0.5)
        self.up = nn.Parameter(torch.randn(WIDTH, 2 * WIDTH) / WIDTH**0.5)
        self.up_bias = nn.Parameter(torch.randn(2 * WIDTH))
        self.down = nn.Parameter(torch.randn(WIDTH, 2 * WIDTH) / WIDTH**0.5)
        self.conv = nn.Conv1d(WIDTH, WIDTH, 1)

    def forward(self, x):
        h = self.norm(self.linear(x))
        h = F.layer_norm(h, (WIDTH,), self.norm_weight)
        h = F.linear(F.gelu(h @ self.up + self.up_bias), self.down)
        return self.conv(h.transpose(1, 2)).transpose(1, 2)


def _hook_everything(model: nn.Module, calls: Counter[str], snapshots: dict[str, list[torch.Tensor]]) -> None:
    """Double every gradient before it is added; count and record ``.grad`` after each addition."""
    for name, param in model.named_parameters():
        param.register_hook(lambda grad: grad * 2)  # fails on a missing (None) gradient

        def after(param: torch.Tensor, name: str = name) -> None:
            calls[name] += 1
            snapshots.setdefault(name, []).append(param.grad.clone())

        param.register_post_accumulate_grad_hook(after)


@pytest.mark.parametrize("paths", [None, FastPaths()], ids=["fast paths", "generic only"])
@pytest.mark.parametrize("defer", [True, False], ids=["B then W", "fused BW"])
def test_parameter_hooks_run_once_per_microbatch_as_in_a_plain_backward(paths, defer):
    torch.manual_seed(0)
    reference = MixedStage()
    model = copy.deepcopy(reference)
    store = WeightGradStore()
    install_deferral([model], store, paths)
    expected_calls: Counter[str] = Counter()
    expected_snapshots: dict[str, list[torch.Tensor]] = {}
    calls: Counter[str] = Counter()
    snapshots: dict[str, list[torch.Tensor]] = {}
    _hook_everything(reference, expected_calls, expected_snapshots)
    _hook_everything(model, calls, snapshots)
    inputs = [torch.randn(2, 5, WIDTH, requires_grad=True) for _ in range(2)]
    for x in inputs:
        reference(x.detach()).square().sum().backward()
    for j, x in enumerate(inputs):
        out = model(x)
        store.begin((0, j), defer=defer)
        out.square().sum().backward()
        store.end()
        if defer:
            assert calls == Counter({name: j for name, _ in model.named_parameters()}), "hooks ran in B"
            store.flush((0, j))
        assert calls == Counter({name: j + 1 for name, _ in model.named_parameters()})
    assert calls == expected_calls
    for name, param in model.named_parameters():
        expected = dict(reference.named_parameters())[name]
        torch.testing.assert_close(param.grad, expected.grad, rtol=1e-5, atol=1e-6, msg=name)
        for got, want in zip(snapshots[name], expected_snapshots[name]):  # .grad after each microbatch
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("requires_grad", [True, False], ids=["middle stage", "first stage"])
def test_a_fast_path_node_takes_no_parameter_as_input(requires_grad):
    """As for the bridge below: the function node a first stage's fast path builds (its input needs
    no gradient) and one under saved-tensor hooks take the input or the keeper, nothing else."""
    linear = nn.Linear(WIDTH, WIDTH)
    store = WeightGradStore()
    install_deferral([linear], store)
    x = torch.randn(3, WIDTH, requires_grad=requires_grad)
    with torch.autograd.graph.save_on_cpu():  # saved-tensor hooks: the function, not the native node
        out = linear(x)
    assert type(out.grad_fn).__name__ == "SplitFunctionBackward"
    edges = [node for node, _ in out.grad_fn.next_functions if node is not None]
    assert len(edges) == 1
    assert edges[0].variable is (x if requires_grad else store.keeper(x.device))


@pytest.mark.parametrize("requires_grad", [True, False], ids=["middle stage", "first stage"])
def test_the_bridge_joins_only_the_arguments_not_the_parameters(requires_grad):
    """Each edge of the bridge costs the stage's backward a node task; a parameter edge would also
    run the parameter's hooks in B with no gradient.  A first stage's bridge takes the store's
    keeper instead, only so that its output requires grad and B reaches it."""
    model = MixedStage()
    store = WeightGradStore()
    install_deferral([model], store, FastPaths())  # the whole stage: one local graph
    x = torch.randn(2, 5, WIDTH, requires_grad=requires_grad)
    out = model(x)
    assert type(out.grad_fn).__name__ == "BridgeBackward"
    edges = [node for node, _ in out.grad_fn.next_functions if node is not None]
    assert len(edges) == 1
    if requires_grad:
        assert edges[0].variable is x
    else:
        assert edges[0].variable is store.keeper(x.device)


class TiedInOneModule(nn.Module):
    """One module using its weight as an embedding table and, tied, as the output projection
    (``F.linear``, routed): the weight is both a leaf of the local graph and a routed weight."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(11, WIDTH))
        self.scale = nn.Parameter(torch.rand(WIDTH) + 0.5)

    def forward(self, tokens):
        return F.linear(F.embedding(tokens, self.weight) * self.scale, self.weight)


@pytest.mark.parametrize("defer", [True, False], ids=["B then W", "fused BW"])
def test_hooks_of_a_weight_both_routed_and_a_leaf_run_once_per_microbatch(defer):
    torch.manual_seed(0)
    reference = TiedInOneModule()
    model = copy.deepcopy(reference)
    store = WeightGradStore()
    install_deferral([model], store)
    expected_calls: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    _hook_everything(reference, expected_calls, {})
    _hook_everything(model, calls, {})
    batches = [torch.randint(0, 11, (2, 5)) for _ in range(2)]
    for j, tokens in enumerate(batches):
        reference(tokens).square().mean().backward()
        out = model(tokens)
        store.begin((0, j), defer=defer)
        out.square().mean().backward()
        store.end()
        store.flush((0, j))
    for name, param in model.named_parameters():
        expected = dict(reference.named_parameters())[name]
        torch.testing.assert_close(param.grad, expected.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert expected_calls == Counter({"weight": 2, "scale": 2})
    # a plain backward sums the weight's two uses before its hooks run; the store gathers the routed
    # use's piece and the local graph's and runs the hooks once on their sum, as autograd does
    assert calls == expected_calls


def test_register_hook_hooks_run_in_w_only():
    """Never in B, even for the parameters only normalisation kernels use (B's kernel call computes
    their gradients, which wait for W): every hook once in W."""
    torch.manual_seed(0)
    model = MixedStage()
    store = WeightGradStore()
    install_deferral([model], store, FastPaths())  # generic only: the norms' parameters are in_b
    seen: Counter[str] = Counter()
    for name, param in model.named_parameters():
        param.register_hook(lambda grad, name=name: seen.update([name]))
    out = model(torch.randn(2, 5, WIDTH, requires_grad=True))
    store.begin((0, 0), defer=True)
    out.square().sum().backward()
    store.end()
    assert seen == Counter()
    assert all(param.grad is None for param in model.parameters())
    store.flush((0, 0))
    assert seen == Counter({name: 1 for name, _ in model.named_parameters()})
