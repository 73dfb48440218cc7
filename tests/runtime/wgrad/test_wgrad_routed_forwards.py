"""Routed modules across forwards, B and W: later forwards on the stage's graph, a module routing in
one forward and not in another, a reentrant recomputation inside B, and what changes in place between
the forward, B and W (refused as autograd refuses it, or harmless to W).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _graphs import node_names
from _routing import GENERIC_ROUTED, WIDTH, SelfAttention, attention_loss, check_split, hidden
from torch import nn
from torch.utils.checkpoint import checkpoint

from zerobubble.runtime.wgrad import WeightGradStore, install_deferral


def test_a_fully_routed_module_runs_later_forwards_on_the_stage_graph():
    """``nn.MultiheadAttention``: every parameter behind a routed call, so after its first forward
    (a local graph without leaves) no bridge, no nested engine run; B still leaves every gradient
    to W, and W gives plain autograd's."""
    torch.manual_seed(0)
    model = SelfAttention(True, True)
    batches = hidden(3)
    reference = copy.deepcopy(model)
    store = WeightGradStore()
    deferral = install_deferral([model], store)
    bridges = []
    for j, (x,) in enumerate(batches):
        attention_loss(reference(x.detach().requires_grad_())).backward()
        out = model(x)
        bridges.append(node_names(out[0]).count("BridgeBackward"))
        store.begin((0, j), defer=True)
        attention_loss(out).backward()
        store.end()
        assert all(p.grad is None for p in model.parameters()), "B computed a parameter gradient"
    assert bridges == [1, 0, 0]
    assert deferral.direct == {id(model.attention)}
    for j in range(len(batches)):
        store.flush((0, j))
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, expected.grad, rtol=1e-5, atol=1e-7, msg=name)


class _ScaledSometimes(nn.Module):
    """A routed projection, times ``exp(scale)`` (a parameter used as it is) when ``scaled``."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)
        self.scale = nn.Parameter(torch.rand(WIDTH) + 0.5)
        self.scaled = False

    def forward(self, x):
        y = F.linear(x, self.weight)
        return y * self.scale.exp() if self.scaled else y


def test_a_direct_forward_using_a_parameter_as_it_is_stays_exact_and_builds_local_graphs_again():
    """The first forward routes everything (later ones run on the stage's graph); the second uses
    ``scale`` directly: B computes that gradient (exact, not deferred) and the module takes local
    graphs again, in which W defers ``scale`` as usual."""
    torch.manual_seed(0)
    model = _ScaledSometimes()
    reference = copy.deepcopy(model)
    store = WeightGradStore()
    deferral = install_deferral([model], store)
    scale_in_b, bridges = [], []
    for j, (x,) in enumerate(hidden(3)):
        model.scaled = reference.scaled = j > 0
        reference(x.detach()).square().sum().backward()
        out = model(x)
        bridges.append(node_names(out).count("BridgeBackward"))
        before = None if model.scale.grad is None else model.scale.grad.clone()
        store.begin((0, j), defer=True)
        out.square().sum().backward()
        store.end()
        after = model.scale.grad
        scale_in_b.append(not (after is None or (before is not None and torch.equal(before, after))))
    for j in range(3):
        store.flush((0, j))
    assert bridges == [1, 0, 1]
    assert scale_in_b == [False, True, False]
    assert deferral.direct == set()
    for name in ("weight", "scale"):
        expected = getattr(reference, name).grad
        torch.testing.assert_close(getattr(model, name).grad, expected, rtol=1e-5, atol=1e-7, msg=name)


class _Branching(nn.Module):
    """Its own weight's first row as a scale first (nothing to route); ``F.linear`` on the weight
    only when ``linear`` is set.

    Records whether the routing mode was active in each forward.
    """

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)
        self.linear = False
        self.routing_seen: list[bool] = []

    def forward(self, x):
        from zerobubble.runtime.wgrad.routed import LinearRouter

        stack = torch.overrides._get_current_function_mode_stack()
        self.routing_seen.append(any(isinstance(mode, LinearRouter) for mode in stack))
        y = torch.tanh(x * self.weight[0])
        return F.linear(y, self.weight) if self.linear else y


def test_a_module_whose_first_forward_routed_nothing_is_not_routed_again_and_stays_exact():
    torch.manual_seed(0)
    model = _Branching()
    reference = copy.deepcopy(model)
    store = WeightGradStore()
    deferral = install_deferral([model], store, GENERIC_ROUTED)
    for j, (x,) in enumerate(hidden(3)):
        model.linear = reference.linear = j > 0  # the first forward has no F.linear to route
        reference(x.detach()).square().sum().backward()
        loss = model(x).square().sum()
        store.begin((0, j), defer=True)
        loss.backward()
        store.end()
    assert model.weight.grad is None, "B computed the weight's gradient"
    for j in range(3):
        store.flush((0, j))
    # the later F.linear calls were split generically: exact, without the mode's cost per torch call
    torch.testing.assert_close(model.weight.grad, reference.weight.grad, rtol=1e-5, atol=1e-7)
    assert model.routing_seen == [True, False, False]
    assert deferral.summary() == {"generic _Branching": 1}


def test_a_module_that_routed_a_call_stays_routed():
    torch.manual_seed(0)
    model = _Branching()
    model.linear = True
    deferral, _, _ = check_split(model, hidden(3), lambda out: out.square().sum(), GENERIC_ROUTED)
    assert model.routing_seen == [True] * 3
    assert deferral.summary() == {"generic+linear _Branching": 1}


@pytest.mark.parametrize("block", ["attention", "raw"])
def test_reentrant_checkpointing_of_a_module_on_the_stage_graph_stays_exact_and_deferred(block):
    """``checkpoint(use_reentrant=True)`` runs the forward without grad, then again inside B: the
    routed calls of that recomputation queue their W work in B, as any other B does."""
    from zerobubble_demo.split_models import AttentionBlock, RawBlock

    torch.manual_seed(21)
    inner = AttentionBlock(WIDTH, heads=2) if block == "attention" else RawBlock(WIDTH, heads=2)

    class Reentrant(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=True)

    check_split(Reentrant(), hidden(3), lambda out: out.square().mean())


@pytest.mark.parametrize("defer", [True, False], ids=["B then W", "fused BW"])
def test_an_input_modified_in_place_after_the_forward_is_refused_as_autograd_refuses_it(defer):
    torch.manual_seed(18)
    reference = nn.Linear(WIDTH, WIDTH)
    x = torch.randn(3, WIDTH, requires_grad=True)
    h = x * 1
    out = reference(h)
    h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    model = copy.deepcopy(reference)
    store = WeightGradStore()
    install_deferral([model], store)
    h = x * 1
    out = model(h)
    h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an in-place operation after the forward"):
        store.begin((0, 0), defer=defer)
        try:
            out.sum().backward()
        finally:
            store.end()
        store.flush((0, 0))


def test_an_activation_a_routed_scale_needs_modified_in_place_is_refused():
    """``shifted * scale`` keeps ``shifted`` for the scale's gradient: changing it in place afterwards
    fails as in a plain backward (where the product's node saved it), not with a wrong gradient."""

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.rand(WIDTH) + 0.5)

        def forward(self, h):
            shifted = h + 1  # an activation of the module's own, which it may change in place
            out = shifted * self.scale
            shifted.mul_(2.0)
            return out

    torch.manual_seed(23)
    reference = Scaled()
    x = torch.randn(3, WIDTH, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        reference(x * 1).sum().backward()
    model = copy.deepcopy(reference)
    store = WeightGradStore()
    install_deferral([model], store)
    out = model(x * 1)
    store.begin((0, 0), defer=True)
    out.sum().backward()
    store.end()
    with pytest.raises(RuntimeError, match="modified by an in-place operation after the forward"):
        store.flush((0, 0))


def test_a_generic_module_changing_its_argument_in_place_gets_a_clear_error():
    class Doubling(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH))

        def forward(self, x):
            x.mul_(2.0)
            return F.linear(x, self.weight)

    model = Doubling()
    install_deferral([model], WeightGradStore())
    x = torch.randn(3, WIDTH, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"Doubling.forward changed a leaf .* in place.*out-of-place op"):
        model(x * 1)


@pytest.mark.parametrize("layer", ["nn.Linear", "nn.Conv2d"])
def test_a_parameter_changed_between_b_and_w_leaves_w_exact(layer):
    """W reads the saved activations and the output gradient, never a parameter's values: a weight
    stepped between B and W (an earlier microbatch's optimizer-in-backward hook) is not refused,
    and the gradient is the one of the forward's weight."""
    torch.manual_seed(24)
    reference = nn.Linear(WIDTH, WIDTH) if layer == "nn.Linear" else nn.Conv2d(3, 4, 3, padding=1)
    model = copy.deepcopy(reference)
    x = torch.randn(2, WIDTH) if layer == "nn.Linear" else torch.randn(2, 3, 5, 5)
    reference((x * 1).requires_grad_()).square().sum().backward()
    store = WeightGradStore()
    install_deferral([model], store)
    out = model((x * 1).requires_grad_())
    store.begin((0, 0), defer=True)
    out.square().sum().backward()
    store.end()
    with torch.no_grad():
        model.weight.add_(1.0)
    store.flush((0, 0))
    torch.testing.assert_close(model.weight.grad, reference.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.bias.grad, reference.bias.grad, rtol=1e-5, atol=1e-6)
