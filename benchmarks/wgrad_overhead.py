"""Two measurements behind docs/wgrad.md, one thread, thread CPU time, medians:

1. the per-layer cost the split adds around the kernels: T_B + T_W − fused backward per layer, for 20
   tiny Linear(16) or LayerNorm(16) layers on 4 rows (the kernels take a few microseconds), fast paths
   and the generic split;
2. ``native_layer_norm_backward`` on CPU with each output mask, 32 and 512 rows of 256.

    python benchmarks/wgrad_overhead.py
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
from torch import nn

from zerobubble.runtime.wgrad import FastPaths, WeightGradStore, install_deferral


def per_layer_overhead(make, layers: int = 20, repeats: int = 300) -> dict[str, float]:
    """Microseconds per layer: fused backward, and the extra of the fast and the generic split."""
    fused = nn.Sequential(*[make() for _ in range(layers)])
    fast, generic = copy.deepcopy(fused), copy.deepcopy(fused)
    stores = {"fast": WeightGradStore(), "generic": WeightGradStore()}
    install_deferral([fast], stores["fast"])
    install_deferral([generic], stores["generic"], FastPaths())
    x = torch.randn(4, 16, requires_grad=True)
    times: dict[str, list[float]] = {"fused": [], "fast": [], "generic": []}
    for repeat in range(repeats):
        for name, model in (("fused", fused), ("fast", fast), ("generic", generic)):
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


def main() -> None:
    torch.set_num_threads(1)
    print("| layer | fused backward (µs) | fast split extra (µs) | generic split extra (µs) |")
    print("|---|---|---|---|")
    for label, make in (
        ("Linear(16)", lambda: nn.Linear(16, 16)),
        ("LayerNorm(16)", lambda: nn.LayerNorm(16)),
    ):
        costs = per_layer_overhead(make)
        print(
            f"| {label} | {costs['fused']:.1f} | {costs['fast extra']:.1f} | {costs['generic extra']:.1f} |"
        )
    print("\n| native_layer_norm_backward, rows × 256 | all (µs) | input only (µs) | weights only (µs) |")
    print("|---|---|---|---|")
    for rows in (32, 512):
        costs = layer_norm_masks(rows)
        print(f"| {rows} | {costs['all']:.1f} | {costs['input only']:.1f} | {costs['weights only']:.1f} |")


if __name__ == "__main__":
    main()
