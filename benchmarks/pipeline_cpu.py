"""Where a pipeline rank's time goes: thread CPU per op kind against half the single-process step, and
the step's wall time against the schedule simulated on the run's own op times.

    python benchmarks/pipeline_cpu.py [--schedule zb-v] [--rows 128] [--steps 6]

Issue 47's setup (8 × Linear(1024)+ReLU, 8 microbatches, 2 gloo ranks, one thread each).  A recorder
reads two clocks at each op's ends: ``time.thread_time`` sums each rank's F, B and W ops (the rest of
the step's thread CPU is the loop, hooks and transfers outside ops; the process's other threads,
gloo's loops, are reported apart), ``time.perf_counter`` gives each op's wall duration.  Then rank 0
times the single-process step alone (the other rank idles in a barrier).  CPU time does not count
the time a rank is descheduled, so on a loaded machine these numbers are far steadier than step
times; they do count the slowdown of two ranks sharing caches and memory.

The second table separates the runtime from the machine: ``simulate`` replays the pipeline's own
schedule with each stage's median F, B and W wall times of the recorded steps (two ranks computing
at once, as they ran) and a transfer time of 0 and 0.3 ms; the median step's wall time over that
makespan is what the executor, its transfers and the ops' spread around their medians add.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch.distributed as dist
from torch import nn

from zerobubble import Pipeline
from zerobubble.runtime.launch import init_distributed, launch
from zerobubble.schedule import CostModel, simulate
from zerobubble_bench.workloads import bench_partition, workload


class ThreadCpuRecorder:
    """Sums the thread CPU time of ops by kind, of transfer waits and of runtime events, and keeps each
    op's wall duration.  Its clock is the wall clock; the thread CPU time read with it is looked up by
    the wall time returned."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.walls: dict[tuple[str, int], list[float]] = defaultdict(list)  # (kind, stage) -> seconds
        self.event_walls: dict[str, list[float]] = defaultdict(list)  # action -> seconds
        self.on = False
        self._cpu: dict[float, float] = {}

    def clock(self) -> float:
        wall = time.perf_counter()
        self._cpu[wall] = time.thread_time()
        return wall

    def _cpu_between(self, start: float, end: float) -> float:
        return self._cpu.pop(end) - self._cpu.pop(start)

    def begin_step(self) -> None:
        self._cpu.clear()

    def op(self, op, start: float, end: float) -> None:
        cpu = self._cpu_between(start, end)
        if self.on:
            self.sums[op.kind.name] += cpu
            self.walls[op.kind.name, op.stage].append(end - start)

    def wait(self, key, start: float, end: float) -> None:
        cpu = self._cpu_between(start, end)
        if self.on:
            self.sums["waits"] += cpu

    def event(self, name: str, start: float, end: float) -> None:
        cpu = self._cpu_between(start, end)
        if self.on:
            self.sums["hooks"] += cpu
            action = " ".join(name.split()[:2])  # "issue send", "wait recv", "optimizer settle", ...
            self.event_walls[action].append(end - start)


def _rank(schedule: str, rows: int, steps: int) -> dict[str, float]:
    init_distributed(backend="gloo", timeout=300)
    load = workload("mlp", 8, rows)
    chunks = 4 if schedule == "zb-v" else 2
    pipe = Pipeline(
        load.make_layers(),
        schedule=schedule,
        microbatches=8,
        loss_fn=load.loss_fn,
        partition=bench_partition("mlp", 8, chunks),
        timeout=300,
    )
    recorder = ThreadCpuRecorder()
    pipe.recorder = recorder
    thread = process = 0.0
    walls = []
    for index in range(steps + 2):
        recorder.on = index >= 2
        dist.barrier()
        started, started_process, started_wall = time.thread_time(), time.process_time(), time.perf_counter()
        pipe.step(*load.batch)
        pipe.zero_grad()
        if recorder.on:
            walls.append(time.perf_counter() - started_wall)
            thread += time.thread_time() - started
            process += time.process_time() - started_process
    result = {kind: total / steps * 1e3 for kind, total in recorder.sums.items()}
    result["step"] = thread / steps * 1e3
    result["outside ops"] = result["step"] - sum(result.get(k, 0.0) for k in ("F", "B", "W", "BW", "hooks"))
    result["other threads"] = (process - thread) / steps * 1e3
    result["wall"] = statistics.median(walls) * 1e3
    result["op walls"] = dict(recorder.walls)
    result["event walls"] = {
        action: (len(values) / steps, statistics.median(values) * 1e3, sum(values) / steps * 1e3)
        for action, values in recorder.event_walls.items()
    }
    result["schedule"] = pipe.schedule
    if dist.get_rank() == 0:
        result["single/2"] = _single_step_cpu(load) / 2 * 1e3
    dist.barrier()
    return result


def _single_step_cpu(load) -> float:
    model = nn.Sequential(*load.make_layers())
    inputs, targets = (t.chunk(8) for t in load.batch)
    times = []
    for _ in range(6):
        started = time.thread_time()
        for x, y in zip(inputs, targets):
            (load.loss_fn(model(x), y) / 8).backward()
        model.zero_grad(set_to_none=True)
        times.append(time.thread_time() - started)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="zb-v")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    results = launch(_rank, 2, (args.schedule, args.rows, args.steps), threads=1)
    half = results[0]["single/2"]
    print(f"{args.schedule}, 8 microbatches of {args.rows} rows: thread CPU per step (ms)")
    print("| rank | F | B | W | outside ops | step | × single/2 | other threads |")
    print("|---|---|---|---|---|---|---|---|")
    for rank, row in enumerate(results):
        cells = [row.get(k, 0.0) for k in ("F", "B", "W", "outside ops", "step")]
        print(
            f"| {rank} | "
            + " | ".join(f"{c:.1f}" for c in cells)
            + f" | {row['step'] / half:.3f} | {row['other threads']:.1f} |"
        )
    print(f"single process, alone: {2 * half:.1f} ms a step (half: {half:.1f})")
    print()
    _print_simulated(results)
    print()
    print("| rank | action | a step | median (ms) | wall a step (ms) |")
    print("|---|---|---|---|---|")
    for rank, row in enumerate(results):
        for action, (count, median, total) in sorted(row["event walls"].items()):
            print(f"| {rank} | {action} | {count:.0f} | {median:.3f} | {total:.1f} |")


def _print_simulated(results: list[dict]) -> None:
    """The median step's wall time against the schedule simulated with the run's median op times."""
    walls: dict[tuple[str, int], list[float]] = defaultdict(list)
    for row in results:
        for key, values in row["op walls"].items():
            walls[key] += values
    schedule = results[0]["schedule"]
    stages = schedule.placement.num_stages

    def per_stage(kind: str) -> tuple[float, ...]:
        return tuple(
            statistics.median(walls[kind, s]) * 1e3 if walls[kind, s] else 0.0 for s in range(stages)
        )

    costs = {kind: per_stage(kind) for kind in ("F", "B", "W")}
    if any(kind == "BW" for kind, _ in walls):  # a fused backward: simulate charges it b + w
        costs["B"], costs["W"] = per_stage("BW"), (0.0,) * stages
    print(
        "median op wall time per stage (ms): "
        + ", ".join(f"{kind} {'/'.join(f'{t:.2f}' for t in times)}" for kind, times in costs.items())
    )
    step = max(row["wall"] for row in results)
    print("| transfer (ms) | simulated makespan (ms) | median step (ms) | step / simulated |")
    print("|---|---|---|---|")
    for comm in (0.0, 0.3):
        makespan = simulate(schedule, CostModel(f=costs["F"], b=costs["B"], w=costs["W"], comm=comm)).makespan
        print(f"| {comm:.1f} | {makespan:.1f} | {step:.1f} | {step / makespan:.3f} |")


if __name__ == "__main__":
    main()
