"""The B/W split of every module: B leaves every parameter gradient to W, W gives plain autograd's.

Single process: each test runs B (``store.begin(key, defer=True)`` + backward) per microbatch,
checks that no parameter got a gradient yet and that input gradients are exact, then runs the W ops
in some order and compares every gradient (and buffer) with plain autograd on a copy.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from _graphs import node_names
from zerobubble.runtime.wgrad import (
    FastPaths,
    SplitRule,
    WeightGradStore,
    default_fast_paths,
    fast,
    install_deferral,
    remove_deferral,
)
from zerobubble_demo.split_models import SPLIT_MODELS, split_model

WIDTH = 8


class ScaleFunction(torch.autograd.Function):
    """A custom autograd function using a parameter (its backward computes both gradients)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x, scale)
        return x * scale

    @staticmethod
    def backward(ctx, grad):
        x, scale = ctx.saved_tensors
        return grad * scale, (grad * x).reshape(-1, x.shape[-1]).sum(0)


class Custom(nn.Module):
    """Own parameters through addmm and a custom function, a Linear child, and a borrowed weight."""

    def __init__(self, borrowed: nn.Linear):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)
        self.scale = nn.Parameter(torch.rand(WIDTH) + 0.5)
        self.inner = nn.Linear(WIDTH, WIDTH)
        self.borrowed = [borrowed]  # a list: not a child, its weight is used here directly

    def forward(self, x):
        x = torch.addmm(self.scale, x.reshape(-1, WIDTH), self.weight).view_as(x)
        x = ScaleFunction.apply(self.inner(torch.tanh(x)), self.scale)
        return x + F.linear(x, self.borrowed[0].weight)


class Mixed(nn.Module):
    """Every built-in fast path, the generic split, a tied weight and two BatchNorm flavours."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, WIDTH, padding_idx=0)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.rms = nn.RMSNorm(WIDTH)
        self.conv = nn.Conv1d(WIDTH, WIDTH, 3, padding=1)
        self.group = nn.GroupNorm(2, WIDTH)
        self.batch = nn.BatchNorm1d(WIDTH)
        self.cumulative = nn.BatchNorm1d(WIDTH, momentum=None)
        self.image = nn.Conv2d(1, 2, 3, padding=1, stride=(1, 2))
        self.custom = Custom(self.fc)
        self.head = nn.Linear(WIDTH, 11, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens):
        x = self.rms(self.norm(torch.relu(self.fc(self.embed(tokens)))))
        y = self.cumulative(self.batch(self.group(self.conv(x.transpose(1, 2))))).transpose(1, 2)
        z = self.image(x.unsqueeze(1)).flatten(1, 3).reshape_as(x)
        return self.head(self.custom(x + y + z))


def _batches(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(11, (3, 6), generator=generator) for _ in range(count)]


def _assert_grads_equal(model: nn.Module, reference: nn.Module) -> None:
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{name} got no gradient"
        assert param.grad.dtype == param.dtype
        assert not param.grad.requires_grad, f"W built an autograd graph into {name}.grad"
        torch.testing.assert_close(param.grad, expected[name].grad, rtol=1e-5, atol=1e-7, msg=name)


def _w_after_b(model: nn.Module, store: WeightGradStore, reference: nn.Module) -> None:
    """Checks that B wrote no ``.grad``, runs W of every pending key (last first), compares."""
    assert all(p.grad is None for p in model.parameters()), "no .grad may be written in B"
    for key in reversed(store.pending_keys()):
        store.flush(key)
    assert store.pending_keys() == []
    _assert_grads_equal(model, reference)


def _split_backward(model, store, losses, stage=0):
    for j, loss in enumerate(losses):
        store.begin((stage, j), defer=True)
        loss.backward()
        store.end()


def test_every_parameter_waits_for_w_and_w_matches_autograd():
    torch.manual_seed(0)
    model = Mixed()
    reference = copy.deepcopy(model)
    batches = _batches(3)
    for tokens in batches:
        reference(tokens).square().mean().backward()
    store = WeightGradStore()
    deferral = install_deferral([model], store)
    assert deferral.summary() == {
        "fast Embedding": 1, "fast Linear": 3, "fast LayerNorm": 1, "fast Conv1d": 1, "fast GroupNorm": 1,
        "fast BatchNorm1d": 2, "fast Conv2d": 1, "fast RMSNorm": 1, "generic Custom": 1,
    }  # fmt: skip
    _split_backward(model, store, [model(tokens).square().mean() for tokens in batches])
    early = [name for name, p in model.named_parameters() if p.grad is not None]
    assert early == [], f"gradients computed in B: {early}"
    assert sorted(store.pending_keys()) == [(0, 0), (0, 1), (0, 2)]
    for key in [(0, 2), (0, 0), (0, 1)]:  # any order the schedule says
        store.flush(key)
    assert store.pending_keys() == []
    _assert_grads_equal(model, reference)
    for (name, buffer), (_, expected) in zip(model.named_buffers(), reference.named_buffers()):
        torch.testing.assert_close(buffer, expected, rtol=1e-6, atol=0, msg=name)


def test_fused_mode_computes_every_gradient_in_the_backward():
    torch.manual_seed(0)
    model = Mixed()
    reference = copy.deepcopy(model)
    store = WeightGradStore()
    install_deferral([model], store)
    for tokens in _batches(2):
        reference(tokens).square().mean().backward()
        store.begin((0, 0), defer=False)
        model(tokens).square().mean().backward()
        store.end()
    assert store.pending_keys() == []
    _assert_grads_equal(model, reference)


def test_input_gradient_of_a_middle_stage_is_exact_and_eval_batch_norm_splits():
    torch.manual_seed(2)
    stage = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(3))
    stage(torch.randn(1, 2, 5, 5))
    stage.eval()
    reference = copy.deepcopy(stage)
    x = torch.randn(2, 2, 5, 5, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    reference(x_ref).square().sum().backward()
    store = WeightGradStore()
    install_deferral([stage], store)
    _split_backward(stage, store, [stage(x).square().sum()], stage=1)
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert all(p.grad is None for p in stage.parameters())
    store.flush((1, 0))
    _assert_grads_equal(stage, reference)


@pytest.mark.parametrize("name", SPLIT_MODELS)
def test_real_models_defer_every_parameter(name):
    if name in ("gpt2", "llama"):
        pytest.importorskip("transformers")
    model, reference = split_model(name, batch=4), split_model(name, batch=4)
    store = WeightGradStore()
    layers = nn.Sequential(*model.layers)
    install_deferral(layers, store)
    chunks = list(zip(model.inputs.chunk(2), model.targets.chunk(2)))
    for inputs, targets in chunks:
        reference.loss_fn(_run(reference.layers, inputs), targets).backward()
    _split_backward(layers, store, [model.loss_fn(_run(model.layers, i), t) for i, t in chunks])
    early = [n for n, p in layers.named_parameters() if p.grad is not None]
    assert early == [], f"gradients computed in B: {early}"
    store.flush((0, 1))
    store.flush((0, 0))
    _assert_grads_equal(layers, nn.Sequential(*reference.layers))
    for (buffer_name, buffer), (_, expected) in zip(
        layers.named_buffers(), nn.Sequential(*reference.layers).named_buffers()
    ):
        torch.testing.assert_close(buffer, expected, rtol=1e-6, atol=0, msg=buffer_name)


def _run(layers, inputs):
    values = inputs
    for layer in layers:
        values = layer(*values) if isinstance(values, tuple) else layer(values)
    return values


class _CountingBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + self.fc(torch.relu(self.norm(x)))


def test_checkpointing_recomputes_in_b_and_keeps_w_deferred():
    torch.manual_seed(3)
    block = _CountingBlock()
    reference = copy.deepcopy(block)
    x = torch.randn(4, WIDTH, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    checkpoint(reference, x_ref, use_reentrant=False).square().sum().backward()
    store = WeightGradStore()
    install_deferral([block], store)
    loss = checkpoint(block, x, use_reentrant=False).square().sum()
    assert block.calls == 1
    _split_backward(block, store, [loss])
    assert block.calls == 2, "B recomputed the checkpointed forward (activations were not kept)"
    assert all(p.grad is None for p in block.parameters()), "recomputation must not compute W in B"
    torch.testing.assert_close(x.grad, x_ref.grad)
    store.flush((0, 0))
    _assert_grads_equal(block, reference)


class _ScaledCountingBlock(_CountingBlock):
    """A block owning a parameter of its own: the generic split, around fast-path children."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(WIDTH) + 0.5)

    def forward(self, x):
        return super().forward(x) * self.scale


@pytest.mark.parametrize(
    "block_type, paths",
    [(_CountingBlock, FastPaths()), (_ScaledCountingBlock, None), (_ScaledCountingBlock, FastPaths())],
    ids=["generic children", "generic around fast paths", "generic nested"],
)
def test_checkpointing_keeps_w_of_generically_split_modules_deferred(block_type, paths):
    torch.manual_seed(5)
    block = block_type()
    reference = copy.deepcopy(block)
    x = torch.randn(4, WIDTH, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    for _ in range(2):  # two microbatches: W accumulates into the first one's .grad
        checkpoint(reference, x_ref, use_reentrant=False).square().sum().backward()
    store = WeightGradStore()
    deferral = install_deferral([block], store, paths)
    assert deferral.generic, "the test needs generically split modules"
    losses = [checkpoint(block, x, use_reentrant=False).square().sum() for _ in range(2)]
    assert block.calls == 2
    _split_backward(block, store, losses)
    assert block.calls == 4, "B recomputes each checkpointed forward once (not once per engine run)"
    early = [name for name, p in block.named_parameters() if p.grad is not None]
    assert early == [], f"gradients computed in B under checkpointing: {early}"
    torch.testing.assert_close(x.grad, x_ref.grad)
    store.flush((0, 1))
    store.flush((0, 0))
    assert block.calls == 4, "W must not recompute the checkpointed forward"
    _assert_grads_equal(block, reference)
    assert store.pending_keys() == []


def test_autocast_bf16_computes_w_in_saved_dtype_and_accumulates_in_parameter_dtype():
    torch.manual_seed(4)
    model = nn.Sequential(
        nn.Embedding(11, WIDTH), nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), Custom(nn.Linear(WIDTH, WIDTH))
    )
    reference = copy.deepcopy(model)
    tokens = _batches(2)
    for t in tokens:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = reference(t)
        out.float().square().mean().backward()
    store = WeightGradStore()
    install_deferral([model], store)
    losses = []
    for t in tokens:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(t)
        losses.append(out.float().square().mean())
    _split_backward(model, store, losses)
    _w_after_b(model, store, reference)


class Gate(nn.Module):
    """A user layer: ``x * sigmoid(gate)`` with a vector parameter."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Parameter(torch.randn(WIDTH))

    def forward(self, x):
        return x * torch.sigmoid(self.gate)


class GateRule(SplitRule):
    """The user's closed form for Gate."""

    def param_names(self, module):
        return ("gate",)

    def forward(self, module, x, params):
        return x * torch.sigmoid(params[0]), (x, params[0])

    def input_grad(self, module, saved, grad_output):
        return grad_output * torch.sigmoid(saved[1])

    def weight_grads(self, module, saved, grad_output, needed):
        x, gate = saved
        s = torch.sigmoid(gate)
        return [(grad_output * x).reshape(-1, WIDTH).sum(0) * s * (1 - s)]


class GateOverridden(Gate):
    def forward(self, x):
        return super().forward(x) + 1


def test_a_registered_rule_is_used_and_subclasses_that_override_forward_are_not():
    torch.manual_seed(5)
    paths = default_fast_paths()
    paths.register(Gate, GateRule())
    model = nn.Sequential(Gate(), nn.Linear(WIDTH, WIDTH), GateOverridden())
    reference = copy.deepcopy(model)
    x = torch.randn(3, WIDTH)
    reference(x).square().sum().backward()
    store = WeightGradStore()
    deferral = install_deferral([model], store, paths)
    assert deferral.summary() == {"fast Gate": 1, "fast Linear": 1, "generic GateOverridden": 1}
    assert FastPaths().rule_for(Gate()) is None and default_fast_paths().rule_for(Gate()) is None
    _split_backward(model, store, [model(x).square().sum()])
    assert all(p.grad is None for p in model.parameters())
    store.flush((0, 0))
    _assert_grads_equal(model, reference)
    remove_deferral(deferral)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_w_frees_what_b_kept():
    torch.manual_seed(6)
    model = nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.Tanh(), Custom(nn.Linear(WIDTH, WIDTH)), nn.LayerNorm(WIDTH)
    )
    kept = []
    for module in (model[0], model[2].inner):  # inner: inside the generic local graph
        module.register_forward_hook(lambda m, args, out: kept.append(weakref.ref(args[0])))
    store = WeightGradStore()
    install_deferral([model], store)
    x = torch.randn(3, WIDTH, requires_grad=True)
    loss = model(x * 2).square().sum()
    _split_backward(model, store, [loss])
    del loss
    gc.collect()
    assert all(ref() is not None for ref in kept), "W needs the layers' inputs"
    store.flush((0, 0))
    gc.collect()
    assert all(ref() is None for ref in kept), "W must free what B kept for it"


def test_a_fast_path_layer_called_with_keywords_takes_the_generic_split():
    torch.manual_seed(8)
    layer = nn.Linear(3, 2)
    reference = copy.deepcopy(layer)
    x = torch.randn(4, 3)
    reference(input=x).sum().backward()
    store = WeightGradStore()
    install_deferral([layer], store)
    _split_backward(layer, store, [layer(input=x).sum()])
    assert layer.weight.grad is None
    store.flush((0, 0))
    _assert_grads_equal(layer, reference)


def test_no_grad_forward_and_frozen_parameters_bypass_the_store():
    layer, frozen = nn.Linear(3, 3), nn.LayerNorm(3)
    frozen.requires_grad_(False)
    store = WeightGradStore()
    install_deferral([layer, frozen], store)
    with torch.no_grad():
        assert layer(torch.ones(2, 3)).grad_fn is None
    x = torch.ones(2, 3, requires_grad=True)
    store.begin((0, 0), defer=True)
    frozen(x).sum().backward()
    store.end()
    assert store.pending_keys() == [] and x.grad is not None


LAYERS = {  # layer, input shape, the split it takes
    "conv1d groups dilation stride": (
        lambda: nn.Conv1d(4, 6, 3, stride=2, dilation=2, groups=2),
        (2, 4, 11),
        "fast",
    ),
    "conv3d no bias": (lambda: nn.Conv3d(2, 3, 2, padding=1, bias=False), (2, 2, 3, 4, 3), "fast"),
    "conv2d one unbatched image": (lambda: nn.Conv2d(2, 3, 3, padding=1), (2, 5, 5), "fast"),
    "conv2d padding='same'": (lambda: nn.Conv2d(2, 3, 3, padding="same"), (2, 2, 5, 5), "generic"),
    "conv2d reflect padding": (
        lambda: nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"),
        (2, 2, 5, 5),
        "generic",
    ),
    "batchnorm3d": (lambda: nn.BatchNorm3d(3), (2, 3, 2, 3, 2), "fast"),
    "groupnorm 4d": (lambda: nn.GroupNorm(3, 6), (2, 6, 3, 3), "fast"),
    "layernorm 2 dims no bias": (lambda: nn.LayerNorm((3, 4), bias=False), (2, 5, 3, 4), "fast"),
    "linear no bias 4d": (lambda: nn.Linear(4, 3, bias=False), (2, 2, 5, 4), "fast"),
    "embedding scale_grad_by_freq": (lambda: nn.Embedding(7, 4, scale_grad_by_freq=True), None, "fast"),
    "embedding max_norm": (lambda: nn.Embedding(7, 4, max_norm=1.0), None, "generic"),
}


def test_an_unbatched_convolution_on_a_first_stage_splits_exactly():
    """One sample without a batch dimension, needing no input gradient (the autograd function's
    path, not the native node's): the kernel gets a batch of one in B and W alike."""
    torch.manual_seed(8)
    layer = nn.Conv1d(2, 3, 3, stride=2)
    reference = copy.deepcopy(layer)
    x = torch.randn(2, 9)
    reference(x).sin().sum().backward()
    store = WeightGradStore()
    install_deferral([layer], store)
    _split_backward(layer, store, [layer(x).sin().sum()])
    assert all(p.grad is None for p in layer.parameters())
    store.flush((0, 0))
    for param, expected in zip(layer.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, expected.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(LAYERS))
def test_each_layer_configuration_splits_exactly(name):
    make, shape, split = LAYERS[name]
    torch.manual_seed(7)
    layer = make()
    reference = copy.deepcopy(layer)
    if shape is None:
        inputs = [torch.tensor([[1, 2, 2], [6, 1, 2]])]
    else:
        inputs = [torch.randn(*shape, requires_grad=True) for _ in range(2)]
    references = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    for x in references:
        reference(x).sin().sum().backward()
    store = WeightGradStore()
    deferral = install_deferral([layer], store)
    assert deferral.summary() == {f"{split} {type(layer).__name__}": 1}
    _split_backward(layer, store, [layer(x).sin().sum() for x in inputs])
    assert all(p.grad is None for p in layer.parameters())
    for x, expected in zip(inputs, references):
        if x.requires_grad:
            torch.testing.assert_close(x.grad, expected.grad, rtol=1e-5, atol=1e-6)
    store.flush((0, 1))
    store.flush((0, 0))
    _assert_grads_equal(layer, reference)
    for (buffer_name, buffer), (_, expected) in zip(layer.named_buffers(), reference.named_buffers()):
        torch.testing.assert_close(buffer, expected, rtol=1e-6, atol=0, msg=buffer_name)


class _Symmetric(nn.Module):
    def forward(self, weight):
        return weight.triu() + weight.triu(1).t()


def test_parametrized_weight_takes_the_generic_split_and_reaches_the_real_parameter():
    from torch.nn.utils import parametrize

    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))
    parametrize.register_parametrization(model[0], "weight", _Symmetric())
    reference = copy.deepcopy(model)
    batches = [torch.randn(3, WIDTH) for _ in range(2)]
    for x in batches:
        reference(x).square().sum().backward()
    store = WeightGradStore()
    deferral = install_deferral([model], store)
    assert deferral.summary() == {"fast Linear": 1, "generic ParametrizedLinear": 1}
    _split_backward(model, store, [model(x).square().sum() for x in batches])
    _w_after_b(model, store, reference)


def test_offloading_hooks_keep_w_of_generically_split_modules_deferred():
    torch.manual_seed(7)
    block = _ScaledCountingBlock()
    reference = copy.deepcopy(block)
    x = torch.randn(4, WIDTH, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    reference(x_ref).square().sum().backward()
    store = WeightGradStore()
    install_deferral([block], store, FastPaths())
    with torch.autograd.graph.save_on_cpu():
        loss = block(x).square().sum()
    _split_backward(block, store, [loss])
    assert all(p.grad is None for p in block.parameters()), "offloading must not move W into B"
    torch.testing.assert_close(x.grad, x_ref.grad)
    store.flush((0, 0))
    _assert_grads_equal(block, reference)


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
        _assert_grads_equal(model, reference)
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
    _assert_grads_equal(model, reference)


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
    _split_backward(model, store, [model(x).square().sum() for x in batches])
    _w_after_b(model, store, reference)


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
    _split_backward(model, store, losses)
    _w_after_b(model, store, reference)


class _Scaled(nn.Module):
    """A module owning a parameter with no fast path (the generic split's kind)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(WIDTH) + 0.5)

    def forward(self, x):
        return torch.tanh(x) * self.scale


def test_fast_paths_alone_leave_other_modules_to_plain_autograd():
    """``generic=False`` (what schedules without W ops install): fast paths only, exact fused BW."""
    torch.manual_seed(13)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), _Scaled(), nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH))
    reference = copy.deepcopy(model)
    store = WeightGradStore()
    deferral = install_deferral([model], store, generic=False)
    assert deferral.summary() == {"fast Linear": 2, "fast LayerNorm": 1}
    assert "forward" not in model[1].__dict__
    for requires_grad in (False, True):  # a first stage's data, then a received activation
        x = torch.randn(3, WIDTH, requires_grad=requires_grad)
        reference(x).square().sum().backward()
        store.begin((0, 0), defer=False)
        model(x).square().sum().backward()
        store.end()
    assert store.pending_keys() == []
    _assert_grads_equal(model, reference)


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
