"""Optimizer state and step time of AdamW against ZeroRedundancyOptimizer(AdamW) over the Pipeline.

    python benchmarks/zero_optimizer.py [--width 256] [--linears 8] [--steps 20] [--schedule zb-v]

4 local gloo ranks: pipeline 2 × data_parallel 2, ``--linears`` Linear(width, width)–Tanh layers in
float32, ``--microbatches`` microbatches of ``--rows`` rows per replica, one thread per rank.  Two
Pipelines over copies of the model train side by side, one with ``torch.optim.AdamW``, one with
``ZeroRedundancyOptimizer(optimizer_class=AdamW, process_group=pipe.layout.dp_group)``, their
iterations alternating (so a change in the machine's load hits both alike); both use
``optimizer_step(max_norm=...)`` with post-validation (the default) unless ``--synchronous``;
``--max-norm 0`` puts max_norm halfway between the validation chain head's own gradient norm and
the total every iteration, so that the head rolls its optimistic step back and redoes it clipped
(the norms' all-gather is not timed).
Prints, per rank, the bytes of optimizer state (ZeRO: its local optimizer's), the median iteration
(``step`` + ``optimizer_step`` + ``zero_grad``; a post-validated step settles in the next
``step``) and the median ``optimizer_step`` alone, after ``--warmup`` untimed iterations.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _state_bytes(state) -> int:
    import torch

    return sum(v.numel() * v.element_size() for s in state.values() for v in s.values() if torch.is_tensor(v))


def midway(pipe) -> float:
    """A max_norm halfway between the chain head's own gradient norm and the total (collective):
    the head steps optimistically, then rolls back and steps again clipped."""
    import math

    import torch
    import torch.distributed as dist

    from zerobubble.runtime.optim import validation_chain

    local = torch.stack([p.grad.double().norm() ** 2 for p in pipe.parameters()]).sum().reshape(1)
    gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    squares = [float(gathered[pipe.layout.grid.global_rank(r)]) for r in range(pipe.layout.grid.pp)]
    head = validation_chain([ends[-1] if ends else 0.0 for ends in pipe.timeline.end])[0]
    return 0.5 * (math.sqrt(squares[head]) + math.sqrt(sum(squares)))


def measure(args: argparse.Namespace) -> dict:
    """One rank's side: state bytes, median iteration and optimizer-step seconds of both optimizers."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from zerobubble import Pipeline
    from zerobubble.runtime.launch import init_distributed

    init_distributed(backend="gloo", timeout=120)

    def layers() -> list[nn.Module]:
        torch.manual_seed(0)
        out: list[nn.Module] = []
        for index in range(args.linears):
            out.append(nn.Linear(args.width, args.width))
            if index + 1 < args.linears:
                out.append(nn.Tanh())
        return out

    options = {
        "schedule": args.schedule,
        "microbatches": args.microbatches,
        "loss_fn": F.mse_loss,
        "data_parallel": 2,
        "post_validation": not args.synchronous,
        "timeout": 120,
    }
    pipes = {"AdamW": Pipeline(layers(), **options), "ZeRO(AdamW)": Pipeline(layers(), **options)}
    dp_group = pipes["ZeRO(AdamW)"].layout.dp_group
    optimizers = {
        "AdamW": torch.optim.AdamW(pipes["AdamW"].parameters(), lr=1e-3),
        "ZeRO(AdamW)": ZeroRedundancyOptimizer(
            pipes["ZeRO(AdamW)"].parameters(),
            optimizer_class=torch.optim.AdamW,
            process_group=dp_group,
            lr=1e-3,
        ),
    }
    generator = torch.Generator().manual_seed(1)
    rows = args.rows * args.microbatches
    inputs = torch.randn(rows, args.width, generator=generator)
    targets = torch.randn(rows, args.width, generator=generator)
    iterations: dict[str, list[float]] = {name: [] for name in pipes}
    steps: dict[str, list[float]] = {name: [] for name in pipes}
    for iteration in range(args.warmup + args.steps):
        for name, pipe in pipes.items():
            dist.barrier()
            start = time.perf_counter()
            pipe.step(inputs, targets)
            stepped = time.perf_counter()
            max_norm = args.max_norm if args.max_norm > 0 else midway(pipe)  # midway: untimed
            middle = time.perf_counter()
            pipe.optimizer_step(optimizers[name], max_norm=max_norm)
            end = time.perf_counter()
            pipe.zero_grad(set_to_none=True)
            finish = time.perf_counter()
            if iteration >= args.warmup:
                iterations[name].append(stepped - start + finish - middle)
                steps[name].append(end - middle)
    for pipe in pipes.values():
        pipe.synchronize()
    states = {
        "AdamW": optimizers["AdamW"].state,
        "ZeRO(AdamW)": optimizers["ZeRO(AdamW)"].optim.state,  # type: ignore[union-attr]
    }
    return {
        name: {
            "params": sum(p.numel() for p in pipe.parameters()),
            "state": _state_bytes(states[name]),
            "iteration": statistics.median(iterations[name]),
            "step": statistics.median(steps[name]),
            "rolled_back": pipe.optimizer_stats.rolled_back,
        }
        for name, pipe in pipes.items()
    }


def main() -> None:
    from zerobubble.runtime.launch import launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--linears", type=int, default=8)
    parser.add_argument("--schedule", default="zb-v")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8, help="rows per microbatch")
    parser.add_argument("--steps", type=int, default=20, help="timed iterations")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--max-norm", type=float, default=1.0, help="0: halfway between the chain head's norm and the total"
    )
    parser.add_argument("--synchronous", action="store_true", help="post_validation=False")
    args = parser.parse_args()
    results = launch(measure, 4, (args,), threads=1, timeout=900)
    mode = "synchronous" if args.synchronous else "post-validated"
    bound = args.max_norm if args.max_norm > 0 else "midway (a rollback every step on the chain head)"
    print(
        f"pipeline 2 × data_parallel 2, {args.schedule}, {args.linears} × Linear({args.width}, {args.width}) "
        f"float32, {args.microbatches} × {args.rows} rows per replica, {mode}, max_norm {bound}; "
        f"medians of {args.steps} iterations"
    )
    print(
        f"{'rank':>4} {'params':>8} {'AdamW state':>12} {'ZeRO state':>11} {'ratio':>6} "
        f"{'AdamW iter ms':>14} {'ZeRO iter ms':>13} {'AdamW opt ms':>13} {'ZeRO opt ms':>12} "
        f"{'rollbacks A/Z':>14}"
    )
    for rank, result in enumerate(results):
        plain, zero = result["AdamW"], result["ZeRO(AdamW)"]
        print(
            f"{rank:>4} {plain['params']:>8} {plain['state']:>12} {zero['state']:>11} "
            f"{zero['state'] / plain['state']:>6.3f} {plain['iteration'] * 1e3:>14.2f} "
            f"{zero['iteration'] * 1e3:>13.2f} {plain['step'] * 1e3:>13.2f} {zero['step'] * 1e3:>12.2f} "
            f"{plain['rolled_back']:>10}/{zero['rolled_back']:<3}"
        )


if __name__ == "__main__":
    main()
