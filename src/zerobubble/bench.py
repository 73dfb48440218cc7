"""Benchmarks of the runtime: library code behind ``benchmarks/*.py`` and ``zerobubble bench``.

* :func:`compare_pipelines` — our schedules against ``torch.distributed.pipelining``'s on the same
  model, split, batch and microbatches, on real ranks; also the single-process step.
* :func:`wgrad_split_cost` — ``T_B + T_W`` of the B/W split against the fused backward of one stage.
* :func:`emulated_pipelines` — the real runtime with emulated compute (:mod:`.runtime.emulate`) on
  ``p`` ranks: measured against predicted iteration time for every schedule.

Every benchmark measures its configurations side by side in one run, round by round in rotating
order (so machine drift and other load hit all of them alike) and reports medians and ratios.
Each returns a :class:`Table`; :meth:`Table.markdown` renders it for the README together with the
machine it ran on (:func:`machine_description`).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .models import Block, GPTConfig, MarkovCorpus, gpt_layers, lm_loss
from .runtime.launch import init_distributed, launch
from .runtime.pipeline import Pipeline, even_partition
from .schedule import REGISTRY, CostModel, build_schedule, simulate


@dataclass
class Table:
    """A titled table of benchmark results (cells already formatted) and notes below it."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        """The table as GitHub Markdown."""
        lines = [
            f"### {self.title}",
            "",
            "| " + " | ".join(self.columns) + " |",
            "|" + "|".join("---" for _ in self.columns) + "|",
        ]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        if self.notes:
            lines += ["", *self.notes]
        return "\n".join(lines)


def machine_description() -> str:
    """One line naming the machine, for the tables: CPU model, cores, load, torch version."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    except OSError:
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return (
        f"{cpu}, {os.cpu_count()} cores, load average {load} at start, torch {torch.__version__}, "
        f"Python {platform.python_version()}"
    )


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


# -- models ------------------------------------------------------------------------------------------


def mlp_layers(count: int = 8, width: int = 1024, seed: int = 0) -> list[nn.Module]:
    """``count`` × (Linear(width) + ReLU), one layer per list entry."""
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(count)]


def bench_gpt_config() -> GPTConfig:
    """The GPT of the pipeline comparison: 8 blocks of width 128 on sequences of 64 tokens."""
    return GPTConfig(vocab=256, seq_len=64, dim=128, heads=4, n_layers=8)


@dataclass(frozen=True)
class Workload:
    """A model and one batch: ``make_layers()`` builds it afresh (same seed), ``batch`` feeds it."""

    name: str
    make_layers: Callable[[], list[nn.Module]]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    batch: tuple[torch.Tensor, torch.Tensor]


def workload(name: str, microbatches: int, rows: int) -> Workload:
    """``mlp`` (rows of width 1024 per microbatch) or ``gpt`` (rows = sequences per microbatch)."""
    generator = torch.Generator().manual_seed(1)
    if name == "mlp":
        batch = (
            torch.randn(microbatches * rows, 1024, generator=generator),
            torch.randn(microbatches * rows, 1024, generator=generator),
        )
        return Workload("MLP 8×Linear(1024)+ReLU", mlp_layers, F.mse_loss, batch)
    config = bench_gpt_config()
    corpus = MarkovCorpus(config.vocab, config.seq_len, seed=1)

    def layers() -> list[nn.Module]:
        torch.manual_seed(0)
        return gpt_layers(config)

    label = f"GPT {config.n_layers}×block d={config.dim} seq={config.seq_len}"
    return Workload(label, layers, lm_loss, corpus.batch(microbatches * rows))


def bench_partition(model: str, count: int, chunks: int) -> list[int]:
    """Where chunks 1..chunks−1 start: for the GPT an equal number of blocks per chunk (the light
    embedding rides with the first, the head with the last), so every rank of a V gets equal work;
    for the MLP an even split."""
    if model != "gpt":
        return even_partition(count, chunks)
    blocks = count - 2
    return [1 + cut for cut in even_partition(blocks, chunks)]


# -- 1. our schedules against torch.distributed.pipelining ------------------------------------------

OUR_SCHEDULES = ("1f1b", "zb-h1", "zb-2p", "zb-v")
TORCH_SCHEDULES = ("Schedule1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble")


def compare_pipelines(
    models: Sequence[str] = ("mlp", "gpt"),
    microbatches: int = 8,
    rows: dict[str, int] | None = None,
    rounds: int = 5,
    steps_per_round: int = 2,
    warmup: int = 2,
) -> list[Table]:
    """Step time of our schedules, torch's and the single-process step on 2 CPU ranks (gloo, 1 thread).

    ``rows`` per model is the microbatch size (MLP rows, GPT sequences).  One table per model.
    """
    rows = rows or {"mlp": 32, "gpt": 4}
    results = launch(
        _compare_rank, 2, (tuple(models), microbatches, rows, rounds, steps_per_round, warmup), threads=1
    )[0]
    return [_comparison_table(model, microbatches, rows[model], times) for model, times in results.items()]


def _compare_rank(
    models, microbatches, rows, rounds, steps_per_round, warmup
) -> dict[str, dict[str, list[float]]]:
    init_distributed(backend="gloo", timeout=300)
    results = {}
    for model in models:
        load = workload(model, microbatches, rows[model])
        runners = _pipeline_runners(model, load, microbatches)
        results[model] = _interleaved(runners, rounds, steps_per_round, warmup)
    return results


def _pipeline_runners(model: str, load: Workload, m: int) -> dict[str, Callable[[], None]]:
    """One zero-argument step function per configuration, all on the same model, split and batch."""
    count = len(load.make_layers())
    runners: dict[str, Callable[[], None]] = {"single process": _single_runner(load, m)}
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
        runners[f"ours {name}"] = _our_step(pipe, load.batch)
    for name in TORCH_SCHEDULES:
        runners[f"torch {name}"] = _torch_runner(name, model, load, m)
    return runners


def _our_step(pipe, batch) -> Callable[[], None]:
    def step() -> None:
        pipe.step(*batch)
        pipe.zero_grad()

    return step


def _single_runner(load: Workload, m: int) -> Callable[[], None]:
    """The whole model in this process, microbatch by microbatch (same matmul shapes), gradients summed."""
    model = nn.Sequential(*load.make_layers())
    inputs, targets = (t.chunk(m) for t in load.batch)

    def step() -> None:
        for x, y in zip(inputs, targets):
            (load.loss_fn(model(x), y) / m).backward()
        model.zero_grad(set_to_none=True)

    return step


def _torch_runner(name: str, model: str, load: Workload, m: int) -> Callable[[], None]:
    """A torch.distributed.pipelining schedule over the same split as ours (V order for ZBV)."""
    from torch.distributed.pipelining import PipelineStage, schedules

    rank, world = dist.get_rank(), dist.get_world_size()
    layers = load.make_layers()
    chunks = 2 * world if name == "ScheduleZBVZeroBubble" else world
    bounds = [0, *bench_partition(model, len(layers), chunks), len(layers)]
    if name == "ScheduleZBVZeroBubble":
        indices = [rank, 2 * world - 1 - rank]
    else:
        indices = [rank]
    stages = [
        PipelineStage(nn.Sequential(*layers[bounds[i] : bounds[i + 1]]), i, chunks, torch.device("cpu"))
        for i in indices
    ]
    schedule_class = getattr(schedules, name)
    schedule = schedule_class(
        stages if len(stages) > 1 or name != "Schedule1F1B" else stages[0],
        n_microbatches=m,
        loss_fn=load.loss_fn,
    )
    holds_first = 0 in indices
    holds_last = chunks - 1 in indices
    inputs, targets = load.batch
    modules = [stage.submod for stage in stages]

    def step() -> None:
        args = (inputs,) if holds_first else ()
        kwargs = {"target": targets, "losses": []} if holds_last else {}
        schedule.step(*args, **kwargs)
        for module in modules:
            module.zero_grad(set_to_none=True)

    return step


def _interleaved(
    runners: dict[str, Callable[[], None]], rounds: int, steps: int, warmup: int
) -> dict[str, list[float]]:
    """Per configuration, the step times (barrier to barrier) of ``rounds`` rotating rounds."""
    names = list(runners)
    for name in names:
        for _ in range(warmup):
            _timed(runners[name])
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            for _ in range(steps):
                times[name].append(_timed(runners[name]))
    return times


def _timed(step: Callable[[], None]) -> float:
    dist.barrier()
    started = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - started


def _comparison_table(model: str, m: int, rows: int, times: dict[str, list[float]]) -> Table:
    single = _median(times["single process"])
    limit = single / 2
    reference = _median(times["torch Schedule1F1B"])
    table = Table(
        f"{workload(model, m, rows).name}: step time on 2 CPU ranks, {m} microbatches of {rows} "
        f"{'rows' if model == 'mlp' else 'sequences'}",
        ["configuration", "median step (ms)", "× 2-rank limit", "× torch 1F1B", "steps"],
    )
    for name, values in times.items():
        median = _median(values)
        table.rows.append(
            [
                name,
                f"{median * 1e3:.1f}",
                f"{median / limit:.3f}",
                f"{median / reference:.3f}",
                str(len(values)),
            ]
        )
    table.notes.append(
        "2-rank limit = half the single-process step (same microbatches, one thread). "
        "Step = barrier to barrier, backward and zero_grad included, no optimizer. "
        "Configurations measured in rotating rounds."
    )
    return table


# -- 2. the cost of the B/W split --------------------------------------------------------------------


def wgrad_split_cost(
    rows_list: Sequence[int] = (8, 32, 128, 512), repeats: int = 15, threads: int = 1, accumulate: bool = True
) -> Table:
    """``T_B + T_W`` of the deferred split against the fused backward, per stage and microbatch size.

    Stages: 4 × (Linear(1024) + ReLU) of the MLP, and one GPT block (width 256, ``rows`` tokens).
    Fused and split backwards alternate within each repeat; medians are reported.  With
    ``accumulate`` weight gradients add into existing ``.grad`` tensors (every microbatch of a step
    but the first); without, ``.grad`` is reset before each repeat (a step's first microbatch).
    """
    torch.set_num_threads(threads)
    regime = "accumulating into .grad" if accumulate else "fresh .grad (first microbatch)"
    table = Table(
        f"B/W split cost (single process, {threads} thread, {regime})",
        ["stage", "rows", "fused backward (ms)", "T_B (ms)", "T_W (ms)", "(T_B+T_W)/fused"],
    )
    for label, make, shape in _split_stages():
        for rows in rows_list:
            fused, split_b, split_w = _split_times(make, shape(rows), repeats, accumulate)
            table.rows.append(
                [
                    label,
                    str(rows),
                    f"{fused * 1e3:.3f}",
                    f"{split_b * 1e3:.3f}",
                    f"{split_w * 1e3:.3f}",
                    f"{(split_b + split_w) / fused:.3f}",
                ]
            )
    table.notes.append(f"Median of {repeats} repeats after one warm-up; the goal is ≤ 1.05 for ≥ 32 rows.")
    return table


def _split_stages():
    def mlp() -> nn.Module:
        return nn.Sequential(*mlp_layers(4))

    def block() -> nn.Module:
        torch.manual_seed(0)
        return Block(GPTConfig(vocab=16, seq_len=512, dim=256, heads=4, n_layers=1))

    return [
        ("MLP 4×Linear(1024)", mlp, lambda rows: (rows, 1024)),
        ("GPT block d=256", block, lambda rows: (1, rows, 256)),
    ]


def _split_times(
    make: Callable[[], nn.Module], shape: tuple[int, ...], repeats: int, accumulate: bool
) -> tuple[float, float, float]:
    from .runtime.wgrad import WeightGradStore, install_deferral

    fused_module, split_module = make(), make()
    store = WeightGradStore()
    install_deferral([split_module], store)
    x = torch.randn(*shape, requires_grad=True)
    fused, split_b, split_w = [], [], []
    for repeat in range(repeats + 1):
        out = fused_module(x)
        grad = torch.ones_like(out)
        started = time.perf_counter()
        out.backward(grad)
        elapsed_fused = time.perf_counter() - started
        out = split_module(x)
        store.begin((0, 0), True)
        started = time.perf_counter()
        out.backward(grad)
        middle = time.perf_counter()
        store.end()
        store.flush((0, 0))
        ended = time.perf_counter()
        if repeat:  # the first repeat warms up (and creates the .grad tensors later repeats accumulate into)
            fused.append(elapsed_fused)
            split_b.append(middle - started)
            split_w.append(ended - middle)
        if not accumulate:
            fused_module.zero_grad(set_to_none=True)
            split_module.zero_grad(set_to_none=True)
        x.grad = None
    return _median(fused), _median(split_b), _median(split_w)


# -- 3. emulated pipelines ---------------------------------------------------------------------------

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
        f"{_median(latencies) * 1e3:.2f} ms). Real 8-wide tensors cross real gloo channels; each op sleeps "
        "to its modelled duration."
    )
    return table


def _emulate_rank(names: list[str], m: int, costs: CostModel, steps: int) -> dict[str, Any]:
    from .runtime.emulate import tiny_layers
    from .runtime.trace import median_timeline, transfer_latencies

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
            latency = _median([x for t in timelines[1:] for x in transfer_latencies(t)] or [0.0])
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


# -- 4. schedule="auto" against hand-picked schedules -------------------------------------------------


def uneven_lm_config() -> GPTConfig:
    """The uneven language model of ``bench plan``: a 16k-token vocabulary, six blocks of width 256."""
    return GPTConfig(vocab=16384, seq_len=64, dim=256, heads=4, n_layers=6)


def uneven_lm_workload(microbatches: int, rows: int) -> Workload:
    """The uneven LM with a batch of ``microbatches · rows`` sequences."""
    config = uneven_lm_config()
    corpus = MarkovCorpus(config.vocab, config.seq_len, seed=1)

    def layers() -> list[nn.Module]:
        torch.manual_seed(0)
        return gpt_layers(config)

    label = f"LM vocab {config.vocab}, {config.n_layers}×block d={config.dim} seq={config.seq_len}"
    return Workload(label, layers, lm_loss, corpus.batch(microbatches * rows))


def plan_benchmark(
    ranks: Sequence[int] = (2, 4),
    microbatches: int = 8,
    rows: int = 2,
    mlp_rows: int = 32,
    rounds: int = 5,
    steps_per_round: int = 2,
    warmup: int = 2,
) -> list[Table]:
    """``schedule="auto"`` against zb-v on the even split and torch's ZBV on the uneven LM, per rank count;
    and against our hand-picked schedules on the balanced MLP of ``bench pipelines`` (2 ranks).

    Every configuration runs in the same spawned ranks, in rotating rounds; the tables give medians,
    ratios to auto, and each configuration's step time predicted by the simulator from auto's profile.
    """
    tables = []
    for count in ranks:
        lm = launch(
            _plan_rank, count, ("lm", microbatches, rows, rounds, steps_per_round, warmup), threads=1
        )[0]
        tables.append(_plan_table(uneven_lm_workload(microbatches, rows).name, count, microbatches, rows, lm))
    mlp = launch(_plan_rank, 2, ("mlp", microbatches, mlp_rows, rounds, steps_per_round, warmup), threads=1)[
        0
    ]
    tables.append(_plan_table(workload("mlp", microbatches, mlp_rows).name, 2, microbatches, mlp_rows, mlp))
    return tables


def _plan_rank(model: str, m: int, rows: int, rounds: int, steps: int, warmup: int) -> dict[str, Any]:
    from .schedule.plan import stage_costs

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
    )
    pipes = {f"auto ({auto.schedule.name}, cuts {list(auto.plan.partition)})": auto}
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
    runners = {label: _our_step(pipe, load.batch) for label, pipe in pipes.items()}
    if model == "lm":
        runners["torch ScheduleZBVZeroBubble, even split"] = _torch_runner(
            "ScheduleZBVZeroBubble", model, load, m
        )
    times = _interleaved(runners, rounds, steps, warmup)
    predicted = {}
    for label, pipe in pipes.items():
        bounds = pipe.layer_bounds
        costs = stage_costs(
            auto.profile, bounds[1:-1], len(bounds) - 1, fused=not pipe.schedule.splits_backward
        )
        predicted[label] = simulate(pipe.schedule, costs).makespan
    return {"times": times, "predicted": predicted, "reason": auto.plan.reason}


def _plan_table(label: str, ranks: int, m: int, rows: int, result: dict[str, Any]) -> Table:
    times, predicted = result["times"], result["predicted"]
    auto = next(name for name in times if name.startswith("auto"))
    reference = _median(times[auto])
    table = Table(
        f"{label}: step time on {ranks} CPU ranks, {m} microbatches of {rows} "
        f"{'sequences' if 'LM' in label else 'rows'}",
        ["configuration", "median step (ms)", "× auto", "predicted (ms)", "measured / predicted", "steps"],
    )
    for name, values in times.items():
        median = _median(values)
        guess = predicted.get(name)
        table.rows.append(
            [
                name,
                f"{median * 1e3:.1f}",
                f"{median / reference:.3f}",
                f"{guess * 1e3:.1f}" if guess else "—",
                f"{median / guess:.3f}" if guess else "—",
                str(len(values)),
            ]
        )
    table.notes.append(
        f"auto chose: {result['reason']}. Predicted = the simulator's makespan for that configuration's "
        "schedule and partition under auto's per-layer profile (every rank profiling at once before the "
        "run, median over ranks). "
        "Step = barrier to barrier, backward and zero_grad included, no optimizer; configurations "
        "measured in rotating rounds."
    )
    return table
