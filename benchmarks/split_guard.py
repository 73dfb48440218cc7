"""What the split guard costs: its one-time check against one microbatch's split forward, B and W.

For each model of ``zerobubble_demo.split_models`` (the first stage holds every layer), a fresh
split and guard are built ``--repeats`` times; each repeat times the guard's first
``before_forward`` (the plain forward and backward, the split's forward, B and W, and a second
round where a module changed path) and then one ordinary microbatch's forward, B and W through the
same split.  Prints the medians and their ratio, with the spread of the ratio over the repeats.

    python benchmarks/split_guard.py --repeats 15 --batch 32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from zerobubble.runtime.construct.staging import StageModule
from zerobubble.runtime.wgrad import SplitGuard, WeightGradStore, install_deferral
from zerobubble_demo.split_models import SPLIT_MODELS, split_model


def _through(layers, inputs):
    values = inputs
    for layer in layers:
        values = layer(*values) if isinstance(values, tuple) else layer(values)
    return values


def measure(name: str, batch: int, repeats: int) -> tuple[float, float, list[float], int]:
    """Median seconds of the check and of one microbatch's F+B+W; the per-repeat ratios; checks run."""
    checks, steps, ratios, rounds = [], [], [], 0
    for repeat in range(repeats):
        model = split_model(name, batch=batch, seed=repeat)
        store = WeightGradStore()
        deferral = install_deferral(model.layers, store)
        module = StageModule(model.layers)
        guard = SplitGuard(
            stage=0, module=module, store=store, deferral=deferral, names={}, strict=True,
            deferred=True, fused=False,
        )  # fmt: skip
        inputs = model.inputs
        start = time.perf_counter()
        guard.before_forward((inputs,))
        check = time.perf_counter() - start
        rounds = guard._checks
        start = time.perf_counter()
        with store.keyed_forward((0, 0)):
            loss = model.loss_fn(_through(model.layers, inputs), model.targets)
        store.begin((0, 0), True)
        loss.backward()
        store.end()
        store.flush((0, 0))
        step = time.perf_counter() - start
        checks.append(check)
        steps.append(step)
        ratios.append(check / step)
    return statistics.median(checks), statistics.median(steps), ratios, rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--models", nargs="+", default=list(SPLIT_MODELS), choices=SPLIT_MODELS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"batch {args.batch}, {args.repeats} repeats, one thread; medians")
    print(f"{'model':<14}{'checks':>7}{'check ms':>10}{'F+B+W ms':>10}{'ratio':>8}{'ratio range':>16}")
    for name in args.models:
        check, step, ratios, rounds = measure(name, args.batch, args.repeats)
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
        ratio = statistics.median(ratios)
        print(f"{name:<14}{rounds:>7}{check * 1e3:>10.2f}{step * 1e3:>10.2f}{ratio:>8.2f}{spread:>16}")
    print(f"a forward on a checked path: {checked_forward_us():.2f} µs (median of 5 × 20,000 calls)")


def checked_forward_us() -> float:
    """What the guard costs every later forward: ``before_forward`` on a path already checked."""
    model = split_model("gpt2", batch=8)
    store = WeightGradStore()
    deferral = install_deferral(model.layers, store)
    guard = SplitGuard(
        stage=0, module=StageModule(model.layers), store=store, deferral=deferral, names={},
        strict=True, deferred=True, fused=False,
    )  # fmt: skip
    inputs = (model.inputs,)
    guard.before_forward(inputs)
    calls = 20_000
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            guard.before_forward(inputs)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times) * 1e6


if __name__ == "__main__":
    main()
