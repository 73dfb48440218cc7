"""FSDP2 for the data-parallel dimension against replication: memory per rank and step time; 4 gloo ranks.

    python benchmarks/fsdp.py [--steps 40] [--width 256] [--blocks 8] [--schedule zb-h1]

Two Pipelines of the same layers (``--blocks`` Linear–GELU–Linear blocks of ``--width``, float32)
on pipeline 2 × data-parallel 2: ``sharding=None`` (replicated, gradients all-reduced) and
``sharding="fsdp"`` (each chunk an FSDP2 unit).  Printed per rank: the bytes this rank holds
between steps (after ``optimizer_step`` and ``synchronize``, before ``zero_grad``) of parameters,
gradients and AdamW state, counting each tensor's local storage (a DTensor's shard); then the
median ms of one step + clipped AdamW ``optimizer_step`` (max_norm 1.0) of each Pipeline,
alternating step by step (ABBA) after 3 warm-up steps each, with the quartiles and the min/max
over rank 0's timings.  Run twice: with post-validation (the default) and with
``post_validation=False``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time


def _bytes(tensors) -> int:
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def measure(steps: int, width: int, blocks: int, schedule: str, post_validation: bool) -> dict:
    """One rank's side: its bytes by kind and sharding; rank 0 also its step times (ms)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    from zerobubble import Pipeline
    from zerobubble.runtime.launch import init_distributed

    init_distributed()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [
        nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        for _ in range(blocks)
    ]
    names = {None: "replicated", "fsdp": "fsdp"}
    pipes = {
        sharding: Pipeline(
            copy.deepcopy(layers),
            schedule=schedule,
            microbatches=4,
            loss_fn=F.mse_loss,
            timeout=120,
            data_parallel=2,
            sharding=sharding,
            post_validation=post_validation,
        )
        for sharding in names
    }
    optimizers = {s: torch.optim.AdamW(list(pipe.parameters()), lr=1e-3) for s, pipe in pipes.items()}
    generator = torch.Generator().manual_seed(1 + dist.get_rank() // 2)
    inputs, targets = torch.randn(16, width, generator=generator), torch.randn(16, width, generator=generator)

    def step(sharding) -> None:
        pipe = pipes[sharding]
        pipe.step(inputs, targets)
        pipe.optimizer_step(optimizers[sharding], max_norm=1.0)

    result: dict = {}
    for sharding, pipe in pipes.items():
        for _ in range(3):
            pipe.zero_grad(set_to_none=True)
            step(sharding)
        pipe.synchronize()
        params = list(pipe.parameters())
        state = [v for s in optimizers[sharding].state.values() for v in s.values() if v.dim() > 0]
        result[names[sharding]] = {
            "parameters": _bytes(params),
            "gradients": _bytes(p.grad for p in params if p.grad is not None),
            "optimizer state": _bytes(state),
        }
        pipe.zero_grad(set_to_none=True)
    times: dict[str, list[float]] = {names[s]: [] for s in pipes}
    dist.barrier()
    for index in range(steps):
        for sharding in sorted(pipes, key=str, reverse=index % 2 == 1):
            start = time.perf_counter()
            step(sharding)
            times[names[sharding]].append((time.perf_counter() - start) * 1e3)
            pipes[sharding].zero_grad(set_to_none=True)
    for pipe in pipes.values():
        pipe.synchronize()
    dist.barrier()
    result["times"] = times
    return result


def main() -> None:
    from zerobubble.runtime.launch import launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--schedule", default="zb-h1")
    args = parser.parse_args()
    print(
        f"pipeline 2 × data-parallel 2, {args.schedule}, {args.blocks} blocks of width {args.width} "
        "(float32), 4 microbatches of 4 rows per replica, AdamW, max_norm 1.0"
    )
    for post_validation in (True, False):
        per_rank = launch(
            measure,
            4,
            (args.steps, args.width, args.blocks, args.schedule, post_validation),
            threads=1,
            timeout=900,
        )
        if post_validation:
            print("bytes held per rank between steps (local storage; MiB):")
            for rank, result in enumerate(per_rank):
                cells = []
                for kind in ("parameters", "gradients", "optimizer state"):
                    rep, sharded = result["replicated"][kind], result["fsdp"][kind]
                    cells.append(f"{kind} {rep / 2**20:.3f} → {sharded / 2**20:.3f}")
                total_rep = sum(result["replicated"].values())
                total_fsdp = sum(result["fsdp"].values())
                print(
                    f"  rank {rank}: " + ", ".join(cells) + f"; total {total_rep / 2**20:.3f} → "
                    f"{total_fsdp / 2**20:.3f} ({total_fsdp / total_rep:.2f}×)"
                )
        print(f"step + optimizer_step, post_validation={post_validation} (rank 0, ms):")
        medians = {}
        for name, values in per_rank[0]["times"].items():
            q1, medians[name], q3 = statistics.quantiles(values, n=4)
            print(
                f"  {name:10s} median {medians[name]:8.2f}  quartiles {q1:.2f}–{q3:.2f}  "
                f"min {min(values):.2f} max {max(values):.2f}  ({len(values)} timed)"
            )
        print(f"  fsdp / replicated: {medians['fsdp'] / medians['replicated']:.2f}")


if __name__ == "__main__":
    main()
