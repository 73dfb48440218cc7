"""Step time of replicated data parallelism per all-reduce bucket size (``FSDPOptions.bucket_bytes``).

Four gloo ranks: two replicas of a two-rank pipeline (``data_parallel=2``, zb-h1, so a chunk's
gradients are final at its last W), a stack of Linear–GELU–Linear blocks in float32.  One Pipeline
per bucket size, built once; the steps then go round the Pipelines in turn (each step
``step`` + clipped ``optimizer_step``, every rank starting it together after a barrier), so drift
of the shared machine falls on every size alike.  Printed per size: the buckets of each chunk, the
median step time over the rounds (the slowest rank's) and its ratio to one bucket a chunk.  On a
shared 2-core CPU the numbers are noisy (the quartiles are printed too): a comparison, not a
measurement of a cluster.

    python benchmarks/dp_buckets.py [--blocks 8] [--width 384] [--steps 12]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from zerobubble import FSDPOptions, Pipeline
from zerobubble.runtime.launch import init_distributed, launch
from zerobubble_bench.workloads import gelu_block_bytes, gelu_blocks

MIB = 2**20


def sizes(width: int) -> dict[str, float]:
    """The bucket sizes compared: one a chunk (0), about one and two blocks, and DDP's 25 MB."""
    block = gelu_block_bytes(width)
    return {"one a chunk (0)": 0.0, "1 block": float(block), "2 blocks": 2.0 * block, "25 MB": 25e6}


def measure(count: int, width: int, steps: int) -> dict:
    """This rank's step times (seconds, one per round) and buckets per chunk, per bucket size."""
    init_distributed(backend="gloo", timeout=300)
    torch.set_num_threads(1)
    pipes, optimizers = {}, {}
    for name, size in sizes(width).items():
        pipes[name] = Pipeline(
            gelu_blocks(count, width), schedule="zb-h1", microbatches=4, loss_fn=nn.functional.mse_loss,
            data_parallel=2, fsdp=FSDPOptions(bucket_bytes=size) if size else None, timeout=300,
        )  # fmt: skip
        optimizers[name] = torch.optim.AdamW(list(pipes[name].parameters()), lr=1e-4)
    x = torch.randn(16, width, generator=torch.Generator().manual_seed(dist.get_rank()))
    times: dict[str, list[float]] = {name: [] for name in pipes}
    for _ in range(steps + 1):  # the first round warms up
        for name, pipe in pipes.items():
            dist.barrier()
            start = time.perf_counter()
            pipe.step(x, x)
            pipe.optimizer_step(optimizers[name], max_norm=1.0)
            pipe.zero_grad(set_to_none=True)
            times[name].append(time.perf_counter() - start)
    for pipe in pipes.values():
        pipe.synchronize()
    return {
        name: {"times": times[name][1:], "buckets": [len(parts) for parts in pipe.lowered.part_layers]}
        for name, pipe in pipes.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    per_rank = launch(measure, 4, (args.blocks, args.width, args.steps), threads=1, timeout=1800)
    block = gelu_block_bytes(args.width)
    print(
        f"pp 2 × dp 2 replicated, zb-h1, {args.blocks} blocks of width {args.width}, float32: one block "
        f"{block / MIB:.2f} MiB, one chunk {args.blocks // 2 * block / MIB:.2f} MiB; {args.steps} rounds"
    )
    print(f"{'bucket size':16} {'buckets/chunk':>14} {'median ms':>10} {'q1–q3 ms':>15} {'ratio':>6}")
    base = None
    for name in sizes(args.width):
        slowest = [max(rank[name]["times"][i] for rank in per_rank) * 1e3 for i in range(args.steps)]
        q1, median, q3 = statistics.quantiles(slowest, n=4)
        base = base or median
        buckets = "/".join(str(b) for b in per_rank[0][name]["buckets"])
        print(f"{name:16} {buckets:>14} {median:10.1f} {q1:7.1f}–{q3:<7.1f} {median / base:6.2f}")


if __name__ == "__main__":
    main()
