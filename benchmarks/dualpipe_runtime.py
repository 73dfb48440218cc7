"""Our ``dualpipe-v`` against torch's ``ScheduleDualPipeV`` on the same tiny model, on gloo CPU ranks.

    python benchmarks/dualpipe_runtime.py [--ranks 2 4] [--microbatches 8] [--width 64] [--rows 16]
                                          [--rounds 5] [--steps 4]

Per rank count, in one run of ``ranks`` processes (one thread each): a stack of ``4·ranks``
Linear + Tanh layers cut evenly into ``2·ranks`` chunks, placed in a V (rank ``r`` holds chunks ``r``
and ``2·ranks − 1 − r``) by both; the same batch, microbatches and mean-squared-error loss.  The two
run in rotating rounds (a barrier before and after each step; backward and ``zero_grad`` included,
no optimizer).  Prints per configuration the median step, the spread (fastest–slowest), the ratio
of the medians, and the largest gradient difference of one step against the whole model's backward
in one process (absolute, and relative to the largest gradient), in float32, over every parameter
of the model (each compared on the rank that holds it).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zerobubble import Pipeline
from zerobubble.runtime.launch import init_distributed, launch

OURS, THEIRS = "ours dualpipe-v", "torch ScheduleDualPipeV"


def _layers(count: int, width: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(count)]


def _batch(rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(rows, width, generator=generator), torch.randn(rows, width, generator=generator)


def _reference(layers: list[nn.Module], inputs, targets, m: int) -> dict[int, torch.Tensor]:
    """The gradients of the mean microbatch loss in one process, by (layer, parameter) position."""
    model = nn.Sequential(*copy.deepcopy(layers))
    for x, y in zip(inputs.chunk(m), targets.chunk(m)):
        (F.mse_loss(model(x), y) / m).backward()
    return {i: p.grad.clone() for i, p in enumerate(model.parameters())}


def _difference(layers: list[nn.Module], expected: dict[int, torch.Tensor]) -> tuple[float, float, int]:
    """Largest |gradient − one process| over this rank's parameters, the largest |gradient|, and how
    many parameters this rank compared (those with a gradient: the ones it holds)."""
    worst, scale, count = 0.0, 0.0, 0
    for i, p in enumerate(param for layer in layers for param in layer.parameters()):
        if p.grad is not None:
            worst = max(worst, float((p.grad - expected[i]).abs().max()))
            scale = max(scale, float(expected[i].abs().max()))
            count += 1
    return worst, scale, count


def _ours(layers: list[nn.Module], m: int, inputs, targets):
    pipe = Pipeline(layers, schedule="dualpipe-v", microbatches=m, loss_fn=F.mse_loss, timeout=300)

    def step() -> None:
        pipe.step(inputs, targets)

    return step, pipe.zero_grad


def _theirs(layers: list[nn.Module], m: int, inputs, targets):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    rank, world = dist.get_rank(), dist.get_world_size()
    chunks, per = 2 * world, len(layers) // (2 * world)
    stages = [
        PipelineStage(nn.Sequential(*layers[i * per : (i + 1) * per]), i, chunks, torch.device("cpu"))
        for i in (rank, chunks - 1 - rank)
    ]
    schedule = ScheduleDualPipeV(stages, n_microbatches=m, loss_fn=F.mse_loss)
    ends = rank == 0  # the V's first and last chunk live on rank 0

    def step() -> None:
        if ends:
            schedule.step(inputs, target=targets)
        else:
            schedule.step()

    def zero() -> None:
        for stage in stages:
            stage.submod.zero_grad(set_to_none=True)

    return step, zero


def _rank(m: int, width: int, rows: int, rounds: int, steps: int) -> dict:
    init_distributed(backend="gloo", timeout=300)
    world = dist.get_world_size()
    inputs, targets = _batch(m * rows, width)
    runners, differences = {}, {}
    for name, build in ((OURS, _ours), (THEIRS, _theirs)):
        layers = _layers(4 * world, width)
        expected = _reference(layers, inputs, targets, m)
        step, zero = build(layers, m, inputs, targets)
        step()  # first step: the gradients, then warm-up
        differences[name] = _difference(layers, expected)
        zero()
        runners[name] = (step, zero)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, (step, zero) in runners.items():
            for _ in range(steps):
                dist.barrier()
                started = time.perf_counter()
                step()
                zero()
                dist.barrier()
                times[name].append(time.perf_counter() - started)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, differences)
    worst = {
        name: (
            max(d[name][0] for d in gathered),
            max(d[name][1] for d in gathered),
            sum(d[name][2] for d in gathered),
        )
        for name in runners
    }
    return {"times": times, "differences": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--rows", type=int, default=16, help="rows per microbatch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="steps per configuration per round")
    args = parser.parse_args()
    for ranks in args.ranks:
        m = max(args.microbatches, 2 * ranks)  # both need 2·ranks microbatches to fill the V
        result = launch(_rank, ranks, (m, args.width, args.rows, args.rounds, args.steps), threads=1)[0]
        times, differences = result["times"], result["differences"]
        print(
            f"\n{ranks} gloo CPU ranks, {4 * ranks} × (Linear {args.width} + Tanh) in {2 * ranks} chunks, "
            f"{m} microbatches of {args.rows} rows, {args.rounds} rounds × {args.steps} steps\n"
        )
        print(
            "| configuration | median step (ms) | spread (ms) | × torch | max abs grad diff | relative |",
            end="",
        )
        print(" params |")
        print("|---|---|---|---|---|---|---|")
        reference = statistics.median(times[THEIRS])
        for name, values in times.items():
            value, (worst, scale, count) = statistics.median(values), differences[name]
            print(
                f"| {name} | {value * 1e3:.2f} | {min(values) * 1e3:.2f}–{max(values) * 1e3:.2f} | "
                f"{value / reference:.3f} | {worst:.2e} | {worst / scale:.2e} | {count} of {8 * ranks} |"
            )


if __name__ == "__main__":
    main()
