"""Sections ``routing``, ``generic``, ``floor`` and ``direct`` of ``benchmarks/wgrad_overhead.py``.

* ``routing``: routed ``F.linear`` (``FastPaths.route_linear``) on the bench's
  ``nn.MultiheadAttention`` block: (T_B + T_W) / fused backward with routing on and off, side by
  side, the forward's cost of the routing mode, and the mode's cost per torch call;
* ``generic``: the generic split of each bench stage (an empty registry, no routing) as installed,
  with W starting from the outputs instead of the frontier, with the norm kernels' parameter
  gradients computed by a second masked call in W, and with neither (the previous release), side
  by side;
* ``floor``: the generic split as installed against a split without its per-module machinery (one
  B engine run of the whole stage graph, W from the stage's frontier): what the bridges and nested
  engine runs cost;
* ``direct``: modules whose parameters all take routed calls (the bench's attention and
  raw-parameter blocks) running on the stage's graph after their first forward (the default)
  against a local graph at every forward, side by side.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from functools import partial
from typing import Any
from unittest import mock

import torch
from torch import nn

from _wgrad_timing import (
    Split,
    Step,
    install_split,
    print_regimes,
    split_ratios,
    stages_side_by_side,
    step_ratios,
    store_step,
)
from zerobubble.runtime.wgrad import (
    FastPaths,
    WeightGradStore,
    default_fast_paths,
    frontier,
    generic,
    install_deferral,
)
from zerobubble.runtime.wgrad.store import accumulate_each


def _attention_variants() -> tuple[nn.Module, dict[str, tuple[nn.Module, WeightGradStore, bool]]]:
    """The bench's MultiheadAttention block: a plain copy, and copies split with routing on and off."""
    from zerobubble_bench.wgrad import split_stages

    _, make, _ = split_stages(["mha"])[0]
    variants = {}
    for name, route in (("routed", True), ("not routed", False)):
        module, store, paths = make(), WeightGradStore(), default_fast_paths()
        paths.route_linear = route
        install_deferral([module], store, paths)
        variants[name] = (module, store, True)
    return make(), variants


def routing_split_cost(rows: int, repeats: int = 41) -> dict[str, float]:
    """(T_B + T_W) / fused backward of the MultiheadAttention block, routing on and off."""
    fused, variants = _attention_variants()
    return split_ratios(fused, variants, torch.randn(1, rows, 256, requires_grad=True), repeats)


def routing_forward_cost(rows: int, repeats: int = 61) -> dict[str, float]:
    """Microseconds of the block's forward with routing off, and the median extra with it on."""
    _, variants = _attention_variants()
    x = torch.randn(1, rows, 256, requires_grad=True)
    plain, extra = [], []
    for repeat in range(repeats + 1):
        times = {}
        for name in list(variants) if repeat % 2 else list(variants)[::-1]:
            module = variants[name][0]
            started = time.thread_time()
            for _ in range(5):
                module(x)
            times[name] = (time.thread_time() - started) / 5 * 1e6
        if repeat:
            plain.append(times["not routed"])
            extra.append(times["routed"] - times["not routed"])
    return {"forward": statistics.median(plain), "extra": statistics.median(extra)}


def mode_cost_per_call(repeats: int = 15, calls: int = 2000) -> dict[str, float]:
    """Microseconds per torch call (elementwise ops, a transpose, a ``.shape`` read) with and without
    the routing mode active."""
    from zerobubble.runtime.wgrad.routed import LinearRouter

    x = torch.randn(8, 16)
    router = LinearRouter(WeightGradStore())

    def loop() -> float:
        started = time.thread_time()
        for _ in range(calls // 4):
            y = (x * 2 + x).transpose(0, 1)
            y.shape  # noqa: B018  # a property read is a torch call too
        return (time.thread_time() - started) / calls * 1e6

    plain, routed = [], []
    for _ in range(repeats):
        plain.append(loop())
        with router:
            routed.append(loop())
    return {"plain": statistics.median(plain), "mode": statistics.median(routed)}


def print_routing() -> None:
    """Section ``routing``: routed ``F.linear`` on the MultiheadAttention block."""
    print("\n| MultiheadAttention block d=256, rows | (T_B+T_W)/fused routed | not routed "
          "| forward, not routed (µs) | forward extra when routed (µs) |")  # fmt: skip
    print("|---|---|---|---|---|")
    for rows in (32, 128, 512):
        split = routing_split_cost(rows, repeats=41 if rows < 512 else 11)
        forward = routing_forward_cost(rows, repeats=61 if rows < 512 else 15)
        print(
            f"| {rows} | {split['routed']:.3f} | {split['not routed']:.3f} "
            f"| {forward['forward']:.0f} | {forward['extra']:.0f} |"
        )
    per_call = mode_cost_per_call()
    print(f"\ntorch call: {per_call['plain']:.2f} µs plain, {per_call['mode']:.2f} µs under the routing mode")


class _WithSettings(nn.Module):
    """A split module whose forward runs with module constants of the split replaced (for comparison:
    the generic split reads them while it builds a local graph, B and W only follow what it built)."""

    def __init__(self, module: nn.Module, settings: dict[tuple[Any, str], Any]):
        super().__init__()
        self.module, self.settings = module, settings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with contextlib.ExitStack() as stack:
            for (owner, name), value in self.settings.items():
                stack.enter_context(mock.patch.object(owner, name, value))
            return self.module(x)


GENERIC_VARIANTS = {
    "as installed": {},
    "W from the outputs": {(frontier, "EDGE_ROOTS"): False},
    "norm kernels split": {(generic, "_NORM_NODES"): frozenset()},
    "neither": {(frontier, "EDGE_ROOTS"): False, (generic, "_NORM_NODES"): frozenset()},
}
"""The generic split as installed (norm kernels' parameters in B, W from the frontier), without
each of the two, and without both (the previous release's generic split)."""


def generic_variants(rows: int, fresh: bool, repeats: int = 41) -> dict[str, dict[str, float]]:
    """(T_B + T_W) / fused backward of each bench stage split generically (an empty registry, no
    routing), for each of :data:`GENERIC_VARIANTS`, side by side."""

    def generic_split(settings: dict[tuple[Any, str], Any]) -> Split:
        def split(module: nn.Module, fused: nn.Module) -> tuple[nn.Module, WeightGradStore]:
            module, store = install_split(module, WeightGradStore(), FastPaths())
            return _WithSettings(module, settings), store

        return split

    splits = {name: generic_split(settings) for name, settings in GENERIC_VARIANTS.items()}
    return stages_side_by_side(splits, rows, repeats, fresh)


def print_generic() -> None:
    """Section ``generic``: the generic split with and without its two exceptions."""
    columns = {name: name for name in GENERIC_VARIANTS}
    print_regimes("generic split: stage, rows, .grad", columns, generic_variants)


def stage_frontier_floor(rows: int, fresh: bool, repeats: int = 41) -> dict[str, dict[str, float]]:
    """(T_B + T_W) / fused backward per bench stage: the generic split as installed (a bridge and a
    nested engine run per module in B) against a split with neither — B one engine run of the
    whole stage graph to its input (``torch.autograd.grad``, graph kept; the parameters that only
    norm kernels use asked for too), W from the frontier of the whole stage, found by the same walk
    (:func:`.frontier.find_frontier`, not timed: the installed split walks at forward time too).
    What the per-module machinery costs; side by side, alternating, in one process."""
    from zerobubble_bench.wgrad import split_stages

    results = {}
    for label, make, shape in split_stages():
        fused, plain = make(), make()
        installed, store = install_split(make(), WeightGradStore(), FastPaths())
        steps: dict[str, tuple[nn.Module, Step]] = {
            "generic split": (installed, store_step(installed, store, True)),
            "stage frontier": (plain, partial(_stage_frontier_step, plain)),
        }
        x = torch.randn(*shape(rows), requires_grad=True)
        results[label] = step_ratios(fused, steps, x, repeats, fresh)
    return results


def _stage_frontier_step(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> float:
    """Forward, then B and W of the stage-frontier split: the seconds B and W took."""
    out = module(x)
    leaves = generic.reachable_leaves([out], [x])
    if leaves.graph is None:
        raise RuntimeError("a bench stage with a single node: no frontier to start W from")
    found = frontier.find_frontier([out], [x], leaves.deferred, leaves.graph)
    started = time.thread_time()
    if found is not None:
        found.arm()
    grads = torch.autograd.grad(out, (x, *leaves.in_b), grad, retain_graph=True)
    with torch.no_grad():
        if found is not None:
            found.weight_pass()
        else:  # W from the outputs
            generic.run_engine([out], [grad], leaves.deferred, keep_graph=False, accumulate=True)
        accumulate_each(leaves.in_b, grads[1:], True)
    return time.thread_time() - started


def print_floor() -> None:
    """Section ``floor``: the generic split against one B run per stage, W from its frontier."""
    columns = {
        "generic split": "generic split (installed)",
        "stage frontier": "one B run per stage, W from its frontier",
    }
    print_regimes("stage, rows, .grad", columns, stage_frontier_floor)


class _LocalGraphs(nn.Module):
    """A split module whose generic modules build a local graph at every forward: none runs on the
    stage's graph (``Deferral.direct`` emptied before each forward)."""

    def __init__(self, module: nn.Module, deferral: Any):
        super().__init__()
        self.module, self.deferral = module, deferral

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.deferral.direct.clear()
        return self.module(x)


def direct_against_local(rows: int, fresh: bool, repeats: int = 41) -> dict[str, dict[str, float]]:
    """(T_B + T_W) / fused backward of the bench's attention and raw-parameter blocks (default
    split): their routed modules on the stage's graph (the default after the first forward) against
    a local graph at every forward, side by side."""
    from zerobubble_bench.wgrad import split_stages

    results = {}
    for label, make, shape in split_stages(["mha", "raw"]):
        variants: dict[str, tuple[nn.Module, WeightGradStore, bool]] = {}
        for name in ("stage's graph", "local graph"):
            module, store = make(), WeightGradStore()
            deferral = install_deferral([module], store)
            timed = module if name == "stage's graph" else _LocalGraphs(module, deferral)
            variants[name] = (timed, store, True)
        x = torch.randn(*shape(rows), requires_grad=True)
        results[label] = split_ratios(make(), variants, x, repeats, fresh)
    return results


def print_direct() -> None:
    """Section ``direct``: routed modules on the stage's graph against a local graph every forward."""
    columns = {
        "stage's graph": "on the stage's graph (default)",
        "local graph": "a local graph every forward",
    }
    print_regimes("routed modules: stage, rows, .grad", columns, direct_against_local)
