"""The executor loop's own cost per op, without communication: one rank, zb-v's two chunks.

    python benchmarks/executor_loop.py                       # this tree
    python benchmarks/executor_loop.py --against OLD/src     # side by side with another source tree

Four loops over the same 4·m-op program (m = 64), with the optimizer-settle hook in place:
``no-op`` (handlers that do nothing: the loop itself), ``compute`` (the real handlers on a
4-wide Linear per chunk, local hand-overs keyed by message), ``recorded`` (the real handlers
with a recorder timing every op) and ``profiled`` (the real handlers while ``torch.profiler``
records CPU events: the ``zerobubble/`` ranges, where the tree has them, and torch's own events).
Prints the median microseconds per op of ``--repeats`` runs.  With ``--against`` the trees
alternate, run by run, in fresh processes; the ratio of the medians is printed, then the median
and range of the per-round ratios (each round's two runs are neighbours in time: on a loaded
machine that range is the noise).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MICROBATCHES = 64


def measure(repeats: int) -> dict[str, float]:
    """Median µs per op of each loop in this process's zerobubble."""
    import contextlib

    import torch
    from torch import nn

    from zerobubble.runtime.execute.executor import Executor, StageState
    from zerobubble.runtime.failures import PeerMonitor
    from zerobubble.runtime.wgrad import WeightGradStore
    from zerobubble.schedule import Kind, build_schedule

    torch.set_num_threads(1)

    class LocalComm:
        device = torch.device("cpu")
        monitor = PeerMonitor(None, 0, 1.0)

        def start_step(self, first, forward_only=False):
            pass

        def finish_step(self):
            pass

        def abort_step(self):
            pass

    class Recorder:
        clock = staticmethod(time.perf_counter)

        def begin_step(self):
            pass

        def op(self, op, start, end):
            pass

        def wait(self, key, start, end):
            pass

        def event(self, name, start, end):
            pass

    schedule = build_schedule("zb-v", 1, MICROBATCHES)
    stages = {
        s: StageState(s, nn.Linear(4, 4), WeightGradStore(), s == 0, s == 1, f"chunk {s}") for s in (0, 1)
    }
    executor = Executor(schedule, 0, stages, LocalComm(), lambda out, y: out.square().mean())
    if hasattr(executor, "follow"):  # the tree whose executor runs the lowered program (here: the ops)
        from zerobubble.schedule.lowering import lower

        executor.follow(lower(schedule).program_of(0))
    program = schedule.programs[0]
    settle_at = next(i for i, op in enumerate(program) if op.kind is Kind.F)
    if hasattr(executor, "add_hook"):  # the executor owns its hooks
        from zerobubble.runtime.execute.executor import Hook

        executor.add_hook(settle_at, Hook("optimizer settle", lambda: None))
    else:  # the Pipeline wrapped a handler (the tree before the hooks moved into the executor)
        from zerobubble.runtime.parallel.data_parallel import hook_program

        executor.program = hook_program(executor.program, {settle_at: lambda: None}, {})
    inputs = [(torch.ones(1, 4),)] * MICROBATCHES
    targets = [None] * MICROBATCHES
    compiled = executor.program

    def noop(state, j):
        pass

    idle = [(entry[0], noop, entry[2], entry[3]) for entry in compiled]
    results = {}

    def profiler():
        return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    for name, program_entries, recorder, context in (
        ("no-op", idle, None, contextlib.nullcontext),
        ("compute", compiled, None, contextlib.nullcontext),
        ("recorded", compiled, Recorder(), contextlib.nullcontext),
        ("profiled", compiled, None, profiler),
    ):
        executor.program = program_entries
        executor.recorder = recorder
        if hasattr(executor.comm, "recorder"):
            executor.comm.recorder = recorder
        loops = 200 if name == "no-op" else 5
        executor.run_step(inputs, targets)  # warm-up: allocations, autograd's first graph
        times = []
        for _ in range(repeats):
            with context():  # the profiler's start and its processing at the end are not timed
                started = time.perf_counter()
                for _ in range(loops):
                    executor.run_step(inputs, targets)
                    for state in stages.values():
                        state.module.zero_grad(set_to_none=True)
                times.append((time.perf_counter() - started) / loops / len(program) * 1e6)
        results[name] = statistics.median(times)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--against", help="another tree's src/ directory, measured alternately")
    parser.add_argument("--rounds", type=int, default=5, help="fresh processes per tree")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.repeats)))
        return
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    trees = {"this tree": os.path.abspath(here)}
    if args.against:
        trees["against"] = os.path.abspath(args.against)
    runs: dict[str, list[dict[str, float]]] = {tree: [] for tree in trees}
    for _ in range(args.rounds):
        for tree, path in trees.items():
            env = {**os.environ, "PYTHONPATH": path}
            command = [sys.executable, __file__, "--child", "--repeats", str(args.repeats)]
            output = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
            runs[tree].append(json.loads(output.strip().splitlines()[-1]))
    loops = ["no-op", "compute", "recorded", "profiled"]
    print("| tree | " + " | ".join(f"{loop} (µs/op)" for loop in loops) + " |")
    print("|---|" + "---|" * len(loops))
    medians = {
        tree: {loop: statistics.median(r[loop] for r in results) for loop in loops}
        for tree, results in runs.items()
    }
    for tree, values in medians.items():
        print(f"| {tree} | " + " | ".join(f"{values[loop]:.3f}" for loop in loops) + " |")
    if args.against:
        ratios = [medians["this tree"][loop] / medians["against"][loop] for loop in loops]
        print("| ratio | " + " | ".join(f"{ratio:.3f}" for ratio in ratios) + " |")
        # each round's two runs are neighbours in time: their ratio's spread over the rounds is the noise
        paired = {
            loop: sorted(a[loop] / b[loop] for a, b in zip(runs["this tree"], runs["against"]))
            for loop in loops
        }
        print(
            "| paired ratio (median, min–max) | "
            + " | ".join(
                f"{statistics.median(values):.3f} ({values[0]:.2f}–{values[-1]:.2f})"
                for values in paired.values()
            )
            + " |"
        )


if __name__ == "__main__":
    main()
