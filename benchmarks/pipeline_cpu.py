"""Where a pipeline rank's CPU goes: thread CPU time per op kind, against half the single-process step.

    python benchmarks/pipeline_cpu.py [--schedule zb-v] [--rows 128] [--steps 6]

Issue 47's setup (8 × Linear(1024)+ReLU, 8 microbatches, 2 gloo ranks, one thread each).  A recorder
whose clock is ``time.thread_time`` sums each rank's F, B and W ops; the rest of the step's thread
CPU is the loop, hooks and transfers outside ops.  The process's other threads (gloo's loops) are
reported apart.  Then rank 0 times the single-process step alone (the other rank idles in a barrier).
CPU time does not count the time a rank is descheduled, so on a loaded machine these numbers are far
steadier than step times; they do count the slowdown of two ranks sharing caches and memory.
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
from zerobubble_bench.workloads import bench_partition, workload


class ThreadCpuRecorder:
    """Sums the thread CPU time of ops by kind, of transfer waits and of runtime events."""

    clock = staticmethod(time.thread_time)

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.on = False

    def begin_step(self) -> None:
        """Nothing to prepare."""

    def op(self, op, start: float, end: float) -> None:
        if self.on:
            self.sums[op.kind.name] += end - start

    def wait(self, key, start: float, end: float) -> None:
        if self.on:
            self.sums["waits"] += end - start

    def event(self, name: str, start: float, end: float) -> None:
        if self.on:
            self.sums["hooks"] += end - start


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
    for index in range(steps + 2):
        recorder.on = index >= 2
        dist.barrier()
        started, started_process = time.thread_time(), time.process_time()
        pipe.step(*load.batch)
        pipe.zero_grad()
        if recorder.on:
            thread += time.thread_time() - started
            process += time.process_time() - started_process
    result = {kind: total / steps * 1e3 for kind, total in recorder.sums.items()}
    result["step"] = thread / steps * 1e3
    result["outside ops"] = result["step"] - sum(result.get(k, 0.0) for k in ("F", "B", "W", "BW", "hooks"))
    result["other threads"] = (process - thread) / steps * 1e3
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


if __name__ == "__main__":
    main()
