"""``bench emulate``: the real runtime with emulated compute, measured against the simulator.

Every registry schedule runs on ``ranks`` real ranks with each op stretched to its modelled
duration (:mod:`zerobubble.runtime.execute.emulate`); the table compares the measured iteration time with
``simulate(schedule, costs)``, with and without the measured transfer latency.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zerobubble import Pipeline
from zerobubble.runtime.launch import init_distributed, launch
from zerobubble.schedule import REGISTRY, CostModel, build_schedule, simulate

from . import Benchmark
from .tables import Table, median
from .workloads import tiny_layers

EMULATED_COSTS = CostModel(f=10.0, b=10.0, w=7.0)
"""Milliseconds per rank-stage for the emulated pipelines (W a bit cheaper than F and B, as in the paper)."""


def emulated_schedules() -> list[str]:
    """Every registry schedule the emulation benchmark runs (the ILP is left out: it needs a solver run)."""
    return [name for name in REGISTRY if name not in ("zb-ilp", "zb-auto")]


def emulated_pipelines(
    ranks: int,
    microbatches: int | None = None,
    costs: CostModel = EMULATED_COSTS,
    steps: int = 4,
    schedules: Sequence[str] | None = None,
) -> Table:
    """Measured (emulated compute) against predicted iteration time of every schedule on ``ranks`` ranks."""
    m = microbatches or 2 * ranks
    names = list(schedules or emulated_schedules())
    results = launch(_emulate_rank, ranks, (names, m, costs, steps), threads=1)[0]
    table = Table(
        f"Emulated compute on {ranks} ranks, {m} microbatches, "
        f"F/B/W = {costs.f}/{costs.b}/{costs.w} ms per rank-stage",
        [
            "schedule",
            "predicted (ms)",
            "measured (ms)",
            "measured / predicted",
            "predicted with measured T_comm (ms)",
            "measured / that",
            "predicted bubble",
            "measured bubble",
        ],
    )
    latencies = []
    for name in names:
        outcome = results[name]
        if isinstance(outcome, str):
            table.rows.append([name, "—", "—", outcome, "—", "—", "—", "—"])
            continue
        predicted, measured, with_comm, latency, predicted_bubble, measured_bubble = outcome
        latencies.append(latency)
        table.rows.append(
            [
                name,
                f"{predicted * 1e3:.1f}",
                f"{measured * 1e3:.1f}",
                f"{measured / predicted:.4f}",
                f"{with_comm * 1e3:.1f}",
                f"{measured / with_comm:.4f}",
                f"{predicted_bubble:.1%}",
                f"{measured_bubble:.1%}",
            ]
        )
    table.notes.append(
        f"Measured = median over {steps} steps (after one warm-up step) of the recorded iteration time "
        "(max over ranks of first-op start to last-op end); predicted = simulate(schedule, costs) with "
        "T_comm = 0, and again with T_comm = the median measured transfer latency of that schedule's run "
        "(producer's end to the waiting consumer's wake-up; median over schedules "
        f"{median(latencies) * 1e3:.2f} ms). Real 8-wide tensors cross real gloo channels; each op sleeps "
        "to its modelled duration."
    )
    return table


def _emulate_rank(names: list[str], m: int, costs: CostModel, steps: int) -> dict[str, Any]:
    from zerobubble.runtime.observe.trace import median_timeline, transfer_latencies

    init_distributed(backend="gloo", timeout=300)
    ranks = dist.get_world_size()
    generator = torch.Generator().manual_seed(0)
    batch = (torch.randn(m * 2, 8, generator=generator), torch.randn(m * 2, 8, generator=generator))
    results: dict[str, Any] = {}
    for name in names:
        try:
            schedule = build_schedule(
                name, ranks, m, costs=costs, chunks=2 if name == "interleaved-1f1b" else None
            )
        except Exception as error:
            results[name] = f"not built: {error}"[:60]
            continue
        pipe = Pipeline(
            tiny_layers(ranks * schedule.chunks),
            schedule=schedule,
            loss_fn=F.mse_loss,
            timeout=300,
            trace=True,
            emulate=costs,
        )
        for _ in range(steps + 1):
            pipe.step(*batch)
            pipe.zero_grad()
        timelines = pipe.measured_timelines()
        if timelines is not None:
            measured = median_timeline(timelines[1:])
            predicted = simulate(schedule, costs)
            latency = median([x for t in timelines[1:] for x in transfer_latencies(t)] or [0.0])
            with_comm = simulate(schedule, costs.replace(comm=latency * 1e3))
            results[name] = (
                predicted.iteration_time / 1e3,
                measured.iteration_time,
                with_comm.iteration_time / 1e3,
                latency,
                predicted.bubble_rate,
                1.0 - predicted.ideal / 1e3 / measured.iteration_time,
            )
    return results


# ---- the ``zerobubble bench emulate`` command ----


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``zerobubble bench emulate``."""
    parser.add_argument("--ranks", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--schedules", nargs="+", help="default: every schedule")
    parser.add_argument(
        "--costs",
        nargs=3,
        type=float,
        default=[10.0, 10.0, 7.0],
        metavar=("F", "B", "W"),
        help="emulated op times in milliseconds (default 10 10 7)",
    )


def run(args: argparse.Namespace) -> list[Table]:
    """``zerobubble bench emulate``: one table per rank count."""
    f, b, w = args.costs
    return [
        emulated_pipelines(ranks, costs=CostModel(f=f, b=b, w=w), steps=args.steps, schedules=args.schedules)
        for ranks in args.ranks
    ]


BENCHMARK = Benchmark("emulate", "emulated compute: measured vs predicted iteration time", add_arguments, run)
