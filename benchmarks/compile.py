"""Compiled pipeline vs eager pipeline vs torch.distributed.pipelining on the same compiled layers.

    python benchmarks/compile.py [--rounds 5] [--steps 2] [--width 128] [--rows 64] [--microbatches 8]

2 gloo ranks, one thread each, one process per rank; every configuration is built in the same run
and timed in rotating rounds (``zerobubble_bench.workloads.interleaved``: barrier to barrier, backward
and zero_grad included, no optimizer).  The model is 8 pointwise-heavy blocks (LayerNorm, a tanh-GELU
written out as its formula, a gated residual: many elementwise kernels in eager that inductor fuses)
around two Linear layers each.  Prints per configuration the median step, the spread of its timed
steps (min–max) and ratios to the eager pipeline of the same schedule.  ``docs/wgrad.md``,
"torch.compile", has the numbers of a run and what they mean.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zerobubble.runtime.launch import init_distributed, launch
from zerobubble_bench.workloads import interleaved, our_step


class PointwiseBlock(nn.Module):
    """Pre-norm MLP block whose activation and residual are chains of elementwise ops."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.gate = nn.Parameter(torch.full((width,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm(x))
        h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h * h * h)))
        h = self.down(h)
        return x + torch.sigmoid(self.gate) * h * torch.rsqrt(1.0 + h * h)


def make_layers(count: int, width: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [PointwiseBlock(width) for _ in range(count)]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def _torch_runner(layers: list[nn.Module], batch, m: int):
    """torch.distributed.pipelining's Schedule1F1B over the same two halves."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank, world = dist.get_rank(), dist.get_world_size()
    half = len(layers) // world
    module = nn.Sequential(*layers[rank * half : (rank + 1) * half])
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=loss_fn)
    inputs, targets = batch

    def step() -> None:
        if rank == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=targets, losses=[])
        module.zero_grad(set_to_none=True)

    return step


class _BackwardTimes:
    """A recorder summing the seconds of this rank's B and W ops (the W share of the split)."""

    def __init__(self) -> None:
        self.seconds = {"B": 0.0, "W": 0.0}

    def op(self, op, start, end) -> None:
        if op.kind.name in self.seconds:
            self.seconds[op.kind.name] += end - start

    def wait(self, key, start, end) -> None:
        pass


def _w_share(pipe, step, steps: int = 3) -> float:
    """W / (B + W) over ``steps`` recorded steps of a pipeline with W ops."""
    recorder = _BackwardTimes()
    pipe.recorder = recorder
    for _ in range(steps):
        step()
    pipe.recorder = None
    b, w = recorder.seconds["B"], recorder.seconds["W"]
    return w / (b + w) if b + w else float("nan")


def _rank(count: int, width: int, rows: int, m: int, rounds: int, steps: int) -> dict:
    init_distributed(backend="gloo", timeout=600)
    from torch._dynamo.utils import counters

    from zerobubble import Pipeline

    generator = torch.Generator().manual_seed(1)
    batch = tuple(torch.randn(m * rows, width, generator=generator) for _ in range(2))
    runners = {}
    build = {}
    pipes = {}
    for schedule in ("1f1b", "zb-h1"):
        for compiled in (False, True):
            started = time.perf_counter()
            pipe = Pipeline(
                make_layers(count, width),
                schedule=schedule,
                microbatches=m,
                loss_fn=loss_fn,
                timeout=600,
                compile=compiled,
            )
            name = f"ours {schedule} {'compiled' if compiled else 'eager'}"
            runners[name] = our_step(pipe, batch)
            pipes[name] = pipe
            runners[name]()  # the first step compiles (and checks the split)
            build[name] = time.perf_counter() - started
    for compiled in (False, True):
        layers = make_layers(count, width)
        if compiled:
            for layer in layers:
                layer.compile()
        name = f"torch Schedule1F1B {'compiled' if compiled else 'eager'}"
        started = time.perf_counter()
        runners[name] = _torch_runner(layers, batch, m)
        runners[name]()
        build[name] = time.perf_counter() - started
    breaks_before = sum(counters["graph_break"].values())
    graphs_before = counters["stats"]["unique_graphs"]
    times = interleaved(runners, rounds, steps, warmup=2, settle=1)
    shares = {name: _w_share(pipes[name], runners[name]) for name in pipes if "zb-h1" in name}
    return {
        "times": times,
        "w_share": shares,
        "build": build,
        "graph breaks (all)": breaks_before,
        "graphs compiled in timed steps": counters["stats"]["unique_graphs"] - graphs_before,
        "graph breaks in timed steps": sum(counters["graph_break"].values()) - breaks_before,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--rows", type=int, default=64, help="rows per microbatch")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per configuration and round")
    args = parser.parse_args()
    results = launch(
        _rank, 2, (args.layers, args.width, args.rows, args.microbatches, args.rounds, args.steps), threads=1
    )
    first = results[0]
    print(
        f"{args.layers} blocks of width {args.width}, {args.microbatches} microbatches of {args.rows} rows, "
        f"2 gloo ranks, 1 thread each, torch {torch.__version__}, {args.rounds} rounds x {args.steps} steps"
    )
    print(f"{'configuration':32} {'median ms':>10} {'min-max ms':>15} {'x eager':>8} {'first step s':>13}")
    times = first["times"]
    for name, values in times.items():
        median = sorted(values)[len(values) // 2]
        eager = times[name.replace("compiled", "eager")]
        ratio = median / sorted(eager)[len(eager) // 2]
        spread = f"{min(values) * 1e3:.1f}-{max(values) * 1e3:.1f}"
        print(f"{name:32} {median * 1e3:10.1f} {spread:>15} {ratio:8.3f} {first['build'][name]:13.1f}")
    for rank, result in enumerate(results):
        shares = ", ".join(f"{name} {share:.3f}" for name, share in result["w_share"].items())
        print(f"rank {rank}: W / (B + W) over 3 recorded steps: {shares}")
    for rank, result in enumerate(results):
        print(
            f"rank {rank}: graph breaks {result['graph breaks (all)']} while building and in first steps, "
            f"{result['graph breaks in timed steps']} in timed steps; "
            f"graphs compiled in timed steps {result['graphs compiled in timed steps']}"
        )
    print("step times are rank 0's (barrier to barrier, the same on both ranks within the barrier)")


if __name__ == "__main__":
    main()
