"""``F.linear`` on leaf weights inside generically split modules: the routed closed-form split.

Each case runs B per microbatch (no parameter may get a gradient), then the W ops, and compares the
loss, the input gradients and every parameter gradient with plain autograd on a copy.  That the
routed path was taken is read off the autograd graph: the bridge joining a module's local graph
to the stage's has an edge for every leaf W must walk, so a module whose projections were all
routed has no edge to a parameter (W then runs no engine), and ``Deferral.summary`` says
``generic+linear``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from _graphs import node_names
from zerobubble.runtime.wgrad import FastPaths, WeightGradStore, install_deferral, routed

WIDTH = 8
VOCAB = 11
GENERIC_ROUTED = FastPaths(route_linear=True)  # no rules: nn.Linear children run inside generic modules


def _local_graph(output: Any) -> Any:
    """The LocalGraph behind ``output`` (its first tensor), or None if no bridge produced it."""
    first = next(t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor))
    if first.grad_fn is None or type(first.grad_fn).__name__ != "BridgeBackward":
        return None
    return first.grad_fn.local  # the bridge's context holds the LocalGraph


def _local_leaves(output: Any, model: nn.Module) -> set[str] | None:
    """Names of ``model``'s parameters the local graph behind ``output`` (its first tensor) gets
    gradients for from autograd (in W, or in B's kernel call for norms) rather than from a routed
    closed form; None if no bridge produced it.  Read before B, which lets go of the local graph."""
    local = _local_graph(output)
    if local is None:
        return None
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(leaf)] for leaf in (*local.leaves, *local.in_b) if id(leaf) in names}


def _check_split(
    model: nn.Module,
    batches: list[tuple],
    loss_fn: Callable[..., torch.Tensor],
    paths: FastPaths | None = None,
    defer: bool = True,
    autocast: bool = False,
    tolerance: float = 1e-5,
    keyed: bool = False,
):
    """B then W (``defer``) or fused BW per microbatch against plain autograd; returns the deferral,
    the outputs of the split model's last forward and :func:`_local_leaves` of the first forward's.
    ``keyed``: each forward runs between ``begin_forward`` and ``end_forward``, as the executor's.

    A module whose first forward routed a call and left no leaves for W (norm-only parameters
    aside) may run its later forwards without a local graph (no bridge); otherwise every forward
    has the first one's leaves."""
    reference = copy.deepcopy(model)
    reference_batches = [_clone_inputs(batch) for batch in batches]
    expected_losses = []
    for batch in reference_batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = reference(*batch)
        loss = loss_fn(out)
        loss.backward()
        expected_losses.append(loss.detach())
    store = WeightGradStore()
    deferral = install_deferral([model], store, paths)
    losses, out, leaves_per_call, first_local = [], None, [], None
    for j, batch in enumerate(batches):
        if keyed:
            store.begin_forward((0, j))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(*batch)
        store.end_forward()
        loss = loss_fn(out)
        leaves_per_call.append(_local_leaves(out, model))
        first_local = _local_graph(out) if j == 0 else first_local
        store.begin((0, j), defer=defer)
        loss.backward()
        store.end()
        losses.append(loss.detach())
    if defer:
        early = [name for name, p in model.named_parameters() if p.grad is not None]
        assert early == [], f"gradients computed in B: {early}"
        for key in reversed(store.pending_keys()):
            store.flush(key)
    assert store.pending_keys() == []
    rtol, atol = (1.6e-2, 1e-3) if autocast else (tolerance, 1e-7)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected_losses), rtol=rtol, atol=atol)
    for batch, expected in zip(batches, reference_batches):
        for x, x_ref in zip(batch, expected):
            if isinstance(x, torch.Tensor) and x.requires_grad:
                torch.testing.assert_close(x.grad, x_ref.grad, rtol=rtol, atol=atol)
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{name} got no gradient"
        assert param.grad.dtype == param.dtype and not param.grad.requires_grad
        torch.testing.assert_close(param.grad, reference_params[name].grad, rtol=rtol, atol=atol, msg=name)
    leaves = leaves_per_call[0]
    direct_allowed = first_local is not None and not first_local.leaves
    later = [leaves, None] if direct_allowed else [leaves]
    assert all(each in later for each in leaves_per_call[1:]), leaves_per_call
    return deferral, out, leaves


def _clone_inputs(batch: tuple) -> tuple:
    return tuple(
        x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
        for x in batch
    )


def _hidden(
    count: int = 2, shape: tuple[int, ...] = (3, 5, WIDTH), requires_grad: bool = True
) -> list[tuple]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(*shape, generator=generator).requires_grad_(requires_grad),) for _ in range(count)]


class SelfAttention(nn.Module):
    """``nn.MultiheadAttention`` called as self-attention, returning the output and the weights."""

    def __init__(self, bias: bool, batch_first: bool):
        super().__init__()
        self.attention = nn.MultiheadAttention(WIDTH, 2, bias=bias, batch_first=batch_first)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        out, weights = self.attention(x, x, x)
        return out, weights


def _attention_loss(out):
    values, weights = out
    return values.square().mean() + weights.square().sum()


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_multihead_attention_projections_are_routed_and_exact(bias, batch_first):
    torch.manual_seed(0)
    model = SelfAttention(bias, batch_first)
    deferral, _, leaves = _check_split(model, _hidden(), _attention_loss)
    assert deferral.summary()["generic+linear MultiheadAttention"] == 1
    assert leaves == set(), "W would walk the attention's local graph again"


@pytest.mark.parametrize("defer", [True, False], ids=["B then W", "fused BW"])
def test_multihead_attention_cross_attention_and_kdim_route_what_is_a_leaf(defer):
    """Separate key/value dimensions: the q/k/v weights are leaves (routed) and their biases are
    slices of ``in_proj_bias`` (not leaves: added after the routed product, gradient through W's walk)."""

    class Cross(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = nn.MultiheadAttention(WIDTH, 2, kdim=6, vdim=4, batch_first=True)

        def forward(self, query, key, value):
            return self.attention(query, key, value, need_weights=False)[0]

    torch.manual_seed(1)
    model = Cross()
    generator = torch.Generator().manual_seed(4)
    batches = [
        tuple(
            torch.randn(2, n, d, generator=generator, requires_grad=True)
            for n, d in ((5, WIDTH), (3, 6), (3, 4))
        )
        for _ in range(2)
    ]
    _, _, leaves = _check_split(model, batches, lambda out: out.square().mean(), defer=defer)
    if defer:
        assert leaves == {"attention.in_proj_bias"}


class TiedHead(nn.Module):
    """A language-model head tied to an embedding owned by another module."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.norm_weight = nn.Parameter(torch.rand(WIDTH) + 0.5)
        self.embedding = [embedding]  # not a child: the weight belongs to the embedding module

    def forward(self, h):
        return F.linear(h * self.norm_weight, self.embedding[0].weight)


class TiedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = TiedHead(self.embed)

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def _tokens(count: int = 2) -> list[tuple]:
    generator = torch.Generator().manual_seed(5)
    return [(torch.randint(VOCAB, (3, 6), generator=generator),) for _ in range(count)]


@pytest.mark.parametrize("defer", [True, False], ids=["B then W", "fused BW"])
def test_tied_head_routes_the_embedding_weight_and_both_uses_accumulate(defer):
    torch.manual_seed(2)
    model = TiedModel()
    deferral, _, leaves = _check_split(model, _tokens(), lambda out: out.square().mean(), defer=defer)
    assert deferral.summary()["generic+linear TiedHead"] == 1
    # the head's scale (a product with its own leaf) and the tied weight are both routed: no leaves,
    # and the later forwards build no local graph
    assert leaves == set()
    assert _local_leaves(model.head(torch.randn(2, WIDTH, requires_grad=True)), model) is None


class TwiceUsed(nn.Module):
    """One parameter in two ``F.linear`` calls of one forward (both gradients must add up)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)
        self.bias = nn.Parameter(torch.randn(WIDTH) * 0.1)

    def forward(self, x):
        return F.linear(torch.tanh(F.linear(x, self.weight, self.bias)), self.weight, bias=self.bias) * 2


def test_a_parameter_used_twice_gets_both_gradients():
    torch.manual_seed(3)
    model = TwiceUsed()
    deferral, _, leaves = _check_split(model, _hidden(), lambda out: out.sin().sum())
    assert deferral.summary() == {"generic+linear TwiceUsed": 1}
    assert leaves == set()


def test_an_empty_registry_is_the_generic_split_alone():
    torch.manual_seed(3)
    model = TwiceUsed()
    deferral, _, leaves = _check_split(model, _hidden(), lambda out: out.sin().sum(), paths=FastPaths())
    assert deferral.summary() == {"generic TwiceUsed": 1}
    assert leaves == {"weight", "bias"}


@pytest.mark.parametrize("requires_grad", [True, False], ids=["middle stage", "first stage"])
def test_a_module_of_only_routed_projections_splits_when_its_input_needs_no_gradient(requires_grad):
    """A first stage: nothing the bridge joins requires grad but the routed weights themselves."""
    torch.manual_seed(4)
    model = TwiceUsed()
    _, out, leaves = _check_split(model, _hidden(requires_grad=requires_grad), lambda out: out.square().sum())
    assert out.requires_grad and leaves == set()


class OwnEmbeddingHead(nn.Module):
    """A weight used both through an embedding (a leaf W walks to) and a routed ``F.linear``.

    W's engine run passes the routed node again on its way to the embedding: the weight work it
    queued in B must not be added a second time.
    """

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, WIDTH))

    def forward(self, tokens):
        return F.linear(torch.tanh(F.embedding(tokens, self.weight)), self.weight)


def test_a_weight_reached_through_a_leaf_and_a_routed_call_is_not_counted_twice():
    torch.manual_seed(5)
    model = OwnEmbeddingHead()
    _, _, leaves = _check_split(model, _tokens(3), lambda out: out.square().mean())
    assert leaves == {"weight"}  # the embedding's use: W's walk


class Parametrized(nn.Module):
    """A parametrized weight (not a leaf: stays generic), a bias computed from two parameters
    (routed weight, bias added after), and a weight the caller passes in (not routed)."""

    def __init__(self):
        super().__init__()
        self.projection = nn.Linear(WIDTH, WIDTH)
        torch.nn.utils.parametrize.register_parametrization(self.projection, "weight", _Symmetric())
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)
        self.bias_a = nn.Parameter(torch.randn(WIDTH))
        self.bias_b = nn.Parameter(torch.randn(WIDTH))

    def forward(self, x, passed):
        x = F.linear(x, self.projection.weight, self.projection.bias)
        x = F.linear(torch.tanh(x), self.weight, self.bias_a * self.bias_b)
        return F.linear(x, passed)


class _Symmetric(nn.Module):
    def forward(self, weight):
        return weight.triu() + weight.triu(1).t()


def test_parametrized_weights_non_leaf_biases_and_passed_weights_stay_exact():
    torch.manual_seed(6)

    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Parametrized()
            self.passed = nn.Parameter(torch.randn(WIDTH, WIDTH))

        def forward(self, x):
            return self.inner(x, self.passed)

    model = Owner()
    _, _, leaves = _check_split(model, _hidden(), lambda out: out.square().mean())
    assert "inner.weight" not in leaves, "a leaf weight with a computed bias is still routed"
    # a product of two parameters is no scale on an activation: both stay leaves
    assert {"inner.projection.parametrizations.weight.original", "inner.bias_a", "inner.bias_b"} <= leaves


def test_no_grad_inside_the_forward_is_not_routed():
    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH))

        def forward(self, x):
            with torch.no_grad():
                shift = F.linear(x, self.weight).mean()
            return F.linear(x - shift, self.weight)

    torch.manual_seed(7)
    _check_split(Frozen(), _hidden(), lambda out: out.square().mean())


class NestedBlock(nn.Module):
    """A generic module around a generic-only child: the child's ``F.linear`` joins the outer graph."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(WIDTH) + 0.5)
        self.norm = nn.LayerNorm(WIDTH)
        self.inner = nn.Linear(WIDTH, WIDTH)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + self.inner(torch.relu(self.norm(x))) * self.scale


def test_nested_generic_modules_route_into_the_outer_local_graph():
    torch.manual_seed(8)
    model = NestedBlock()
    deferral, _, leaves = _check_split(model, _hidden(), lambda y: y.square().mean(), paths=GENERIC_ROUTED)
    assert deferral.summary() == {"generic+linear NestedBlock": 1}
    assert leaves == {"norm.weight", "norm.bias"}  # the scale is routed, the norm's are B's


@pytest.mark.parametrize("module", ["attention", "nested"])
def test_checkpointing_recomputes_once_and_keeps_routed_w_deferred(module):
    torch.manual_seed(9)
    inner = SelfAttention(True, True) if module == "attention" else NestedBlock()

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            out = checkpoint(self.inner, x, use_reentrant=False)
            return out[0] if isinstance(out, tuple) else out

    model = Checkpointed()
    batches = _hidden()
    paths = None if module == "attention" else GENERIC_ROUTED
    _, _, leaves = _check_split(model, batches, lambda out: out.square().mean(), paths=paths)
    # one forward and one recomputation in B per microbatch; none in W (it reads what B unpacked)
    assert model.inner.calls == 2 * len(batches)
    routed_only = {"attention": set(), "nested": {"inner.norm.weight", "inner.norm.bias"}}
    assert leaves == routed_only[module]


def test_autocast_bf16_routes_in_the_autocast_dtype_and_accumulates_in_float32():
    torch.manual_seed(10)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tied = TiedModel()
            self.attention = SelfAttention(True, True)

        def forward(self, tokens):
            values, _ = self.attention(self.tied(tokens)[..., :WIDTH])
            return values

    model = Model()
    deferral, out, _ = _check_split(model, _tokens(), lambda out: out.float().square().mean(), autocast=True)
    assert out.dtype == torch.bfloat16
    assert deferral.summary()["generic+linear MultiheadAttention"] == 1
    assert deferral.summary()["generic+linear TiedHead"] == 1


def test_w_frees_what_routed_calls_kept():
    import gc
    import weakref

    torch.manual_seed(11)
    model = TwiceUsed()
    store = WeightGradStore()
    install_deferral([model], store)
    x = torch.randn(4, WIDTH, requires_grad=True)
    out = model(x * 1)
    kept = weakref.ref(out)
    store.begin((0, 0), defer=True)
    out.sum().backward()
    store.end()
    assert store.held_tensors((0, 0)), "W holds the routed calls' inputs and output gradients"
    del out
    gc.collect()
    store.flush((0, 0))
    gc.collect()
    assert kept() is None and store.held_tensors() == []


def test_a_fully_routed_module_runs_later_forwards_on_the_stage_graph():
    """``nn.MultiheadAttention``: every parameter behind a routed call, so after its first forward
    (a local graph without leaves) no bridge, no nested engine run; B still leaves every gradient
    to W, and W gives plain autograd's."""
    torch.manual_seed(0)
    model = SelfAttention(True, True)
    batches = _hidden(3)
    reference = copy.deepcopy(model)
    store = WeightGradStore()
    deferral = install_deferral([model], store)
    bridges = []
    for j, (x,) in enumerate(batches):
        _attention_loss(reference(x.detach().requires_grad_())).backward()
        out = model(x)
        bridges.append(node_names(out[0]).count("BridgeBackward"))
        store.begin((0, j), defer=True)
        _attention_loss(out).backward()
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
    for j, (x,) in enumerate(_hidden(3)):
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
    for j, (x,) in enumerate(_hidden(3)):
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
    deferral, _, _ = _check_split(model, _hidden(3), lambda out: out.square().sum(), GENERIC_ROUTED)
    assert model.routing_seen == [True] * 3
    assert deferral.summary() == {"generic+linear _Branching": 1}


class Projections(nn.Module):
    """Projections written as products with the module's own 2-D weights: ``x @ w``,
    ``torch.matmul(x, w)`` and ``x.matmul(w)``, with a bias added and a nonlinearity between."""

    def __init__(self):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(WIDTH, 2 * WIDTH) / WIDTH**0.5)
        self.b_in = nn.Parameter(torch.randn(2 * WIDTH))
        self.w_mid = nn.Parameter(torch.randn(2 * WIDTH, 2 * WIDTH) / WIDTH**0.5)
        self.w_out = nn.Parameter(torch.randn(2 * WIDTH, WIDTH) / WIDTH**0.5)

    def forward(self, x):
        h = torch.tanh(x @ self.w_in + self.b_in)
        return torch.matmul(h, self.w_mid).matmul(self.w_out)


@pytest.mark.parametrize("defer", [True, False], ids=["B then W", "fused BW"])
@pytest.mark.parametrize("requires_grad", [True, False], ids=["middle stage", "first stage"])
def test_products_with_a_leaf_weight_are_routed_and_exact(defer, requires_grad):
    torch.manual_seed(12)
    model = Projections()
    batches = _hidden(requires_grad=requires_grad)
    deferral, out, leaves = _check_split(model, batches, lambda out: out.square().mean(), defer=defer)
    assert deferral.summary() == {"generic+linear Projections": 1}
    assert out.requires_grad
    # the three weights take the closed form, the bias added to the product too: no leaves
    assert leaves == set()


def test_routed_products_under_autocast_give_float32_gradients_close_to_autograd():
    torch.manual_seed(13)
    model = Projections()
    _, out, leaves = _check_split(model, _hidden(), lambda y: y.float().square().mean(), autocast=True)
    assert out.dtype == torch.bfloat16
    assert leaves == set()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


class UnroutedProducts(nn.Module):
    """Products the router leaves to the generic split: the weight on the left, a vector input and
    a batched (3-D) weight."""

    def __init__(self):
        super().__init__()
        self.left = nn.Parameter(torch.randn(5, 5) / 5**0.5)
        self.vector = nn.Parameter(torch.randn(WIDTH))
        self.batched = nn.Parameter(torch.randn(3, WIDTH, WIDTH) / WIDTH**0.5)

    def forward(self, x):
        h = self.left @ x  # (5, 5) @ (3, 5, WIDTH): the parameter is the left factor
        h = h @ self.batched  # a batched product, not a projection
        return h * (self.vector @ torch.ones(WIDTH, WIDTH))  # a 1-D left factor, no leaf weight


def test_other_products_stay_generic_and_exact():
    torch.manual_seed(14)
    _, _, leaves = _check_split(UnroutedProducts(), _hidden(), lambda out: out.square().mean())
    assert leaves == {"left", "vector", "batched"}


def test_a_routed_product_of_mismatched_shapes_raises_torchs_own_error():
    model = Projections()
    install_deferral([model], WeightGradStore())
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        model(torch.randn(3, 5, WIDTH + 1))


class Affine(nn.Module):
    """Elementwise uses of the module's own leaves on activations: a broadcast bias, a scale on the
    left, a gain broadcast over leading dimensions, a shift broadcast over the first dimension
    (``torch.add``) and a 0-dim scalar."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(WIDTH))
        self.scale = nn.Parameter(torch.rand(WIDTH) + 0.5)
        self.gain = nn.Parameter(torch.rand(1, 1, WIDTH) + 0.5)
        self.shift = nn.Parameter(torch.randn(5, WIDTH))
        self.scalar = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        h = torch.tanh(x + self.bias)
        h = self.scale * h
        h = torch.mul(h, self.gain)
        h = torch.add(h, self.shift)
        return h.sin() * self.scalar


@pytest.mark.parametrize("defer", [True, False], ids=["B then W", "fused BW"])
def test_elementwise_uses_of_leaves_are_routed_and_exact(defer):
    torch.manual_seed(14)
    model = Affine()
    deferral, _, leaves = _check_split(model, _hidden(3), lambda out: out.square().mean(), defer=defer)
    assert deferral.summary() == {"generic+linear Affine": 1}
    assert leaves == set()


class Shifted(nn.Module):
    """``x + shift`` with a shift of the activation's own shape: no broadcast to sum over."""

    def __init__(self):
        super().__init__()
        self.shift = nn.Parameter(torch.randn(5, WIDTH))

    def forward(self, x):
        return torch.tanh(x) + self.shift


def test_a_routed_shift_without_broadcast_gets_a_gradient_of_its_own():
    """The shift's gradient is the output gradient itself, a tensor the engine also hands the other
    side: W adds a copy, so a later in-place update of ``.grad`` changes nothing else."""
    torch.manual_seed(15)
    model = Shifted()
    store = WeightGradStore()
    install_deferral([model], store)
    for j in range(2):  # the first forward builds a local graph, the second runs on the stage's
        out = model(torch.randn(5, WIDTH, requires_grad=True))
        given = []
        out.register_hook(given.append)
        store.begin((0, j), defer=True)
        out.backward(torch.randn(5, WIDTH))
        store.end()
        model.shift.grad = None
        store.flush((0, j))
        torch.testing.assert_close(model.shift.grad, given[0])
        assert model.shift.grad.data_ptr() != given[0].data_ptr()


class RawNorms(nn.Module):
    """``F.layer_norm`` (weight and bias by position, then weight only by keyword) and
    ``F.group_norm`` on the module's own parameters around a routed projection."""

    def __init__(self):
        super().__init__()
        self.ln_weight, self.ln_bias = nn.Parameter(torch.rand(WIDTH) + 0.5), nn.Parameter(torch.randn(WIDTH))
        self.ln2_weight = nn.Parameter(torch.rand(WIDTH) + 0.5)
        self.gn_weight, self.gn_bias = nn.Parameter(torch.rand(5) + 0.5), nn.Parameter(torch.randn(5))
        self.projection = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)

    def forward(self, x):
        h = F.layer_norm(x, (WIDTH,), self.ln_weight, self.ln_bias)
        h = torch.relu(h @ self.projection)
        h = F.group_norm(h, 5, self.gn_weight, self.gn_bias)  # (3, 5, WIDTH): 5 channels, 5 groups
        return F.layer_norm(h, (WIDTH,), weight=self.ln2_weight, eps=1e-6)


@pytest.mark.parametrize("keyed", [True, False], ids=["executor's forward", "direct call"])
@pytest.mark.parametrize("defer", [True, False], ids=["B then W", "fused BW"])
@pytest.mark.parametrize("requires_grad", [True, False], ids=["middle stage", "first stage"])
def test_norms_on_own_parameters_are_routed_in_forwards_on_the_stage_graph(
    defer, requires_grad, keyed, monkeypatch
):
    """The first forward's local graph gets the norms' parameter gradients from B's kernel calls
    (``in_b``); the later forwards, on the stage's graph, route the norms to per-call aliases, whose
    gradients autograd accumulates in an executor's forward (a post-hook takes them otherwise)."""
    if keyed:

        def no_hook(*args):
            raise AssertionError("a routed norm's node was hooked in a keyed forward")

        monkeypatch.setattr(routed._NormGrads, "__call__", no_hook)
    torch.manual_seed(16)
    model = RawNorms()
    batches = _hidden(3, requires_grad=requires_grad)
    loss_fn = lambda out: out.square().mean()  # noqa: E731
    deferral, out, leaves = _check_split(model, batches, loss_fn, defer=defer, keyed=keyed)
    assert leaves == {"ln_weight", "ln_bias", "ln2_weight", "gn_weight", "gn_bias"}
    assert _local_leaves(out, model) is None, "the later forwards built a local graph"
    assert deferral.summary() == {"generic+linear RawNorms": 1}


class RawRmsNorms(nn.Module):
    """RMS norms on the module's own weights around a routed projection: ``F.rms_norm`` with the
    weight by position, ``torch.rms_norm`` with it by keyword."""

    def __init__(self):
        super().__init__()
        self.norm1 = nn.Parameter(torch.rand(WIDTH) + 0.5)
        self.norm2 = nn.Parameter(torch.rand(WIDTH) + 0.5)
        self.projection = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)

    def forward(self, x):
        h = torch.relu(F.rms_norm(x, (WIDTH,), self.norm1, 1e-6) @ self.projection)
        return torch.rms_norm(h, (WIDTH,), weight=self.norm2)


@pytest.mark.parametrize("defer", [True, False], ids=["B then W", "fused BW"])
def test_rms_norms_on_own_weights_are_routed_scales_and_exact(defer):
    """The weight's gradient waits for W in the local graph as on the stage's graph, so the module
    needs no local graph after its first forward (its norms were not routed, it would keep one)."""
    torch.manual_seed(21)
    model = RawRmsNorms()
    deferral, out, leaves = _check_split(model, _hidden(3), lambda out: out.square().mean(), defer=defer)
    assert leaves == set()
    assert _local_leaves(out, model) is None, "the later forwards built a local graph"
    assert deferral.summary() == {"generic+linear RawRmsNorms": 1}


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's, for both models
def test_an_rms_norm_of_a_lower_precision_input_is_not_routed_and_stays_exact():
    """Under autocast the second norm gets the projection's bfloat16 output: torch computes that
    norm in float32 and casts the product back, which a routed scale would not; it runs as it is,
    its weight a leaf of the local graph."""
    torch.manual_seed(23)
    model = RawRmsNorms()
    _, _, leaves = _check_split(model, _hidden(3), lambda out: out.float().square().mean(), autocast=True)
    assert leaves == {"norm2"}
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_rms_norm_on_a_first_stage_input_stays_an_exact_leaf_of_the_local_graph():
    """A first stage's input needs no gradient: the scale is not routed, its weight is a leaf of the
    local graph (as a first stage's ``x + b``)."""
    torch.manual_seed(22)
    model = RawRmsNorms()
    _, _, leaves = _check_split(model, _hidden(3, requires_grad=False), lambda out: out.square().mean())
    assert leaves == {"norm1"}


def test_routed_norms_under_autocast_stay_within_bf16_tolerance():
    """Autocast runs the norms in float32 on the float32 aliases: still one node taking them."""
    torch.manual_seed(20)
    model = RawNorms()
    _, out, _ = _check_split(model, _hidden(3), lambda out: out.float().square().mean(), autocast=True)
    assert _local_leaves(out, model) is None
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_the_raw_block_of_the_bench_runs_on_the_stage_graph_after_its_first_forward():
    from zerobubble_demo.split_models import RawBlock

    torch.manual_seed(17)
    model = RawBlock(WIDTH, heads=2)
    _, out, leaves = _check_split(model, _hidden(3), lambda out: out.square().mean())
    assert leaves == {"norm1_weight", "norm1_bias", "norm2_weight", "norm2_bias"}
    assert _local_leaves(out, model) is None


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


@pytest.mark.parametrize("layer", ["nn.Linear", "routed F.linear"])
def test_a_transposed_input_takes_one_gemm_not_a_batched_product(layer):
    """On a detached weight, ``matmul`` would run a non-contiguous 3-D input (the transposed
    query of ``nn.MultiheadAttention(batch_first=True)`` with two sequences or more) as one small
    GEMM per leading index; the split folds it into one GEMM, as a weight requiring grad does."""
    torch.manual_seed(19)

    class Projection(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)

        def forward(self, x):
            return F.linear(x, self.weight)

    model = nn.Linear(WIDTH, WIDTH) if layer == "nn.Linear" else Projection()
    batches = [(torch.randn(2, 7, WIDTH).transpose(0, 1).requires_grad_(),) for _ in range(2)]
    _, out, _ = _check_split(model, batches, lambda out: out.square().mean())
    assert out.shape == (7, 2, WIDTH)
    assert "BmmBackward0" not in node_names(out)


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

    _check_split(Reentrant(), _hidden(3), lambda out: out.square().mean())


def test_a_real_leaf_times_a_complex_activation_stays_exact():
    """Not routed (autograd keeps the real part of a real leaf's gradient): exact through W's walk."""
    torch.manual_seed(22)

    class Phase(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)
            self.scale = nn.Parameter(torch.rand(WIDTH) + 0.5)

        def forward(self, x):
            z = torch.polar(torch.ones_like(x), F.linear(x, self.weight))
            return (z * self.scale).abs().sum(-1)

    _, _, leaves = _check_split(Phase(), _hidden(2), lambda out: out.square().mean())
    assert leaves == {"scale"}


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
