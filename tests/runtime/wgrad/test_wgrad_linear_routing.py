"""``F.linear`` on leaf weights inside generically split modules: the routed closed-form split.

Attention projections, tied and twice-used weights, parametrized and passed weights, nested
modules, checkpointing and autocast, each checked against plain autograd (:func:`_routing.check_split`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _graphs import node_names
from _routing import GENERIC_ROUTED, WIDTH, SelfAttention, attention_loss, check_split, hidden, local_leaves
from torch import nn
from torch.utils.checkpoint import checkpoint

from zerobubble.runtime.wgrad import FastPaths, WeightGradStore, install_deferral

VOCAB = 11


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_multihead_attention_projections_are_routed_and_exact(bias, batch_first):
    torch.manual_seed(0)
    model = SelfAttention(bias, batch_first)
    deferral, _, leaves = check_split(model, hidden(), attention_loss)
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
    _, _, leaves = check_split(model, batches, lambda out: out.square().mean(), defer=defer)
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
    deferral, _, leaves = check_split(model, _tokens(), lambda out: out.square().mean(), defer=defer)
    assert deferral.summary()["generic+linear TiedHead"] == 1
    # the head's scale (a product with its own leaf) and the tied weight are both routed: no leaves,
    # and the later forwards build no local graph
    assert leaves == set()
    assert local_leaves(model.head(torch.randn(2, WIDTH, requires_grad=True)), model) is None


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
    deferral, _, leaves = check_split(model, hidden(), lambda out: out.sin().sum())
    assert deferral.summary() == {"generic+linear TwiceUsed": 1}
    assert leaves == set()


def test_an_empty_registry_is_the_generic_split_alone():
    torch.manual_seed(3)
    model = TwiceUsed()
    deferral, _, leaves = check_split(model, hidden(), lambda out: out.sin().sum(), paths=FastPaths())
    assert deferral.summary() == {"generic TwiceUsed": 1}
    assert leaves == {"weight", "bias"}


@pytest.mark.parametrize("requires_grad", [True, False], ids=["middle stage", "first stage"])
def test_a_module_of_only_routed_projections_splits_when_its_input_needs_no_gradient(requires_grad):
    """A first stage: nothing the bridge joins requires grad but the routed weights themselves."""
    torch.manual_seed(4)
    model = TwiceUsed()
    _, out, leaves = check_split(model, hidden(requires_grad=requires_grad), lambda out: out.square().sum())
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
    _, _, leaves = check_split(model, _tokens(3), lambda out: out.square().mean())
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
    _, _, leaves = check_split(model, hidden(), lambda out: out.square().mean())
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
    check_split(Frozen(), hidden(), lambda out: out.square().mean())


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
    deferral, _, leaves = check_split(model, hidden(), lambda y: y.square().mean(), paths=GENERIC_ROUTED)
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
    batches = hidden()
    paths = None if module == "attention" else GENERIC_ROUTED
    _, _, leaves = check_split(model, batches, lambda out: out.square().mean(), paths=paths)
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
    deferral, out, _ = check_split(model, _tokens(), lambda out: out.float().square().mean(), autocast=True)
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
    _, out, _ = check_split(model, batches, lambda out: out.square().mean())
    assert out.shape == (7, 2, WIDTH)
    assert "BmmBackward0" not in node_names(out)


class ExpertSlices(nn.Module):
    """A fused 3-D expert weight: two experts' matrices through ``F.linear`` (routed to their rows of
    the gradient), one used twice, and one through another op (its gradient by W's walk)."""

    def __init__(self, experts: int = 4):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, WIDTH, WIDTH) / WIDTH**0.5)

    def forward(self, x):
        first = F.linear(x, self.weight[0])
        second = F.linear(torch.tanh(first), self.weight[torch.tensor(2)])
        again = F.linear(second, self.weight[0])
        return again + x * self.weight[1].sum()


@pytest.mark.parametrize("defer", [True, False], ids=["B then W", "fused BW"])
def test_expert_matrices_of_a_3d_weight_are_routed_and_every_use_adds_up(defer):
    torch.manual_seed(7)
    model = ExpertSlices()
    deferral, _, leaves = check_split(model, hidden(), lambda out: out.square().mean(), defer=defer)
    assert deferral.summary() == {"generic+linear ExpertSlices": 1}
    if defer:
        assert leaves == {"weight"}  # expert 1's use is no product: W walks to the leaf for it


def test_a_hooked_3d_weight_is_not_routed_by_slices():
    """A gradient hook must see the whole gradient at once, as autograd hands it: no routing by rows."""
    torch.manual_seed(8)
    model = ExpertSlices()
    seen = []
    model.weight.register_hook(lambda grad: seen.append(grad.shape))
    deferral, _, leaves = check_split(model, hidden(), lambda out: out.square().mean())
    assert deferral.summary() == {"generic ExpertSlices": 1} and leaves == {"weight"}
    assert seen and all(shape == model.weight.shape for shape in seen)


class GroupedExperts(nn.Module):
    """Two grouped products as transformers' grouped experts run them: ``torch.nn.functional.grouped_mm``
    on a 3-D weight's transpose (out × in stored) and on a 3-D weight stored in × out."""

    def __init__(self, experts: int = 3):
        super().__init__()
        self.up = nn.Parameter(torch.randn(experts, 2 * WIDTH, WIDTH) / WIDTH**0.5)  # (E, out, in)
        self.down = nn.Parameter(torch.randn(experts, 2 * WIDTH, WIDTH) / WIDTH**0.5)  # (E, in, out)

    def forward(self, x):
        flat = x.reshape(-1, WIDTH)
        rows = flat.shape[0]
        offs = torch.tensor([rows // 3, rows // 3, rows], dtype=torch.int32)  # an empty group too
        hidden = F.grouped_mm(flat, self.up.transpose(-2, -1), offs=offs)
        return F.grouped_mm(torch.tanh(hidden), self.down, offs=offs).view_as(x)


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch without F.grouped_mm")
@pytest.mark.parametrize("defer", [True, False], ids=["B then W", "fused BW"])
def test_grouped_products_on_3d_leaves_are_routed(defer):
    torch.manual_seed(9)
    model = GroupedExperts()
    # the closed form is autograd's own grouped product (rtol 0; the bitwise check over the MoE
    # families is tests/hf/test_hf_moe.py's)
    deferral, _, leaves = check_split(
        model, hidden(), lambda out: out.square().mean(), defer=defer, tolerance=0.0
    )
    assert deferral.summary() == {"generic+linear GroupedExperts": 1}
    assert leaves == set()
