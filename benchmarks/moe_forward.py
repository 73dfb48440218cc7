"""What the B/W split costs in a mixture-of-experts block's forward, and where.

    python benchmarks/moe_forward.py [--width 64] [--repeats 35]

One decoder block of a tiny random transformers Mixtral (4 experts, top 2, ``grouped_mm`` experts,
16 sequences of 16 tokens, one thread) as :func:`zerobubble.hf.pipeline_layers` cuts it, four copies
timed in rotation, forward only (each is followed by its backward, untimed): plain autograd; the
fast paths alone (``install_deferral(generic=False)``: the attention's linears and the norms); the
generic split alone (no fast paths); everything split, as a schedule with W ops runs it.  Prints the
median forward of each in milliseconds after 5 warm-up rounds.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

from zerobubble.runtime.wgrad import FastPaths, WeightGradStore, install_deferral

sys.path.insert(0, str(Path(__file__).parent))
import dualpipe_runtime  # the same tiny Mixtral


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=35)
    args = parser.parse_args()
    torch.set_num_threads(1)
    layers = dualpipe_runtime._layers("mixtral", 8, args.width)
    tokens, _ = dualpipe_runtime._batch("mixtral", 16, args.width)
    with torch.no_grad():
        hidden = layers[0](tokens)
    variants: dict[str, tuple[torch.nn.Module, WeightGradStore | None]] = {
        "plain autograd": (layers[1], None)
    }
    for name, options in (
        ("fast paths alone", {"generic": False}),
        ("generic split alone", {"fast_paths": FastPaths()}),
        ("everything split", {}),
    ):
        module, store = copy.deepcopy(layers[1]), WeightGradStore()
        install_deferral([module], store, **options)
        variants[name] = (module, store)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(args.repeats + 5):
        for name, (module, store) in variants.items():
            elapsed = _step(module, store, hidden, round_)
            if round_ >= 5:
                times[name].append(elapsed)
    print(f"one Mixtral block, width {args.width}, 256 tokens, one thread: median forward (ms)")
    for name, values in times.items():
        print(f"{name:22s} {statistics.median(values) * 1e3:8.3f}")


def _step(module: torch.nn.Module, store: WeightGradStore | None, hidden: tuple, round_: int) -> float:
    """One forward (timed) and its backward (B then W when split)."""
    inputs = tuple(t.detach().requires_grad_() if t.is_floating_point() else t for t in hidden)
    key = (0, round_)
    started = time.perf_counter()
    if store is None:
        out = module(*inputs)
    else:
        with store.keyed_forward(key):
            out = module(*inputs)
    elapsed = time.perf_counter() - started
    first = out[0] if isinstance(out, tuple) else out
    if store is None:
        first.backward(torch.ones_like(first))
    else:
        store.begin(key, True)
        first.backward(torch.ones_like(first))
        store.end()
        store.flush(key)
    return elapsed


if __name__ == "__main__":
    main()
