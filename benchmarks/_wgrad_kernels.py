"""Sections ``layers``, ``masks``, ``conv``, ``order`` and ``native`` of ``benchmarks/wgrad_overhead.py``.

* ``layers``: the per-layer cost the split adds around the kernels: T_B + T_W − fused backward per
  layer, for 20 tiny Linear(16), LayerNorm(16) or Conv2d(4, 3×3) layers (the kernels take
  microseconds), fast paths (B through autograd's own nodes, and through the autograd function) and
  the generic split;
* ``masks``: ``native_layer_norm_backward`` on CPU with each output mask, 32 and 512 rows of 256; and
  ``convolution_backward`` (oneDNN on CPU) at the conv stage of ``zerobubble bench wgrad``: the
  input-only and weight-only calls against the one call computing both, timed back to back;
* ``conv``: that stage (2 × Conv2d + BatchNorm2d + ReLU) split as usual, split with the convolutions'
  weight gradients computed in B by the full kernel (no W for them): what remains of the split's
  cost when the convolution kernel is not split at all, and split with nothing deferred (the same
  kernels, each layer's weight gradients right after its input gradient): what deferring costs;
* ``order``: the order of W: each bench stage (``zerobubble bench wgrad``'s MLP, GPT block and conv
  stage, 32 and 128 rows, ``.grad`` accumulating) with W taking the layers first to last (the
  store's order) against last to first (B's order), side by side in this process;
* ``native``: B through autograd's own nodes (the fast paths' default) against B through the
  autograd function running the rules' backward (``SplitRule.native_backward = False``), for each
  bench stage at 32 and 128 rows, ``.grad`` accumulating and fresh.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
from torch import nn

from _wgrad_timing import (
    default_split,
    function_fast_paths,
    install_split,
    print_regimes,
    split_ratios,
    stages_side_by_side,
)
from zerobubble.runtime.wgrad import FastPaths, WeightGradStore, default_fast_paths, install_deferral
from zerobubble.runtime.wgrad.rules import ConvRule


def per_layer_overhead(
    make, layers: int = 20, repeats: int = 300, shape: tuple[int, ...] = (4, 16)
) -> dict[str, float]:
    """Microseconds per layer: fused backward, and the extra of the fast split (B through autograd's
    own nodes, and through the autograd function) and of the generic split."""
    fused = nn.Sequential(*[make() for _ in range(layers)])
    models = {"fused": fused}
    models.update((name, copy.deepcopy(fused)) for name in ("fast", "function", "generic"))
    stores = {name: WeightGradStore() for name in ("fast", "function", "generic")}
    install_deferral([models["fast"]], stores["fast"])
    install_deferral([models["function"]], stores["function"], function_fast_paths(fused))
    install_deferral([models["generic"]], stores["generic"], FastPaths())
    x = torch.randn(*shape, requires_grad=True)
    times: dict[str, list[float]] = {name: [] for name in models}
    for repeat in range(repeats):
        for name, model in models.items() if repeat % 2 else list(models.items())[::-1]:
            out = model(x)
            grad = torch.ones_like(out)
            started = time.thread_time()
            if name == "fused":
                out.backward(grad)
            else:
                stores[name].begin((0, 0), True)
                out.backward(grad)
                stores[name].end()
                stores[name].flush((0, 0))
            if repeat >= 30:
                times[name].append((time.thread_time() - started) / layers * 1e6)
            model.zero_grad()
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "fused": medians["fused"],
        "fast extra": medians["fast"] - medians["fused"],
        "function extra": medians["function"] - medians["fused"],
        "generic extra": medians["generic"] - medians["fused"],
    }


def layer_norm_masks(rows: int, width: int = 256, repeats: int = 30) -> dict[str, float]:
    """Microseconds of one ``native_layer_norm_backward`` call per output mask."""
    x, grad = torch.randn(rows, width), torch.randn(rows, width)
    weight, bias = torch.rand(width), torch.rand(width)
    _, mean, rstd = torch.native_layer_norm(x, [width], weight, bias, 1e-5)
    masks = {
        "all": [True, True, True],
        "input only": [True, False, False],
        "weights only": [False, True, True],
    }
    results = {}
    for name, mask in masks.items():
        samples = []
        for _ in range(repeats):
            started = time.thread_time()
            for _ in range(20):
                torch.ops.aten.native_layer_norm_backward(grad, x, [width], mean, rstd, weight, bias, mask)
            samples.append((time.thread_time() - started) / 20 * 1e6)
        results[name] = statistics.median(samples)
    return results


def convolution_masks(rows: int, repeats: int = 41) -> dict[str, float]:
    """One full ``convolution_backward`` (µs) and the input-only + weight-only pair against it (ratio)."""
    x, grad = torch.randn(rows, 32, 8, 8), torch.randn(rows, 32, 8, 8)
    weight = torch.randn(32, 32, 3, 3)

    def backward(mask: list[bool]) -> None:
        torch.ops.aten.convolution_backward(
            grad, x, weight, [32], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, mask
        )

    calls = max(1, 256 // rows)
    full, ratios = [], []
    for repeat in range(repeats + 1):
        started = time.thread_time()
        for _ in range(calls):
            backward([True, True, True])
        middle = time.thread_time()
        for _ in range(calls):
            backward([True, False, False])
            backward([False, True, True])
        ended = time.thread_time()
        if repeat:
            full.append((middle - started) / calls * 1e6)
            ratios.append((ended - middle) / (middle - started))
    return {"full": statistics.median(full), "split ratio": statistics.median(ratios)}


class _ConvWeightsInB(ConvRule):
    """The convolution rule computing its weight gradients in B with the full kernel (W only adds)."""

    weights_in_b = True


def conv_stage_without_kernel_split(rows: int, repeats: int = 41) -> dict[str, float]:
    """(T_B + T_W) / fused backward of the bench's conv stage, three ways: split as usual; with the
    convolution kernel not split (its weight gradients computed in B, as the fused backward does);
    and split with the same kernels but nothing deferred (each layer's weight gradients computed
    right after its input gradient, ``store.begin(key, defer=False)``): what deferring W itself costs."""
    from zerobubble_bench.wgrad import split_stages

    _, make, shape = next(stage for stage in split_stages() if stage[0].startswith("2×(Conv2d"))
    unsplit_conv = default_fast_paths()
    unsplit_conv.register(nn.Conv2d, _ConvWeightsInB(2))
    fused = make()
    variants = {}
    for name, paths, defer in (
        ("split", None, True),
        ("conv kernel not split", unsplit_conv, True),
        ("split, W not deferred", None, False),
    ):
        module, store = make(), WeightGradStore()
        install_deferral([module], store, paths)
        variants[name] = (module, store, defer)
    x = torch.randn(*shape(rows), requires_grad=True)
    return split_ratios(fused, variants, x, repeats)


class _BOrderStore(WeightGradStore):
    """A store whose W runs the layers in B's order, last layer first (for comparison only)."""

    def flush(self, key: tuple[int, int]) -> None:
        self._shared.pop(key, None)
        with torch.no_grad():
            for work in self._pending.pop(key, ()):
                work()


def _b_order_split(module: nn.Module, fused: nn.Module) -> tuple[nn.Module, WeightGradStore]:
    """The default split with W in B's order (:class:`_BOrderStore`)."""
    return install_split(module, _BOrderStore())


def w_order(rows: int, repeats: int = 61) -> dict[str, dict[str, float]]:
    """(T_B + T_W) / fused backward per bench stage, W first to last against W last to first."""
    splits = {"first to last": default_split, "last to first": _b_order_split}
    return stages_side_by_side(splits, rows, repeats)


def native_against_function(rows: int, fresh: bool, repeats: int = 41) -> dict[str, dict[str, float]]:
    """(T_B + T_W) / fused backward per bench stage: B through autograd's own nodes (the default)
    against B through the autograd function (:func:`function_fast_paths`), side by side."""

    def function_split(module: nn.Module, fused: nn.Module) -> tuple[nn.Module, WeightGradStore]:
        return install_split(module, WeightGradStore(), function_fast_paths(fused))

    splits = {"native nodes": default_split, "autograd function": function_split}
    return stages_side_by_side(splits, rows, repeats, fresh)


def print_layers() -> None:
    """Section ``layers``: what the split adds per tiny layer."""
    print(
        "| layer | fused backward (µs) | fast split extra (µs) | same, B in the autograd function (µs) "
        "| generic split extra (µs) |"
    )
    print("|---|---|---|---|---|")
    for label, make, shape in (
        ("Linear(16)", lambda: nn.Linear(16, 16), (4, 16)),
        ("LayerNorm(16)", lambda: nn.LayerNorm(16), (4, 16)),
        ("Conv2d(4, 3×3) on 1×4×4×4", lambda: nn.Conv2d(4, 4, 3, padding=1), (1, 4, 4, 4)),
        ("BatchNorm2d(4) on 2×4×4×4", lambda: nn.BatchNorm2d(4), (2, 4, 4, 4)),
    ):
        costs = per_layer_overhead(make, shape=shape)
        print(
            f"| {label} | {costs['fused']:.1f} | {costs['fast extra']:.1f} | {costs['function extra']:.1f} "
            f"| {costs['generic extra']:.1f} |"
        )


def print_masks() -> None:
    """Section ``masks``: the norm's and the convolution's backward kernels per output mask."""
    print("\n| native_layer_norm_backward, rows × 256 | all (µs) | input only (µs) | weights only (µs) |")
    print("|---|---|---|---|")
    for rows in (32, 512):
        costs = layer_norm_masks(rows)
        print(f"| {rows} | {costs['all']:.1f} | {costs['input only']:.1f} | {costs['weights only']:.1f} |")
    print("\n| convolution_backward, rows × 32 × 8 × 8, 3×3 | full (µs) | (input + weights only) / full |")
    print("|---|---|---|")
    for rows in (8, 32, 128):
        conv = convolution_masks(rows)
        print(f"| {rows} | {conv['full']:.0f} | {conv['split ratio']:.3f} |")


def print_conv() -> None:
    """Section ``conv``: the conv stage split, with its kernel unsplit, and with nothing deferred."""
    print(
        "\n| 2×(Conv2d+BatchNorm2d) stage, rows | split | conv kernel not split (weights in B) "
        "| split, W not deferred |"
    )
    print("|---|---|---|---|")
    for rows in (32, 128):
        stage = conv_stage_without_kernel_split(rows)
        print(
            f"| {rows} | {stage['split']:.3f} | {stage['conv kernel not split']:.3f} "
            f"| {stage['split, W not deferred']:.3f} |"
        )


def print_order() -> None:
    """Section ``order``: W first to last against last to first."""
    print("\n| stage, rows | W first to last (the store's order) | W last to first (B's order) |")
    print("|---|---|---|")
    for rows in (32, 128):
        for label, order in w_order(rows).items():
            print(f"| {label}, {rows} | {order['first to last']:.3f} | {order['last to first']:.3f} |")


def print_native() -> None:
    """Section ``native``: B through autograd's own nodes against the autograd function."""
    columns = {
        "native nodes": "B through autograd's own nodes",
        "autograd function": "B through the autograd function",
    }
    print_regimes("stage, rows, .grad", columns, native_against_function)
