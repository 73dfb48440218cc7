"""``bench pipelines``: our schedules against ``torch.distributed.pipelining``'s, on real ranks.

The same model, split, batch and microbatches under our 1F1B, ZB-H1, ZB-2p and ZB-V, torch's
1F1B, interleaved zero-bubble and ZBV, and the single-process step, on 2 CPU ranks (gloo, one
thread each), measured in rotating rounds; one :class:`.tables.Table` per model.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from zerobubble import Pipeline
from zerobubble.runtime.launch import init_distributed, launch

from . import Benchmark, add_round_arguments
from .tables import Table, median
from .workloads import (
    OUR_SCHEDULES,
    TORCH_SCHEDULES,
    Workload,
    bench_partition,
    interleaved,
    our_step,
    single_runner,
    torch_runner,
    workload,
)


def compare_pipelines(
    models: Sequence[str] = ("mlp", "gpt"),
    microbatches: int = 8,
    rows: dict[str, int] | None = None,
    rounds: int = 5,
    steps_per_round: int = 2,
    warmup: int = 2,
    settle: int = 1,
) -> list[Table]:
    """Step time of our schedules, torch's and the single-process step on 2 CPU ranks (gloo, 1 thread).

    ``rows`` per model is the microbatch size (MLP rows, GPT sequences).  One table per model.
    """
    rows = rows or {"mlp": 32, "gpt": 4}
    results = launch(
        _compare_rank,
        2,
        (tuple(models), microbatches, rows, rounds, steps_per_round, warmup, settle),
        threads=1,
    )[0]
    return [_comparison_table(model, microbatches, rows[model], times) for model, times in results.items()]


def _compare_rank(
    models, microbatches, rows, rounds, steps_per_round, warmup, settle
) -> dict[str, dict[str, list[float]]]:
    init_distributed(backend="gloo", timeout=300)
    results = {}
    for model in models:
        load = workload(model, microbatches, rows[model])
        runners = _pipeline_runners(model, load, microbatches)
        results[model] = interleaved(runners, rounds, steps_per_round, warmup, settle)
    return results


def _pipeline_runners(model: str, load: Workload, m: int) -> dict[str, Callable[[], None]]:
    """One zero-argument step function per configuration, all on the same model, split and batch."""
    count = len(load.make_layers())
    runners: dict[str, Callable[[], None]] = {"single process": single_runner(load, m)}
    for name in OUR_SCHEDULES:
        chunks = 4 if name == "zb-v" else 2
        pipe = Pipeline(
            load.make_layers(),
            schedule=name,
            microbatches=m,
            loss_fn=load.loss_fn,
            partition=bench_partition(model, count, chunks),
            timeout=300,
        )
        runners[f"ours {name}"] = our_step(pipe, load.batch)
    for name in TORCH_SCHEDULES:
        runners[f"torch {name}"] = torch_runner(name, model, load, m)
    return runners


def _comparison_table(model: str, m: int, rows: int, times: dict[str, list[float]]) -> Table:
    single = median(times["single process"])
    limit = single / 2
    reference = median(times["torch Schedule1F1B"])
    table = Table(
        f"{workload(model, m, rows).name}: step time on 2 CPU ranks, {m} microbatches of {rows} "
        f"{'rows' if model == 'mlp' else 'sequences'}",
        ["configuration", "median step (ms)", "× 2-rank limit", "× torch 1F1B", "steps"],
    )
    for name, values in times.items():
        value = median(values)
        table.rows.append(
            [
                name,
                f"{value * 1e3:.1f}",
                f"{value / limit:.3f}",
                f"{value / reference:.3f}",
                str(len(values)),
            ]
        )
    table.notes.append(
        "2-rank limit = half the single-process step (same microbatches, one thread). "
        "Step = barrier to barrier, backward and zero_grad included, no optimizer. "
        "Configurations measured in rotating rounds."
    )
    return table


# ---- the ``zerobubble bench pipelines`` command ----


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``zerobubble bench pipelines``."""
    parser.add_argument("--models", nargs="+", default=["mlp", "gpt"], choices=["mlp", "gpt"])
    add_round_arguments(parser, rounds=5, steps_per_round=2)


def run(args: argparse.Namespace) -> list[Table]:
    """``zerobubble bench pipelines``: one table per model."""
    return compare_pipelines(
        args.models,
        args.microbatches,
        rounds=args.rounds,
        steps_per_round=args.steps_per_round,
        settle=args.settle,
    )


BENCHMARK = Benchmark(
    "pipelines", "ours vs torch.distributed.pipelining vs one process, 2 ranks", add_arguments, run
)
