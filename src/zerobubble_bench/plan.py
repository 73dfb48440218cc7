"""``bench plan``: ``schedule="auto"`` against hand-picked schedules and torch's ZBV.

On the uneven language model (a large vocabulary: heavy first and last layers) auto's partition
and schedule run beside zb-v on the even split and torch's ZBV, per rank count; on the balanced
MLP of ``bench pipelines`` beside our hand-picked schedules.  The tables also give each
configuration's step time as predicted before the timed steps: from auto's profile alone, and
from the profile calibrated by auto's own first recorded steps (``pipe.plan.calibration``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from zerobubble import Pipeline
from zerobubble.runtime.launch import init_distributed, launch
from zerobubble.schedule import simulate
from zerobubble.schedule.partition import even_partition

from . import Benchmark, add_round_arguments
from .tables import Table, median
from .workloads import (
    OUR_SCHEDULES,
    bench_partition,
    interleaved,
    our_step,
    torch_runner,
    uneven_lm_workload,
    workload,
)


@dataclass(frozen=True)
class Rounds:
    """How :func:`plan_benchmark` times its configurations: ``rounds`` interleaved rounds of
    ``steps_per_round`` timed steps each, after ``warmup`` steps, ``settle`` untimed steps before each
    configuration's turn in a round (:func:`~.workloads.interleaved`)."""

    rounds: int = 8
    steps_per_round: int = 3
    warmup: int = 2
    settle: int = 1


def plan_benchmark(
    ranks: Sequence[int] = (2, 4),
    microbatches: int = 8,
    rows: int = 2,
    mlp_rows: int = 32,
    calibrate: int = 3,
    timing: Rounds = Rounds(),
) -> list[Table]:
    """``schedule="auto"`` against zb-v on the even split and torch's ZBV on the uneven LM, per rank count;
    and against our hand-picked schedules on the balanced MLP of ``bench pipelines`` (2 ranks).

    Every configuration runs in the same spawned ranks, in rotating rounds; the tables give medians,
    ratios to auto, and each configuration's step time predicted by the simulator from auto's profile
    and from that profile calibrated on auto's steps 2..1+``calibrate`` (run before any timed step);
    ``timing`` says how the steps are timed (:class:`Rounds`).
    """
    tables = []
    for count in ranks:
        lm = launch(
            _plan_rank,
            count,
            ("lm", microbatches, rows, calibrate, timing),
            threads=1,
        )[0]
        tables.append(_plan_table(uneven_lm_workload(microbatches, rows).name, count, microbatches, rows, lm))
    mlp = launch(
        _plan_rank,
        2,
        ("mlp", microbatches, mlp_rows, calibrate, timing),
        threads=1,
    )[0]
    tables.append(_plan_table(workload("mlp", microbatches, mlp_rows).name, 2, microbatches, mlp_rows, mlp))
    return tables


def _plan_rank(model: str, m: int, rows: int, calibrate: int, timing: Rounds) -> dict[str, Any]:
    init_distributed(backend="gloo", timeout=300)
    world = dist.get_world_size()
    load = uneven_lm_workload(m, rows) if model == "lm" else workload("mlp", m, rows)
    # the measured step is barrier to barrier without an optimizer step: plan for the makespan ("sync")
    auto = Pipeline(
        load.make_layers(),
        schedule="auto",
        microbatches=m,
        loss_fn=load.loss_fn,
        example=load.batch,
        post_validation=False,
        timeout=300,
        calibrate=calibrate,
    )
    for _ in range(1 + calibrate):  # the calibration's steps, all before any timed step
        our_step(auto, load.batch)()
    plan, layer_profile = auto.plan, auto.profile
    assert plan is not None and layer_profile is not None
    calibration = plan.calibration
    assert calibration is not None
    pipes = {f"auto ({auto.schedule.name}, cuts {list(plan.partition)})": auto}
    pipes.update(_fixed_pipelines(model, load, m, world))
    runners = {label: our_step(pipe, load.batch) for label, pipe in pipes.items()}
    if model == "lm":
        runners["torch ScheduleZBVZeroBubble, even split"] = torch_runner(
            "ScheduleZBVZeroBubble", model, load, m
        )
    steps = timing.steps_per_round
    times = interleaved(runners, timing.rounds, steps, timing.warmup, timing.settle)
    return {
        "times": times,
        "steps_per_round": steps,
        "predicted": _predictions(pipes, layer_profile, plan.cores, calibration.profile),
        "reason": plan.reason,
        "calibration": calibration.describe(),
    }


def _fixed_pipelines(model: str, load: Any, m: int, world: int) -> dict[str, Pipeline]:
    """The pipelines auto is measured against, by label: zb-v cut evenly for the language model, every
    schedule of ours with the benchmark's partition for the others."""
    pipes = {}
    count = len(load.make_layers())
    names = ("zb-v",) if model == "lm" else OUR_SCHEDULES
    for name in names:
        chunks = 2 * world if name == "zb-v" else world
        partition = even_partition(count, chunks) if model == "lm" else bench_partition(model, count, chunks)
        label = f"zb-v, even split {partition}" if model == "lm" else f"ours {name}"
        pipes[label] = Pipeline(
            load.make_layers(),
            schedule=name,
            microbatches=m,
            loss_fn=load.loss_fn,
            partition=partition,
            timeout=300,
        )
    return pipes


def _predictions(
    pipes: dict[str, Pipeline], layer_profile: Any, cores: int | None, calibrated: Any
) -> dict[str, dict[str, float]]:
    """Each pipeline's simulated makespan from the plan's layer profile and from the calibrated one."""
    from zerobubble.schedule.modelplan import stage_costs

    predicted: dict[str, dict[str, float]] = {"profile": {}, "calibrated": {}}
    for label, pipe in pipes.items():
        bounds, fused = pipe.layer_bounds, not pipe.schedule.splits_backward
        # the profile holds times on a core of its own, the plan's cores model the ranks sharing them;
        # the calibrated times were measured while sharing them: simulated as they are
        for kind, profile, kind_cores in (
            ("profile", layer_profile, cores),
            ("calibrated", calibrated, None),
        ):
            costs = stage_costs(profile, bounds[1:-1], len(bounds) - 1, fused=fused)
            predicted[kind][label] = simulate(pipe.schedule, costs, cores=kind_cores).makespan
    return predicted


def _plan_table(label: str, ranks: int, m: int, rows: int, result: dict[str, Any]) -> Table:
    times, predicted = result["times"], result["predicted"]
    auto = next(name for name in times if name.startswith("auto"))
    reference = median(times[auto])
    table = Table(
        f"{label}: step time on {ranks} CPU ranks, {m} microbatches of {rows} "
        f"{'sequences' if 'LM' in label else 'rows'}",
        [
            "configuration",
            "median step (ms)",
            "× auto",
            "× auto, paired by round (min–max)",
            "predicted, profile (ms)",
            "measured / predicted",
            "predicted, calibrated (ms)",
            "measured / calibrated",
            "× auto, calibrated prediction",
            "rounds max / min",
            "steps",
        ],
    )
    per_round = result["steps_per_round"]
    calibrated = predicted["calibrated"]
    auto_rounds = _round_medians(times[auto], per_round)
    for name, values in times.items():
        value = median(values)
        rounds = _round_medians(values, per_round)
        # each round measures every configuration within seconds: a ratio per round cancels slow drift
        paired = [mine / theirs for mine, theirs in zip(rounds, auto_rounds)]
        row = [
            name,
            f"{value * 1e3:.1f}",
            f"{value / reference:.3f}",
            f"{median(paired):.3f} ({min(paired):.3f}–{max(paired):.3f})",
        ]
        for kind in ("profile", "calibrated"):
            guess = predicted[kind].get(name)
            row += [f"{guess * 1e3:.1f}", f"{value / guess:.3f}"] if guess else ["—", "—"]
        row.append(f"{calibrated[name] / calibrated[auto]:.3f}" if name in calibrated else "—")
        table.rows.append([*row, f"{max(rounds) / min(rounds):.3f}", str(len(values))])
    table.notes.append(
        f"auto chose: {result['reason']}. Then auto's first steps (after the very first) were recorded: "
        f"{result['calibration']}. "
        "Predicted = the simulator's makespan for that configuration's schedule and partition, made "
        "before any timed step: 'profile' from auto's per-layer profile (taken before the run), "
        "'calibrated' from that profile scaled to the op times of auto's recorded steps (other steps "
        "than the timed ones). × auto, calibrated prediction: the calibrated prediction over auto's, to "
        "compare with the measured × auto (a load from elsewhere that slows every configuration alike "
        "cancels in it). × auto, paired by round: each round's median step over auto's in the same round, "
        "the median over rounds and its range. Rounds max / min: the slowest round's median step over "
        "the fastest's, for "
        "the same configuration — how much identical work varied during the run. Step = barrier to "
        "barrier, backward and zero_grad included, no optimizer; configurations measured in rotating "
        "rounds, each configuration's turn beginning with an untimed step (its caches warm again)."
    )
    return table


def _round_medians(values: list[float], per_round: int) -> list[float]:
    """The median step of each round (``values`` holds ``per_round`` steps a round, in round order)."""
    return [median(values[i : i + per_round]) for i in range(0, len(values), per_round)]


# ---- the ``zerobubble bench plan`` command ----


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``zerobubble bench plan``."""
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    add_round_arguments(parser, rounds=8, steps_per_round=3)


def run(args: argparse.Namespace) -> list[Table]:
    """``zerobubble bench plan``: one table per rank count on the uneven LM, then the MLP's."""
    timing = Rounds(rounds=args.rounds, steps_per_round=args.steps_per_round, settle=args.settle)
    return plan_benchmark(args.ranks, args.microbatches, timing=timing)


BENCHMARK = Benchmark(
    "plan", 'schedule="auto" vs even-split zb-v and torch ZBV; auto on the MLP', add_arguments, run
)
