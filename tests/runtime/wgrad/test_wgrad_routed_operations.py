"""The routed split beyond ``F.linear``: products ``x @ w`` with a module's own weights, elementwise
scales and shifts, norms on raw parameters, and the uses left to the generic split (other products,
complex activations), each checked against plain autograd (:func:`_routing.check_split`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _routing import WIDTH, check_split, hidden, local_leaves
from torch import nn

from zerobubble.runtime.wgrad import WeightGradStore, install_deferral, routed


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
    batches = hidden(requires_grad=requires_grad)
    deferral, out, leaves = check_split(model, batches, lambda out: out.square().mean(), defer=defer)
    assert deferral.summary() == {"generic+linear Projections": 1}
    assert out.requires_grad
    # the three weights take the closed form, the bias added to the product too: no leaves
    assert leaves == set()


def test_routed_products_under_autocast_give_float32_gradients_close_to_autograd():
    torch.manual_seed(13)
    model = Projections()
    _, out, leaves = check_split(model, hidden(), lambda y: y.float().square().mean(), autocast=True)
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
    _, _, leaves = check_split(UnroutedProducts(), hidden(), lambda out: out.square().mean())
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
    deferral, _, leaves = check_split(model, hidden(3), lambda out: out.square().mean(), defer=defer)
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
    batches = hidden(3, requires_grad=requires_grad)
    loss_fn = lambda out: out.square().mean()  # noqa: E731
    deferral, out, leaves = check_split(model, batches, loss_fn, defer=defer, keyed=keyed)
    assert leaves == {"ln_weight", "ln_bias", "ln2_weight", "gn_weight", "gn_bias"}
    assert local_leaves(out, model) is None, "the later forwards built a local graph"
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
    deferral, out, leaves = check_split(model, hidden(3), lambda out: out.square().mean(), defer=defer)
    assert leaves == set()
    assert local_leaves(out, model) is None, "the later forwards built a local graph"
    assert deferral.summary() == {"generic+linear RawRmsNorms": 1}


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's, for both models
def test_an_rms_norm_of_a_lower_precision_input_is_not_routed_and_stays_exact():
    """Under autocast the second norm gets the projection's bfloat16 output: torch computes that
    norm in float32 and casts the product back, which a routed scale would not; it runs as it is,
    its weight a leaf of the local graph."""
    torch.manual_seed(23)
    model = RawRmsNorms()
    _, _, leaves = check_split(model, hidden(3), lambda out: out.float().square().mean(), autocast=True)
    assert leaves == {"norm2"}
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_rms_norm_on_a_first_stage_input_stays_an_exact_leaf_of_the_local_graph():
    """A first stage's input needs no gradient: the scale is not routed, its weight is a leaf of the
    local graph (as a first stage's ``x + b``)."""
    torch.manual_seed(22)
    model = RawRmsNorms()
    _, _, leaves = check_split(model, hidden(3, requires_grad=False), lambda out: out.square().mean())
    assert leaves == {"norm1"}


def test_routed_norms_under_autocast_stay_within_bf16_tolerance():
    """Autocast runs the norms in float32 on the float32 aliases: still one node taking them."""
    torch.manual_seed(20)
    model = RawNorms()
    _, out, _ = check_split(model, hidden(3), lambda out: out.float().square().mean(), autocast=True)
    assert local_leaves(out, model) is None
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_the_raw_block_of_the_bench_runs_on_the_stage_graph_after_its_first_forward():
    from zerobubble_demo.split_models import RawBlock

    torch.manual_seed(17)
    model = RawBlock(WIDTH, heads=2)
    _, out, leaves = check_split(model, hidden(3), lambda out: out.square().mean())
    assert leaves == {"norm1_weight", "norm1_bias", "norm2_weight", "norm2_bias"}
    assert local_leaves(out, model) is None


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

    _, _, leaves = check_split(Phase(), hidden(2), lambda out: out.square().mean())
    assert leaves == {"scale"}
