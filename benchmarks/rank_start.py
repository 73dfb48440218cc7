"""How long a group of local ranks takes to start, spawned or forked from a forkserver; the first Pipeline.

    python benchmarks/rank_start.py [--ranks 2 4 8] [--repeats 5]

:func:`zerobubble.runtime.launch.launch` starts ranks with ``start_method="spawn"`` (a fresh
interpreter per rank, importing torch) or ``"forkserver"`` (forked from one server that imported
torch and the runtime once; the test suite's choice, ``tests/conftest.py``).  Printed per start
method and rank count: the median, lowest and highest wall time of ``--repeats`` launches of ranks
that join a gloo group and all-reduce one tensor (the forkserver's own start-up, paid once per
process, is its first launch, left out of the median and printed apart); then the wall time of the
first and of a second ``Pipeline`` built in one rank group, and of its first step.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _join_and_reduce() -> float:
    import torch
    import torch.distributed as dist

    from zerobubble.runtime.launch import init_distributed

    init_distributed(backend="gloo", timeout=60)
    value = torch.ones(1)
    dist.all_reduce(value)
    return float(value)


def _first_pipelines() -> list[float]:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from zerobubble import Pipeline
    from zerobubble.runtime.launch import init_distributed

    init_distributed(backend="gloo", timeout=60)
    layers = [nn.Linear(8, 8) for _ in range(4)]
    inputs, targets = torch.randn(8, 8), torch.randn(8, 8)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        pipe = Pipeline(layers, schedule="zb-h1", microbatches=4, loss_fn=F.mse_loss)
        built = time.perf_counter()
        pipe.step(inputs, targets)
        times += [built - start, time.perf_counter() - built]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from zerobubble.runtime.launch import launch

    print("| start method | ranks | median launch (s) | lowest – highest (s) |")
    print("|---|---|---|---|")
    for method in ("spawn", "forkserver"):
        if method == "forkserver":
            start = time.perf_counter()
            launch(_join_and_reduce, 2, start_method=method)
            seconds = time.perf_counter() - start
            print(f"| forkserver, its first launch (server start) | 2 | {seconds:.2f} | |")
        for ranks in args.ranks:
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                launch(_join_and_reduce, ranks, start_method=method)
                times.append(time.perf_counter() - start)
            spread = f"{min(times):.2f} – {max(times):.2f}"
            print(f"| {method} | {ranks} | {statistics.median(times):.2f} | {spread} |")
    print()
    print("| start method | first Pipeline built, its first step, second built, its step (s, rank 0) |")
    print("|---|---|")
    for method in ("spawn", "forkserver"):
        times = launch(_first_pipelines, 2, start_method=method)[0]
        print(f"| {method} | {', '.join(f'{t:.3f}' for t in times)} |")


if __name__ == "__main__":
    main()
