"""What the per-call argument check costs: its exchange alone, and steps with and without it; 2 gloo ranks.

    python benchmarks/call_check.py [--calls 600] [--steps 300] [--width 64]

Before every ``step``/``evaluate`` the ranks compare their calls (``runtime/parallel/consistency.py``,
:class:`CallCheck`: a max-reduce of ten int64 by point-to-point transfers on a gloo group of its
own).  Printed: the median µs of one exchange next to one bare gloo ``all_reduce`` of the same ten
int64 (``--calls`` of each, alternating call by call, every call timed on its own), and the median ms
of one step of a small model (4 Linear–GELU–Linear blocks of ``--width``, 1f1b, 4 microbatches of 2
rows) on two Pipelines of the same layers built with ``check_calls=True`` (the default) and
``check_calls=False``, alternating step by step (``--steps`` of each).  Alternating call by call
keeps a loaded machine's drifts out of the comparison; the quartiles show the noise.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time


def measure(calls: int, steps: int, width: int) -> dict[str, list[float]] | None:
    """One rank's side; rank 0 returns every timed call (µs) and step (ms), by kind."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    from zerobubble import Pipeline
    from zerobubble.runtime.launch import init_distributed
    from zerobubble.runtime.parallel.consistency import CallSignature, batch_signature

    init_distributed()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [
        nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)) for _ in range(4)
    ]
    pipes = {
        check: Pipeline(
            copy.deepcopy(layers),
            schedule="1f1b",
            microbatches=4,
            loss_fn=F.mse_loss,
            timeout=60,
            check_calls=check,
        )
        for check in (True, False)
    }
    inputs, targets = torch.randn(8, width), torch.randn(8, width)
    signature = CallSignature("step", 1.0, batch_signature(inputs), batch_signature(targets))
    check = pipes[True]._calls
    values = torch.zeros(10, dtype=torch.int64)
    kinds = {
        "bare all_reduce (µs)": lambda: dist.all_reduce(values, op=dist.ReduceOp.MAX, group=check.group),
        "exchange (µs)": lambda: check.exchange(signature),
    }
    times: dict[str, list[float]] = {name: [] for name in kinds}
    dist.barrier()
    for index in range(calls):
        for name in sorted(kinds, reverse=index % 2 == 1):  # ABBA: neither always goes first
            start = time.perf_counter()
            kinds[name]()
            times[name].append((time.perf_counter() - start) * 1e6)
    for pipe in pipes.values():  # warm up: shapes cached, receives posted ahead from now on
        for _ in range(3):
            pipe.step(inputs, targets)
    for check_calls in (True, False):
        times[f"step, check_calls={check_calls} (ms)"] = []
    dist.barrier()
    for index in range(steps):
        for check_calls in sorted(pipes, reverse=index % 2 == 1):
            pipe = pipes[check_calls]
            start = time.perf_counter()
            pipe.step(inputs, targets)
            times[f"step, check_calls={check_calls} (ms)"].append((time.perf_counter() - start) * 1e3)
            pipe.zero_grad()
    dist.barrier()
    return times if dist.get_rank() == 0 else None


def main() -> None:
    from zerobubble.runtime.launch import launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=600)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()
    times = launch(measure, 2, (args.calls, args.steps, args.width), threads=1, timeout=600)[0]
    medians = {}
    for name, values in times.items():
        q1, medians[name], q3 = statistics.quantiles(values, n=4)
        print(f"{name:30s} median {medians[name]:9.3f}  (quartiles {q1:.3f}–{q3:.3f}, {len(values)} timed)")
    on, off = medians["step, check_calls=True (ms)"], medians["step, check_calls=False (ms)"]
    print(f"step with / without the check: {on / off:.3f} ({(on - off) * 1e3:+.0f} µs per step)")


if __name__ == "__main__":
    main()
