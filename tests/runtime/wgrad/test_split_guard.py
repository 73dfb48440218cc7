"""The split guard (``wgrad/verify.py``): each stage checks its split against plain autograd on a
new path, falls back where it disagrees (or raises with ``verify="strict"``) and leaves no trace."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from _dist import LocalComm
from torch import nn

from zerobubble.runtime.construct.staging import StageModule
from zerobubble.runtime.execute.executor import Executor, StageState
from zerobubble.runtime.wgrad import (
    FastPaths,
    SplitGuard,
    SplitMismatchError,
    SplitMismatchWarning,
    SplitRule,
    WeightGradStore,
    default_fast_paths,
    install_deferral,
)
from zerobubble.schedule import build_schedule

WIDTH = 6


class Scale(nn.Module):
    """``x * weight``: a user layer with a user's split rule."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(WIDTH) + 0.5)

    def forward(self, x):
        return x * self.weight


class ScaleRule(SplitRule):
    """A split rule for :class:`Scale`; ``factor`` != 1 makes its weight gradient wrong."""

    autocast = "keep"

    def __init__(self, factor: float = 1.0):
        self.factor = factor

    def param_names(self, module):
        return ("weight",)

    def forward(self, module, x, params):
        return x * params[0], (x, params[0])

    def input_grad(self, module, saved, grad_output):
        return grad_output * saved[1]

    def weight_grads(self, module, saved, grad_output, needed):
        grad = (grad_output * saved[0]).reshape(-1, WIDTH).sum(0)
        return [grad * self.factor]


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(WIDTH, WIDTH), Scale(), nn.BatchNorm1d(WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)]


def _guarded(layers, rule_factor=None, strict=False, deferred=True, fused=False):
    paths = default_fast_paths()
    if rule_factor is not None:
        paths.register(Scale, ScaleRule(rule_factor))
    store = WeightGradStore()
    deferral = install_deferral(layers, store, paths)
    module = StageModule(layers)
    names = {id(m): f"layers.{i}" for i, m in enumerate(layers)}
    guard = SplitGuard(
        stage=0, module=module, store=store, deferral=deferral, names=names,
        strict=strict, deferred=deferred, fused=fused,
    )  # fmt: skip
    return module, store, deferral, guard


def _train(module, store, batches, defer=True):
    for j, (x, g) in enumerate(batches):
        with store.keyed_forward((0, j)):
            out = module(x)
        store.begin((0, j), defer)
        out.backward(g)
        store.end()
        if defer:
            store.flush((0, j))


def _batches(count=3):
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4, WIDTH, generator=generator), torch.randn(4, WIDTH, generator=generator))
        for _ in range(count)
    ]


def _plain_grads(layers, batches):
    reference = copy.deepcopy(layers)
    for x, g in batches:
        nn.Sequential(*reference)(x).backward(g)
    return [p.grad for layer in reference for p in layer.parameters()]


def test_a_wrong_user_rule_falls_back_with_a_warning_naming_module_and_parameter_and_trains_exactly():
    layers = _layers()
    expected = _plain_grads(layers, _batches())
    module, store, deferral, guard = _guarded(layers, rule_factor=2.0)
    x = _batches()[0][0]
    with pytest.warns(
        SplitMismatchWarning, match=r"layers\.1 \(Scale, fast path \(ScaleRule\)\).*layers\.1\.weight"
    ):
        guard.before_forward((x,))
    assert deferral.path_of(layers[1]) == "plain autograd (fallback)"
    assert deferral.path_of(layers[0]) == "fast path (MatmulRule)"  # the others keep their split
    report = {record.module: record for record in guard.report()}
    assert report["layers.1"].path == "plain autograd (fallback)" and "ScaleRule" in report["layers.1"].note
    assert all(record.verified for record in report.values())
    _train(module, store, _batches())
    for got, want in zip([p.grad for layer in layers for p in layer.parameters()], expected):
        torch.testing.assert_close(got, want)


def test_the_wrong_rule_would_have_trained_wrong_without_the_guard():
    """The check above is not vacuous: unguarded, the same rule gives a wrong gradient."""
    layers = _layers()
    expected = _plain_grads(layers, _batches())
    module, store, _, _ = _guarded(layers, rule_factor=2.0)
    _train(module, store, _batches())
    assert not torch.allclose(layers[1].weight.grad, expected[2])


def test_strict_raises_and_names_what_differs():
    layers = _layers()
    _, _, deferral, guard = _guarded(layers, rule_factor=0.5, strict=True)
    with pytest.raises(SplitMismatchError, match=r"layers\.1\.weight gets a gradient .* off plain autograd"):
        guard.before_forward((_batches()[0][0],))
    assert not deferral.fallen


def test_a_rule_that_raises_falls_back_too():
    class Broken(ScaleRule):
        def weight_grads(self, module, saved, grad_output, needed):
            raise ValueError("rule bug")

    layers = _layers()
    paths = default_fast_paths()
    paths.register(Scale, Broken())
    store = WeightGradStore()
    deferral = install_deferral(layers, store, paths)
    guard = SplitGuard(
        stage=0, module=StageModule(layers), store=store, deferral=deferral, names={}, strict=False,
        deferred=True, fused=False,
    )  # fmt: skip
    with pytest.warns(SplitMismatchWarning, match="rule bug"):
        guard.before_forward((_batches()[0][0],))
    assert deferral.path_of(layers[1]) == "plain autograd (fallback)"


def test_a_correct_split_passes_and_the_check_leaves_no_trace():
    """No warning; .grad, buffers, the RNG stream and the pending work are as before; no hook ran."""
    layers = _layers()
    module, store, deferral, guard = _guarded(layers, rule_factor=1.0, fused=True)
    for p in module.parameters():
        p.grad = torch.full_like(p, 3.0)
    fired = []
    for p in module.parameters():
        p.register_hook(lambda g: fired.append("pre"))
        p.register_post_accumulate_grad_hook(lambda p: fired.append("post"))
    buffers = [b.clone() for b in module.buffers()]
    rng = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guard.before_forward((_batches()[0][0],))
    assert fired == []
    assert all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in module.parameters())
    assert all(torch.equal(a, b) for a, b in zip(buffers, module.buffers()))
    assert torch.equal(rng, torch.get_rng_state())
    assert store.pending_keys() == []
    assert not deferral.fallen
    assert all(record.verified for record in guard.report())


def test_each_path_is_checked_once_and_a_new_shape_or_autocast_is_checked_again():
    layers = _layers()
    _, _, _, guard = _guarded(layers)
    calls = []
    original = guard._check
    guard._check = lambda inputs: calls.append(1) or original(inputs)  # type: ignore[method-assign]
    x = torch.randn(4, WIDTH)
    guard.before_forward((x,))
    first = len(calls)  # Scale has no rule here: generic, then on the stage's graph: two paths
    assert first == 2
    guard.before_forward((x + 1,))
    assert len(calls) == first
    guard.before_forward((torch.randn(7, WIDTH),))
    assert len(calls) == first + 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        guard.before_forward((torch.randn(7, WIDTH),))
        # BatchNorm's rule takes the generic split under autocast: one more path, checked too
        autocast_checks = len(calls)
        assert autocast_checks > first + 1
        guard.before_forward((torch.randn(7, WIDTH),))
    assert len(calls) == autocast_checks


class Routed(nn.Module):
    """A generic module whose routed forward moves to the stage's graph after its first call."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) * 0.3)
        self.bias = nn.Parameter(torch.randn(WIDTH))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


def test_a_path_taken_after_the_first_forward_is_checked_before_it_runs():
    """The generic module goes to the stage's graph after its first routed forward: the guard sees
    the split's version change and checks that path too before the real forward takes it."""
    layers = [Routed(), nn.Tanh()]
    _, _, deferral, guard = _guarded(layers)
    guard.before_forward((torch.randn(3, WIDTH, requires_grad=True),))
    assert deferral.path_of(layers[0]) == "generic, routed, on the stage's graph"
    assert guard._checks == 2 and deferral.version() in guard._versions


def test_the_executor_runs_the_guard_before_the_first_forward_and_trains_exactly():
    """zb-h1 on one rank, a wrong user rule: the step's gradients equal one process's."""
    layers = _layers()
    reference = copy.deepcopy(layers)
    paths = default_fast_paths()
    paths.register(Scale, ScaleRule(3.0))
    store = WeightGradStore()
    deferral = install_deferral(layers, store, paths)
    state = StageState(0, StageModule(layers), store, True, True, "stage 0")
    state.guard = SplitGuard(
        stage=0, module=state.module, store=store, deferral=deferral, names={}, strict=False,
        deferred=True, fused=False,
    )  # fmt: skip
    schedule = build_schedule("zb-h1", 1, 4)
    executor = Executor(schedule, 0, {0: state}, LocalComm(), F.mse_loss)  # type: ignore[arg-type]
    batches = _batches(4)
    with pytest.warns(SplitMismatchWarning):
        executor.run_step([(x,) for x, _ in batches], [g for _, g in batches])
    losses = [F.mse_loss(nn.Sequential(*reference)(x), g) for x, g in batches]
    (sum(losses) / 4).backward()
    for got, want in zip(
        [p.grad for layer in layers for p in layer.parameters()],
        [p.grad for layer in reference for p in layer.parameters()],
    ):
        torch.testing.assert_close(got, want)


def test_the_generic_split_alone_passes_on_a_checkpointed_model():
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()), Scale()]
    store = WeightGradStore()
    deferral = install_deferral(layers, store, FastPaths())
    guard = SplitGuard(
        stage=0, module=StageModule(layers), store=store, deferral=deferral, names={}, strict=True,
        deferred=True, fused=True,
    )  # fmt: skip
    guard.before_forward((torch.randn(2, WIDTH, requires_grad=True),))
    assert not deferral.fallen


def test_rules_are_checked_at_registration():
    """Each flag combination names what it needs; a rule missing it is refused with that."""

    class NoWeights(SplitRule):
        def forward(self, module, x, params):
            return x * params[0], (x,)

        def input_grad(self, module, saved, grad_output):
            return grad_output

    class BadAutocast(ScaleRule):
        autocast = "sometimes"

    class AllAtOnce(SplitRule):
        weights_in_b = True

        def forward(self, module, x, params):
            return x * params[0], (x, params[0])

        def all_grads(self, module, saved, grad_output, input_needed, needed):
            return grad_output * saved[1], [(grad_output * saved[0]).reshape(-1, WIDTH).sum(0)]

    paths = FastPaths()
    with pytest.raises(TypeError, match=r"NoWeights .* must implement forward\+input_grad\+weight_grads or"):
        paths.register(Scale, NoWeights())
    with pytest.raises(TypeError, match="autocast = 'sometimes': use one of cast, keep, generic"):
        paths.register(Scale, BadAutocast())
    paths.register(Scale, AllAtOnce())  # weights_in_b: all_grads is enough
    paths.register(Scale, ScaleRule())


def test_a_stage_that_never_agrees_ends_on_plain_autograd():
    """Checks that keep failing (a path that keeps moving) end with every module falling back,
    never with the disagreeing split marked as checked."""
    layers = _layers()
    _, _, deferral, guard = _guarded(layers)
    guard._check = lambda inputs: False  # type: ignore[method-assign]
    with pytest.warns(SplitMismatchWarning, match="no agreement with plain autograd within 6 checks"):
        guard.before_forward((torch.randn(4, WIDTH),))
    assert deferral.modules == [] and len(deferral.fallen) == 4
    assert all(record.path == "plain autograd (fallback)" and record.verified for record in guard.report())
