"""``bench pipelines``: our schedules against ``torch.distributed.pipelining``'s, on real ranks.

The same model, split, batch and microbatches under our 1F1B, ZB-H1, ZB-2p and ZB-V, torch's
1F1B, interleaved zero-bubble and ZBV, the single-process step and each rank's half of the model
run at once without transfers (the machine's floor), on 2 CPU ranks (gloo, one thread each),
measured in rotating rounds; one :class:`.tables.Table` per model.  ``--rows`` sets the MLP's
microbatch size and ``--only`` picks rows (issue 47's setup: ``--models mlp --rows 128``).
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
    halves_runner,
    interleaved,
    our_step,
    single_runner,
    torch_runner,
    workload,
)

HALVES = "halves at once, no transfers"
"""The row where each rank runs its zb-v half on its own inputs, both at once: the machine's floor."""

_REFERENCES = ("torch Schedule1F1B", "torch ScheduleZBVZeroBubble")
"""The torch schedules every row is also compared with, where they ran."""


def compare_pipelines(
    models: Sequence[str] = ("mlp", "gpt"),
    microbatches: int = 8,
    rows: dict[str, int] | None = None,
    rounds: int = 5,
    steps_per_round: int = 2,
    warmup: int = 2,
    settle: int = 1,
    *,
    only: Sequence[str] = (),
) -> list[Table]:
    """Step time of our schedules, torch's and the single-process step on 2 CPU ranks (gloo, 1 thread).

    ``rows`` per model is the microbatch size (MLP rows, GPT sequences).  ``only`` keeps the
    configurations named (``single process``, ``ours zb-v``, ``torch ScheduleZBVZeroBubble``, ...;
    the single-process step is always kept: it is the limit).  One table per model.
    """
    rows = {"mlp": 32, "gpt": 4, **(rows or {})}
    keep = tuple(only)
    results = launch(
        _compare_rank,
        2,
        (tuple(models), microbatches, rows, rounds, steps_per_round, warmup, settle, keep),
        threads=1,
    )[0]
    return [_comparison_table(model, microbatches, rows[model], times) for model, times in results.items()]


def _compare_rank(
    models, microbatches, rows, rounds, steps_per_round, warmup, settle, only
) -> dict[str, dict[str, list[float]]]:
    init_distributed(backend="gloo", timeout=300)
    results = {}
    for model in models:
        load = workload(model, microbatches, rows[model])
        runners = _pipeline_runners(model, load, microbatches, only)
        results[model] = interleaved(runners, rounds, steps_per_round, warmup, settle)
    return results


def _pipeline_runners(
    model: str, load: Workload, m: int, only: Sequence[str] = ()
) -> dict[str, Callable[[], None]]:
    """One zero-argument step function per configuration, all on the same model, split and batch
    (those named in ``only``, when given, and the single-process step)."""
    count = len(load.make_layers())
    runners: dict[str, Callable[[], None]] = {"single process": single_runner(load, m)}
    wanted = set(only) | {"single process"} if only else None
    if wanted is None or HALVES in wanted:
        runners[HALVES] = halves_runner(model, load, m)
    for name in OUR_SCHEDULES:
        if wanted is not None and f"ours {name}" not in wanted:
            continue
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
        if wanted is None or f"torch {name}" in wanted:
            runners[f"torch {name}"] = torch_runner(name, model, load, m)
    unknown = sorted((wanted or set()) - set(runners))
    if unknown:
        raise ValueError(f"no configuration named {unknown}; the names are those of the table's rows")
    return runners


def _comparison_table(model: str, m: int, rows: int, times: dict[str, list[float]]) -> Table:
    single = median(times["single process"])
    limit = single / 2
    references = [name for name in _REFERENCES if name in times]
    table = Table(
        f"{workload(model, m, rows).name}: step time on 2 CPU ranks, {m} microbatches of {rows} "
        f"{'rows' if model == 'mlp' else 'sequences'}",
        [
            "configuration",
            "median step (ms)",
            "spread (ms)",
            "× 2-rank limit",
            "fastest × limit",
            *(f"× {name}" for name in references),
            "steps",
        ],
    )
    for name, values in times.items():
        value = median(values)
        table.rows.append(
            [
                name,
                f"{value * 1e3:.1f}",
                f"{min(values) * 1e3:.1f}–{max(values) * 1e3:.1f}",
                f"{value / limit:.3f}",
                f"{min(values) / (min(times['single process']) / 2):.3f}",
                *(f"{value / median(times[reference]):.3f}" for reference in references),
                str(len(values)),
            ]
        )
    table.notes.append(
        "2-rank limit = half the single-process step (same microbatches, one thread). "
        "Step = barrier to barrier, backward and zero_grad included, no optimizer. "
        f"'{HALVES}': each rank runs the layers zb-v places on it (plain autograd) on its own "
        "microbatches, both ranks at once — what two ranks sharing this machine's caches and memory "
        "allow. Configurations measured in rotating rounds; spread = fastest–slowest step; "
        "'fastest × limit' = fastest step / half the fastest single-process step (on a loaded "
        "machine the least disturbed steps)."
    )
    return table


# ---- the ``zerobubble bench pipelines`` command ----


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``zerobubble bench pipelines``."""
    parser.add_argument("--models", nargs="+", default=["mlp", "gpt"], choices=["mlp", "gpt"])
    parser.add_argument("--rows", type=int, default=None, help="MLP rows per microbatch (default 32)")
    parser.add_argument(
        "--only",
        nargs="+",
        default=[],
        metavar="CONFIGURATION",
        help="run only these rows (e.g. 'ours zb-v' 'torch ScheduleZBVZeroBubble'); "
        "the single process always runs",
    )
    add_round_arguments(parser, rounds=5, steps_per_round=2)


def run(args: argparse.Namespace) -> list[Table]:
    """``zerobubble bench pipelines``: one table per model."""
    return compare_pipelines(
        args.models,
        args.microbatches,
        rows={"mlp": args.rows} if args.rows else None,
        rounds=args.rounds,
        steps_per_round=args.steps_per_round,
        settle=args.settle,
        only=args.only,
    )


BENCHMARK = Benchmark(
    "pipelines", "ours vs torch.distributed.pipelining vs one process, 2 ranks", add_arguments, run
)
