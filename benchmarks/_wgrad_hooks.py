"""Sections ``hooks`` and ``aliases`` of ``benchmarks/wgrad_overhead.py``.

* ``hooks``: where B's cost above a backward with frozen parameters goes, for the GPT block, the
  conv stage and the attention block (default split, called directly: a post-hook per norm): B as
  installed, with every capture hook a no-op (the hook calls, not their work), with no hooks
  registered at all (the same native nodes; W is not run for these two), and for the first two
  stages with the captures made inside the autograd engine (one grad-mode run; a measurement, not
  the runtime's B);
* ``aliases``: the norms' alias parameters accumulated by autograd itself in a keyed forward (as
  the executor runs it: no hook on their nodes) against a post-hook per norm (a direct call), side
  by side.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any
from unittest import mock

import torch
from torch import nn

from _wgrad_timing import Step, install_split, print_regimes, step_ratios, store_step
from zerobubble.runtime.wgrad import WeightGradStore, fast, generic, routed
from zerobubble.runtime.wgrad.store import WeightCapture


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
        split = {name: install_split(make(), WeightGradStore()) for name in names}
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
    """Refuse a measurement whose variant computes other gradients than the installed split."""
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
        keyed, keyed_store = install_split(make(), WeightGradStore())
        hooked, hooked_store = install_split(make(), WeightGradStore())
        steps = {
            "keyed": (keyed, _keyed_store_step(keyed, keyed_store)),
            "post-hook": (hooked, store_step(hooked, hooked_store, True)),
        }
        x = torch.randn(*shape(rows), requires_grad=True)
        results[label] = step_ratios(fused, steps, x, repeats, fresh)
    return results


def print_hooks() -> None:
    """Section ``hooks``: B above a frozen-parameter backward, per stage, at 32 rows."""
    names = ("installed", "no-op hooks", "no hooks", "engine capture")
    print("\n| stage, 32 rows | B above frozen-parameter backward (µs): " + " | ".join(names) + " |")
    print("|---|---|---|---|---|")
    for label, extra in b_above_frozen(32).items():
        cells = " | ".join(f"{extra[name]:.0f}" if name in extra else "—" for name in names)
        print(f"| {label} | {cells} |")


def print_aliases() -> None:
    """Section ``aliases``: a keyed forward against a post-hook per norm."""
    columns = {"keyed": "keyed forward (no hook)", "post-hook": "direct call (post-hook)"}
    print_regimes("stage, rows, .grad", columns, alias_accumulation)
