"""Measurements behind docs/wgrad.md, one thread, thread CPU time, medians:

1. the per-layer cost the split adds around the kernels: T_B + T_W − fused backward per layer, for 20
   tiny Linear(16), LayerNorm(16) or Conv2d(4, 3×3) layers (the kernels take microseconds), fast
   paths and the generic split;
2. ``native_layer_norm_backward`` on CPU with each output mask, 32 and 512 rows of 256;
3. ``convolution_backward`` (oneDNN on CPU) at the conv stage of ``zerobubble bench wgrad``: the
   input-only and weight-only calls against the one call computing both, timed back to back;
4. that stage (2 × Conv2d + BatchNorm2d + ReLU) split as usual, split with the convolutions'
   weight gradients computed in B by the full kernel (no W for them): what remains of the split's
   cost when the convolution kernel is not split at all, and split with nothing deferred (the same
   kernels, each layer's weight gradients right after its input gradient): what deferring costs;
5. the order of W: each bench stage (``zerobubble bench wgrad``'s MLP, GPT block and conv stage, 32
   and 128 rows, ``.grad`` accumulating) with W taking the layers first to last (the store's order)
   against last to first (B's order), side by side in this process;
6. B through autograd's own nodes (the fast paths' default) against B through the autograd
   function running the rules' backward (``SplitRule.native_backward = False``): per tiny layer (in
   table 1) and for each bench stage at 32 and 128 rows, ``.grad`` accumulating and fresh.
7. routed ``F.linear`` (``FastPaths.route_linear``) on the bench's ``nn.MultiheadAttention`` block:
   (T_B + T_W) / fused backward with routing on and off, side by side, the forward's cost of the
   routing mode, and the mode's cost per torch call.
8. the generic split of each bench stage (an empty registry, no routing) as installed, with W
   starting from the outputs instead of the frontier, with the norm kernels' parameter gradients
   computed by a second masked call in W, and with neither (the previous release), side by side.
9. the generic split as installed against a split without its per-module machinery (one B engine
   run of the whole stage graph, W from the stage's frontier): what the bridges and nested engine
   runs cost.
10. modules whose parameters all take routed calls (the bench's attention and raw-parameter blocks)
   running on the stage's graph after their first forward (the default) against a local graph at
   every forward, side by side.
11. where B's cost above a backward with frozen parameters goes, for the GPT block, the conv stage
   and the attention block (default split, called directly: a post-hook per norm): B as installed,
   with every capture hook a no-op (the hook calls, not their work), with no hooks registered at
   all (the same native nodes; W is not run for these two), and for the first two stages with the
   captures made inside the autograd engine (one grad-mode run; a measurement, not the runtime's B).
12. the norms' alias parameters accumulated by autograd itself in a keyed forward (as the executor
   runs it: no hook on their nodes) against a post-hook per norm (a direct call), side by side.

    python benchmarks/wgrad_overhead.py [section ...]
    (sections: layers masks conv order native routing generic floor direct hooks aliases)
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any
from unittest import mock

import torch
from torch import nn

from zerobubble.runtime.wgrad import (
    FastPaths,
    WeightGradStore,
    default_fast_paths,
    fast,
    frontier,
    generic,
    install_deferral,
    routed,
)
from zerobubble.runtime.wgrad.rules import ConvRule
from zerobubble.runtime.wgrad.store import WeightCapture, accumulate_each


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
    return _split_ratios(fused, variants, x, repeats)


def _split_ratios(
    fused: nn.Module,
    variants: dict[str, tuple[nn.Module, WeightGradStore, bool]],
    x: torch.Tensor,
    repeats: int,
    fresh: bool = False,
) -> dict[str, float]:
    """Median (T_B + T_W) / fused backward of each ``(module, store, defer)`` variant
    (:func:`_step_ratios`); ``defer=False`` runs the split layers without deferring W."""
    steps = {name: (variant[0], _store_step(*variant)) for name, variant in variants.items()}
    return _step_ratios(fused, steps, x, repeats, fresh)


Step = Callable[[torch.Tensor, torch.Tensor], float]
"""One variant's forward on ``x``, then its backward (B and W) for ``grad``: the seconds the backward took."""


def _store_step(module: nn.Module, store: WeightGradStore, defer: bool) -> Step:
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


def _step_ratios(
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


class _BOrderStore(WeightGradStore):
    """A store whose W runs the layers in B's order, last layer first (for comparison only)."""

    def flush(self, key: tuple[int, int]) -> None:
        self._shared.pop(key, None)
        with torch.no_grad():
            for work in self._pending.pop(key, ()):
                work()


Split = Callable[[nn.Module, nn.Module], tuple[nn.Module, WeightGradStore]]
"""Splits a fresh copy of a bench stage (given the fused one): the module to run and its store."""


def stages_side_by_side(
    splits: dict[str, Split], rows: int, repeats: int, fresh: bool = False
) -> dict[str, dict[str, float]]:
    """(T_B + T_W) / fused backward of every bench stage for each of ``splits``, side by side in one
    process (:func:`_split_ratios`)."""
    from zerobubble_bench.wgrad import split_stages

    results = {}
    for label, make, shape in split_stages():
        fused = make()
        variants = {name: (*split(make(), fused), True) for name, split in splits.items()}
        x = torch.randn(*shape(rows), requires_grad=True)
        results[label] = _split_ratios(fused, variants, x, repeats, fresh)
    return results


def _installed(
    module: nn.Module, store: WeightGradStore, paths: FastPaths | None = None
) -> tuple[nn.Module, WeightGradStore]:
    install_deferral([module], store, paths)
    return module, store


def _default_split(module: nn.Module, fused: nn.Module) -> tuple[nn.Module, WeightGradStore]:
    return _installed(module, WeightGradStore())


def _b_order_split(module: nn.Module, fused: nn.Module) -> tuple[nn.Module, WeightGradStore]:
    return _installed(module, _BOrderStore())


def w_order(rows: int, repeats: int = 61) -> dict[str, dict[str, float]]:
    """(T_B + T_W) / fused backward per bench stage, W first to last against W last to first."""
    splits = {"first to last": _default_split, "last to first": _b_order_split}
    return stages_side_by_side(splits, rows, repeats)


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
    return _split_ratios(fused, variants, torch.randn(1, rows, 256, requires_grad=True), repeats)


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
    """Part 7: routed ``F.linear`` on the MultiheadAttention block."""
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


def native_against_function(rows: int, fresh: bool, repeats: int = 41) -> dict[str, dict[str, float]]:
    """(T_B + T_W) / fused backward per bench stage: B through autograd's own nodes (the default)
    against B through the autograd function (:func:`function_fast_paths`), side by side."""

    def function_split(module: nn.Module, fused: nn.Module) -> tuple[nn.Module, WeightGradStore]:
        return _installed(module, WeightGradStore(), function_fast_paths(fused))

    splits = {"native nodes": _default_split, "autograd function": function_split}
    return stages_side_by_side(splits, rows, repeats, fresh)


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
            module, store = _installed(module, WeightGradStore(), FastPaths())
            return _WithSettings(module, settings), store

        return split

    splits = {name: generic_split(settings) for name, settings in GENERIC_VARIANTS.items()}
    return stages_side_by_side(splits, rows, repeats, fresh)


def _print_generic() -> None:
    columns = {name: name for name in GENERIC_VARIANTS}
    _print_regimes("generic split: stage, rows, .grad", columns, generic_variants)


def _print_regimes(
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
        installed, store = _installed(make(), WeightGradStore(), FastPaths())
        steps: dict[str, tuple[nn.Module, Step]] = {
            "generic split": (installed, _store_step(installed, store, True)),
            "stage frontier": (plain, partial(_stage_frontier_step, plain)),
        }
        x = torch.randn(*shape(rows), requires_grad=True)
        results[label] = _step_ratios(fused, steps, x, repeats, fresh)
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
        results[label] = _split_ratios(make(), variants, x, repeats, fresh)
    return results


def _print_direct() -> None:
    columns = {
        "stage's graph": "on the stage's graph (default)",
        "local graph": "a local graph every forward",
    }
    _print_regimes("routed modules: stage, rows, .grad", columns, direct_against_local)


def _no_op_hooks() -> contextlib.ExitStack:
    """Capture hooks that return at once: B pays their calls only."""

    def keep_nothing(hook: Any, grads: Any, outputs: Any) -> tuple[Any, ...]:
        return (grads[0], *(None,) * (len(grads) - 1))  # what the real hook returns, nothing queued

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(WeightCapture, "__call__", lambda hook, grads: None))
    stack.enter_context(mock.patch.object(fast._GradsOfAliases, "__call__", keep_nothing))
    return stack


def _no_hooks() -> contextlib.ExitStack:
    """The fast paths' and routed calls' native nodes built without any capture hook."""

    def input_only(plan: Any, x: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
        return plan.rule.forward(plan.module, x, [p.detach() for p in params])[0]

    def on_aliases(plan: Any, x: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
        return plan.rule.forward(plan.module, x, [p.detach().requires_grad_() for p in params])[0]

    original_product = routed.LinearRouter._product

    def product(router: Any, input: torch.Tensor, weight: Any, bias: Any, targets: Any) -> torch.Tensor:
        if input.requires_grad:
            return targets[3].forward(None, input, (weight,) if bias is None else (weight, bias))[0]
        return original_product(router, input, weight, bias, targets)

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(fast.FastPlan, "_run_input_only", input_only))
    stack.enter_context(mock.patch.object(fast.FastPlan, "_run_on_aliases", on_aliases))
    stack.enter_context(mock.patch.object(routed.LinearRouter, "_product", product))
    return stack


class _EngineCaptures:
    """The fast paths' capture hooks replaced by captures inside the autograd engine.

    The forward records each native node's input edge (and each norm's alias leaves) instead of
    registering a hook; :meth:`backward` asks one ``torch.autograd.grad``-style engine run for the
    stage input's gradient and those edges' gradients (the engine keeps them in C++, no Python is
    called per layer), then hands each to the same :class:`WeightCapture` the hook would have run.
    Fast paths only (not routed calls); a measurement, not a replacement: such a run accumulates
    nothing into ``.grad``, so a leaf it is not asked for would lose its gradient.
    """

    def __init__(self) -> None:
        self.edges: list[Any] = []
        self.takers: list[Callable[[Any], None]] = []

    def patches(self) -> contextlib.ExitStack:
        def input_only(plan: Any, x: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
            needed = tuple(p.requires_grad for p in params)
            out, saved = plan.rule.forward(plan.module, x, [p.detach() for p in params])
            self.edges.append(torch.autograd.graph.get_gradient_edge(out))
            capture = WeightCapture(plan.store, plan.weight_work, saved, needed)
            self.takers.append(lambda grad: capture((grad,)))
            return out

        def on_aliases(plan: Any, x: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
            aliases = [p.detach().requires_grad_() if p.requires_grad else p for p in params]
            grads: list[torch.Tensor | None] = [None] * len(params)  # in the plan's parameter order
            for index, alias in enumerate(aliases):
                if alias.requires_grad:
                    self.edges.append(torch.autograd.graph.get_gradient_edge(alias))
                    self.takers.append(partial(grads.__setitem__, index))
            self.takers.append(lambda _: plan.store.put(partial(plan._add_grads, grads)))
            self.edges.append(None)
            return plan.rule.forward(plan.module, x, aliases)[0]

        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch.object(fast.FastPlan, "_run_input_only", input_only))
        stack.enter_context(mock.patch.object(fast.FastPlan, "_run_on_aliases", on_aliases))
        return stack

    def backward(self, out: torch.Tensor, grad: torch.Tensor, x: torch.Tensor) -> None:
        """B of ``out``: ``x.grad`` and every recorded capture from one engine run."""
        edges = (x, *(edge for edge in self.edges if edge is not None))
        # the engine itself: through torch.autograd.grad this section measured 100-300 µs more
        grads = iter(generic.run_engine((out,), (grad,), edges, keep_graph=False))
        x.grad = next(grads)
        for edge, take in zip(self.edges, self.takers):
            take(None if edge is None else next(grads))
        self.edges, self.takers = [], []


def b_above_frozen(rows: int, repeats: int = 101) -> dict[str, dict[str, float]]:
    """Per bench stage: microseconds of B above a backward whose parameters are frozen (which runs
    the same input-gradient kernels), for B as installed, with no-op capture hooks, with none, and
    with the captures made inside the engine (GPT block and conv stage, whose hooks are all fast
    paths')."""
    from zerobubble_bench.wgrad import split_stages

    variants = {"installed": contextlib.ExitStack, "no-op hooks": _no_op_hooks, "no hooks": _no_hooks}
    results = {}
    # not the raw-parameter block: its routed biases and norms register hooks of their own
    for stage, (label, make, shape) in zip(["gpt", "conv", "mha"], split_stages(["gpt", "conv", "mha"])):
        captures = _EngineCaptures() if stage != "mha" else None
        names = [*variants, *(["engine capture"] if captures else [])]
        frozen = make().requires_grad_(False)
        split = {name: _installed(make(), WeightGradStore()) for name in names}
        x = torch.randn(*shape(rows), requires_grad=True)
        extra: dict[str, list[float]] = {name: [] for name in names}
        last_grads: dict[str, list[torch.Tensor]] = {}
        for repeat in range(repeats + 1):
            # each variant right after its own frozen reference, the variants' order rotating: what
            # ran just before changes what is still in the caches, by more than these differences
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                out = frozen(x)
                started = time.thread_time()
                out.backward(torch.ones_like(out))
                reference = time.thread_time() - started
                x.grad = None
                module, split_store = split[name]
                engine_run = name == "engine capture" and captures is not None
                with captures.patches() if engine_run else variants[name]():
                    out = module(x)
                    started = time.thread_time()
                    split_store.begin((0, 0), True)
                    if engine_run:
                        captures.backward(out, torch.ones_like(out), x)
                    else:
                        out.backward(torch.ones_like(out))
                    split_store.end()
                    elapsed = time.thread_time() - started
                if name in ("installed", "engine capture"):
                    split_store.flush((0, 0))
                else:  # nothing (or no real work) was queued: drop it and what the aliases got
                    split_store.clear()
                if repeat == repeats and name in ("installed", "engine capture"):
                    last_grads[name] = [p.grad.clone() for p in module.parameters() if p.grad is not None]
                module.zero_grad(set_to_none=True)
                if repeat:
                    extra[name].append((elapsed - reference) * 1e6)
            x.grad = None
        if captures is not None:  # a measurement counts only if the variant computes the same gradients
            _require_equal(last_grads["engine capture"], last_grads["installed"], f"engine capture, {label}")
        results[label] = {name: statistics.median(values) for name, values in extra.items()}
    return results


def _require_equal(grads: list[torch.Tensor], reference: list[torch.Tensor], what: str) -> None:
    if not reference or len(grads) != len(reference) or not all(map(torch.allclose, grads, reference)):
        raise RuntimeError(f"{what}: the gradients differ from the installed split's")


def _keyed_store_step(module: nn.Module, store: WeightGradStore) -> Step:
    """The step as the executor runs it: the forward keyed (``begin_forward``), so the norms'
    aliases take autograd's own accumulation instead of a post-hook."""

    def step(x: torch.Tensor, grad: torch.Tensor) -> float:
        with store.keyed_forward((0, 0)):
            out = module(x)
        started = time.thread_time()
        store.begin((0, 0), True)
        out.backward(grad)
        store.end()
        store.flush((0, 0))
        return time.thread_time() - started

    return step


def alias_accumulation(rows: int, fresh: bool, repeats: int = 81) -> dict[str, dict[str, float]]:
    """(T_B + T_W) / fused backward of the bench stages with norms: the forward keyed, as the
    executor runs it (no hook on the norms' nodes), against a direct call (a post-hook per norm)."""
    from zerobubble_bench.wgrad import split_stages

    results = {}
    for label, make, shape in split_stages(["gpt", "mha", "conv"]):
        fused = make()
        keyed, keyed_store = _installed(make(), WeightGradStore())
        hooked, hooked_store = _installed(make(), WeightGradStore())
        steps = {
            "keyed": (keyed, _keyed_store_step(keyed, keyed_store)),
            "post-hook": (hooked, _store_step(hooked, hooked_store, True)),
        }
        x = torch.randn(*shape(rows), requires_grad=True)
        results[label] = _step_ratios(fused, steps, x, repeats, fresh)
    return results


def _print_aliases() -> None:
    columns = {"keyed": "keyed forward (no hook)", "post-hook": "direct call (post-hook)"}
    _print_regimes("stage, rows, .grad", columns, alias_accumulation)


def _print_hooks() -> None:
    names = ("installed", "no-op hooks", "no hooks", "engine capture")
    print("\n| stage, 32 rows | B above frozen-parameter backward (µs): " + " | ".join(names) + " |")
    print("|---|---|---|---|---|")
    for label, extra in b_above_frozen(32).items():
        cells = " | ".join(f"{extra[name]:.0f}" if name in extra else "—" for name in names)
        print(f"| {label} | {cells} |")


def _print_floor() -> None:
    columns = {
        "generic split": "generic split (installed)",
        "stage frontier": "one B run per stage, W from its frontier",
    }
    _print_regimes("stage, rows, .grad", columns, stage_frontier_floor)


def _print_layers() -> None:
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


def _print_masks() -> None:
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


def _print_conv() -> None:
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


def _print_order() -> None:
    print("\n| stage, rows | W first to last (the store's order) | W last to first (B's order) |")
    print("|---|---|---|")
    for rows in (32, 128):
        for label, order in w_order(rows).items():
            print(f"| {label}, {rows} | {order['first to last']:.3f} | {order['last to first']:.3f} |")


def _print_native() -> None:
    columns = {
        "native nodes": "B through autograd's own nodes",
        "autograd function": "B through the autograd function",
    }
    _print_regimes("stage, rows, .grad", columns, native_against_function)


SECTIONS = {
    "layers": _print_layers,
    "masks": _print_masks,
    "conv": _print_conv,
    "order": _print_order,
    "native": _print_native,
    "routing": print_routing,
    "generic": _print_generic,
    "floor": _print_floor,
    "direct": _print_direct,
    "hooks": _print_hooks,
    "aliases": _print_aliases,
}


def main(sections: list[str]) -> None:
    from zerobubble_bench.wgrad import retain_freed_memory

    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"unknown sections {unknown}; choose from {sorted(SECTIONS)}")
    torch.set_num_threads(1)
    retain_freed_memory()  # as the bench command does: this process runs nothing else
    for name, print_section in SECTIONS.items():
        if not sections or name in sections:
            print_section()


if __name__ == "__main__":
    main(sys.argv[1:])
