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
from _split_checks import WIDTH, Gate, GateRule, assert_grads_equal, split_backward, w_after_b
from torch import nn
from torch.utils.checkpoint import checkpoint

from zerobubble.runtime.wgrad import (
    FastPaths,
    WeightGradStore,
    default_fast_paths,
    install_deferral,
    remove_deferral,
)
from zerobubble_demo.split_models import SPLIT_MODELS, split_model


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
    split_backward(model, store, [model(tokens).square().mean() for tokens in batches])
    early = [name for name, p in model.named_parameters() if p.grad is not None]
    assert early == [], f"gradients computed in B: {early}"
    assert sorted(store.pending_keys()) == [(0, 0), (0, 1), (0, 2)]
    for key in [(0, 2), (0, 0), (0, 1)]:  # any order the schedule says
        store.flush(key)
    assert store.pending_keys() == []
    assert_grads_equal(model, reference)
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
    assert_grads_equal(model, reference)


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
    split_backward(stage, store, [stage(x).square().sum()], stage=1)
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert all(p.grad is None for p in stage.parameters())
    store.flush((1, 0))
    assert_grads_equal(stage, reference)


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
    split_backward(layers, store, [model.loss_fn(_run(model.layers, i), t) for i, t in chunks])
    early = [n for n, p in layers.named_parameters() if p.grad is not None]
    assert early == [], f"gradients computed in B: {early}"
    store.flush((0, 1))
    store.flush((0, 0))
    assert_grads_equal(layers, nn.Sequential(*reference.layers))
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
    split_backward(block, store, [loss])
    assert block.calls == 2, "B recomputed the checkpointed forward (activations were not kept)"
    assert all(p.grad is None for p in block.parameters()), "recomputation must not compute W in B"
    torch.testing.assert_close(x.grad, x_ref.grad)
    store.flush((0, 0))
    assert_grads_equal(block, reference)


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
    split_backward(block, store, losses)
    assert block.calls == 4, "B recomputes each checkpointed forward once (not once per engine run)"
    early = [name for name, p in block.named_parameters() if p.grad is not None]
    assert early == [], f"gradients computed in B under checkpointing: {early}"
    torch.testing.assert_close(x.grad, x_ref.grad)
    store.flush((0, 1))
    store.flush((0, 0))
    assert block.calls == 4, "W must not recompute the checkpointed forward"
    assert_grads_equal(block, reference)
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
    split_backward(model, store, losses)
    w_after_b(model, store, reference)


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
    split_backward(model, store, [model(x).square().sum()])
    assert all(p.grad is None for p in model.parameters())
    store.flush((0, 0))
    assert_grads_equal(model, reference)
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
    split_backward(model, store, [loss])
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
    split_backward(layer, store, [layer(input=x).sum()])
    assert layer.weight.grad is None
    store.flush((0, 0))
    assert_grads_equal(layer, reference)


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
    split_backward(layer, store, [layer(x).sin().sum()])
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
    split_backward(layer, store, [layer(x).sin().sum() for x in inputs])
    assert all(p.grad is None for p in layer.parameters())
    for x, expected in zip(inputs, references):
        if x.requires_grad:
            torch.testing.assert_close(x.grad, expected.grad, rtol=1e-5, atol=1e-6)
    store.flush((0, 1))
    store.flush((0, 0))
    assert_grads_equal(layer, reference)
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
    split_backward(model, store, [model(x).square().sum() for x in batches])
    w_after_b(model, store, reference)


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
    split_backward(block, store, [loss])
    assert all(p.grad is None for p in block.parameters()), "offloading must not move W into B"
    torch.testing.assert_close(x.grad, x_ref.grad)
    store.flush((0, 0))
    assert_grads_equal(block, reference)


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
    assert_grads_equal(model, reference)
