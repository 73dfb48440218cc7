"""The timing harness of ``benchmarks/wgrad_overhead.py``: one thread, thread CPU time, medians.

A variant's *step* is its forward and then its backward (B and W), timed from the backward's start;
:func:`step_ratios` times each variant's step against the fused backward of the same stage, the
variants' order alternating, and :func:`stages_side_by_side` does so for every stage of
``zerobubble bench wgrad``.  :func:`print_regimes` prints such ratios as a table.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from zerobubble.runtime.wgrad import FastPaths, WeightGradStore, default_fast_paths, install_deferral


def function_fast_paths(model: nn.Module) -> FastPaths:
    """The default registry, except that the rules of ``model``'s module types run B in the
    autograd function instead of autograd's own nodes (the fast paths before they used those)."""
    paths = default_fast_paths()
    for module in model.modules():
        rule = paths.rule_for(module)
        if rule is not None and rule.native_backward:
            rule = copy.copy(rule)
            rule.native_backward = False
            paths.register(type(module), rule)
    return paths


Step = Callable[[torch.Tensor, torch.Tensor], float]
"""One variant's forward on ``x``, then its backward (B and W) for ``grad``: the seconds the backward took."""


def store_step(module: nn.Module, store: WeightGradStore, defer: bool) -> Step:
    """The step of a module split by :func:`install_deferral` with ``store``."""

    def step(x: torch.Tensor, grad: torch.Tensor) -> float:
        out = module(x)
        started = time.thread_time()
        store.begin((0, 0), defer)
        out.backward(grad)
        store.end()
        if defer:
            store.flush((0, 0))
        return time.thread_time() - started

    return step


def step_ratios(
    fused: nn.Module,
    steps: dict[str, tuple[nn.Module, Step]],
    x: torch.Tensor,
    repeats: int,
    fresh: bool = False,
) -> dict[str, float]:
    """Median (T_B + T_W) / fused backward of each ``(module, step)`` variant, each repeat timing the
    fused backward and then every variant (their order alternating, so that none always runs right
    after the fused one).  ``fresh``: every ``.grad`` is reset after each repeat (a step's first
    microbatch)."""
    ratios: dict[str, list[float]] = {name: [] for name in steps}
    for repeat in range(repeats + 1):
        out = fused(x)
        grad = torch.ones_like(out)
        started = time.thread_time()
        out.backward(grad)
        fused_time = time.thread_time() - started
        for name in list(steps) if repeat % 2 else list(steps)[::-1]:
            module, step = steps[name]
            elapsed = step(x, grad)
            if repeat:  # the first repeat warms up
                ratios[name].append(elapsed / fused_time)
            if fresh:
                module.zero_grad(set_to_none=True)
            x.grad = None
        if fresh:
            fused.zero_grad(set_to_none=True)
        x.grad = None
    return {name: statistics.median(values) for name, values in ratios.items()}


def split_ratios(
    fused: nn.Module,
    variants: dict[str, tuple[nn.Module, WeightGradStore, bool]],
    x: torch.Tensor,
    repeats: int,
    fresh: bool = False,
) -> dict[str, float]:
    """Median (T_B + T_W) / fused backward of each ``(module, store, defer)`` variant
    (:func:`step_ratios`); ``defer=False`` runs the split layers without deferring W."""
    steps = {name: (variant[0], store_step(*variant)) for name, variant in variants.items()}
    return step_ratios(fused, steps, x, repeats, fresh)


Split = Callable[[nn.Module, nn.Module], tuple[nn.Module, WeightGradStore]]
"""Splits a fresh copy of a bench stage (given the fused one): the module to run and its store."""


def stages_side_by_side(
    splits: dict[str, Split], rows: int, repeats: int, fresh: bool = False
) -> dict[str, dict[str, float]]:
    """(T_B + T_W) / fused backward of every bench stage for each of ``splits``, side by side in one
    process (:func:`split_ratios`)."""
    from zerobubble_bench.wgrad import split_stages

    results = {}
    for label, make, shape in split_stages():
        fused = make()
        variants = {name: (*split(make(), fused), True) for name, split in splits.items()}
        x = torch.randn(*shape(rows), requires_grad=True)
        results[label] = split_ratios(fused, variants, x, repeats, fresh)
    return results


def install_split(
    module: nn.Module, store: WeightGradStore, paths: FastPaths | None = None
) -> tuple[nn.Module, WeightGradStore]:
    """Split ``module`` into ``store`` (``paths``: the default registry when None): both, to run."""
    install_deferral([module], store, paths)
    return module, store


def default_split(module: nn.Module, fused: nn.Module) -> tuple[nn.Module, WeightGradStore]:
    """A :data:`Split`: the default registry, a store of its own."""
    return install_split(module, WeightGradStore())


def print_regimes(
    first: str, columns: dict[str, str], compute: Callable[[int, bool], dict[str, dict[str, float]]]
) -> None:
    """A table of ``compute(rows, fresh)`` per stage: ``.grad`` accumulating and fresh, 32 and 128 rows;
    ``columns`` maps each variant to its header."""
    print(f"\n| {first} | " + " | ".join(columns.values()) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for fresh in (False, True):
        for rows in (32, 128):
            for label, ratios in compute(rows, fresh).items():
                regime = "fresh" if fresh else "accumulating"
                cells = " | ".join(f"{ratios[name]:.3f}" for name in columns)
                print(f"| {label}, {rows}, {regime} | {cells} |", flush=True)
