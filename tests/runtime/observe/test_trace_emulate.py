"""Recorded timelines and emulated compute of the real runtime.

One 2-rank spawn records real steps (trace=True) and writes the trace files; one 4-rank spawn runs
zb-h1 and 1f1b with emulated millisecond costs.  Each test reads its part of the shared result.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
import torch.nn.functional as F
from _dist import rich_batch, rich_layers, run_ranks, token_loss
from torch import nn

from zerobubble.runtime.construct.staging import default_costs
from zerobubble.runtime.execute.emulate import wait_until
from zerobubble.runtime.observe.trace import build_timeline, measured_costs
from zerobubble.schedule import CostModel, Kind, build_schedule, dependencies, simulate

EMULATED = CostModel(f=10.0, b=10.0, w=6.0)  # milliseconds per rank-stage
EMULATED_M = 4


def _record_worker(directory: str) -> dict:
    """Two ranks: record 3 real steps of zb-v and 1f1b; rank 0 returns the timelines and the files."""
    from zerobubble import Pipeline
    from zerobubble.runtime.launch import init_distributed

    init_distributed(backend="gloo", timeout=60)
    inputs, targets = rich_batch(8, seed=0)
    out = {}
    for name in ("zb-v", "1f1b"):
        pipe = Pipeline(
            rich_layers(0), schedule=name, microbatches=4, loss_fn=token_loss, timeout=60, trace=True
        )
        for _ in range(3):
            pipe.step(inputs, targets)
        timelines = pipe.measured_timelines()
        report = pipe.write_trace(os.path.join(directory, name))
        if timelines is not None:
            out[name] = {
                "programs": [[str(op) for op in program] for program in pipe.schedule.programs],
                "timelines": [(t.start, t.end, t.issued) for t in timelines],
                "report": report,
            }
    return out


def _emulate_worker(m: int) -> dict:
    """Four ranks: 3 emulated steps of zb-h1 and 1f1b each; rank 0 returns the measured timelines."""
    from zerobubble import Pipeline
    from zerobubble.runtime.launch import init_distributed

    init_distributed(backend="gloo", timeout=60)
    generator = torch.Generator().manual_seed(0)
    inputs, targets = torch.randn(4 * m, 8, generator=generator), torch.randn(4 * m, 8, generator=generator)
    out = {}
    for name in ("zb-h1", "1f1b"):
        pipe = Pipeline(
            [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)],  # negligible compute
            schedule=name,
            microbatches=m,
            loss_fn=F.mse_loss,
            timeout=60,
            trace=True,
            emulate=EMULATED,
        )
        for _ in range(3):
            pipe.step(inputs, targets)
        timelines = pipe.measured_timelines()
        if timelines is not None:
            out[name] = [(t.start, t.end, t.clock_error) for t in timelines[1:]]
    return out


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("traces"))


@pytest.fixture(scope="module")
def recorded(trace_dir) -> dict:
    """Rank 0's result of :func:`_record_worker` (its trace files are in ``trace_dir``)."""
    return run_ranks(_record_worker, 2, trace_dir)[0]


@pytest.fixture(scope="module")
def emulated() -> dict:
    """Rank 0's result of :func:`_emulate_worker`."""
    return run_ranks(_emulate_worker, 4, EMULATED_M)[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["zb-v", "1f1b"])
def test_recorded_timeline_has_every_op_once_in_program_order(recorded, name):
    result = recorded[name]
    expected = [
        [str(op) for op in program] for program in build_schedule(name, 2, 4, costs=default_costs()).programs
    ]
    assert result["programs"] == expected
    assert len(result["timelines"]) == 3, "three recorded steps"
    for start, end, issued in result["timelines"]:
        for rank, program in enumerate(expected):
            assert len(start[rank]) == len(end[rank]) == len(program), "every op exactly once"
            for i in range(len(program)):
                assert issued[rank][i] <= start[rank][i] <= end[rank][i]
                if i:
                    assert end[rank][i - 1] <= issued[rank][i], (
                        f"rank {rank} ran op {i} before op {i - 1} ended"
                    )


@pytest.mark.multiprocess
def test_write_trace_files_and_chrome_events(recorded, trace_dir):
    report = recorded["zb-v"]["report"]
    names = sorted(os.path.basename(path) for path in report.files)
    assert names == ["predicted.json", "summary.json", "timeline.png", "trace.json"]
    assert 0.0 <= report.measured_bubble_rate < 1.0 and 0.0 <= report.predicted_bubble_rate < 1.0
    with open(os.path.join(trace_dir, "zb-v", "trace.json")) as handle:
        trace = json.load(handle)
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    ops = [e for e in complete if e.get("cat") not in ("wait", "runtime", "comm")]
    assert len(ops) == sum(len(p) for p in build_schedule("zb-v", 2, 4, costs=default_costs()).programs)
    for event in complete:
        assert {"ph", "ts", "dur", "pid", "tid", "name"} <= set(event)
        assert event["dur"] >= 0 and event["ts"] >= 0
    assert any(e.get("cat") == "wait" for e in complete), "transfer waits are in the trace"
    lanes = {e["tid"] for e in complete if e.get("cat") == "comm" and e["name"].startswith("issue send")}
    assert lanes == {2, 3}, "each rank's sends are in its comm lane"
    settles = [e["tid"] for e in complete if e.get("cat") == "runtime" and e["name"] == "optimizer settle"]
    assert sorted(settles) == [0, 1], "each rank's optimizer settle is in the trace"
    assert os.path.getsize(os.path.join(trace_dir, "zb-v", "timeline.png")) > 1000


@pytest.mark.multiprocess
def test_replanning_from_a_trace_of_times_says_memory_was_not_recorded(recorded, trace_dir, capsys):
    # a named schedule records no layer profile: the re-plan has times and no bytes, and says so
    from zerobubble.cli import main

    assert main(["plan", "--trace", os.path.join(trace_dir, "zb-v"), "--ranks", "2"]) == 0
    out = capsys.readouterr().out
    assert "peak memory not recorded" in out and " 0 B" not in out and "n/a" not in out
    for name in ("zb-1p", "zb-2p", "zb-v"):  # relative memory limits still build
        assert f"  {name} " in out or f"* {name} " in out


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["zb-h1", "1f1b"])
def test_emulated_run_follows_schedule_and_prediction(name, emulated):
    schedule = build_schedule(name, 4, EMULATED_M)
    predicted = simulate(schedule, EMULATED).iteration_time / 1e3
    steps = emulated[name]
    assert steps, "recorded steps came back"
    for start, end, clock_error in steps:
        ends = {}
        for rank, program in enumerate(schedule.programs):
            for op, a, _ in zip(program, start[rank], end[rank]):
                role = Kind.B if op.kind in (Kind.B, Kind.BW) else op.kind
                # the earliest moment its outputs could leave (the recorded end also covers posting the send)
                ends[(role, op.stage, op.microbatch)] = (a + EMULATED_DURATION[op.kind] / 1e3, rank)
        slack = 2 * max(clock_error) + 1e-3
        for rank, program in enumerate(schedule.programs):
            for op, a, b in zip(program, start[rank], end[rank]):
                assert b - a >= EMULATED_DURATION[op.kind] * 0.99 / 1e3, (
                    f"{op} shorter than its emulated cost"
                )
                for dependency in dependencies(op, schedule.num_stages):
                    before, where = ends[dependency]
                    if where != rank:
                        assert a >= before - slack, (
                            f"{op} on rank {rank} started before its input {dependency}"
                        )
        measured = max(e[-1] - s[0] for s, e in zip(start, end))
        assert 0.9 * predicted <= measured <= 1.5 * predicted, (measured, predicted)


EMULATED_DURATION = {Kind.F: 10.0, Kind.B: 10.0, Kind.W: 6.0, Kind.BW: 16.0}


def test_wait_until_is_not_early():
    deadline = time.perf_counter() + 0.003
    wait_until(deadline)
    assert time.perf_counter() >= deadline


def test_measured_costs_and_ready_times_from_a_synthetic_trace():
    schedule = build_schedule("1f1b", 2, 2)
    durations = {Kind.F: 1.0, Kind.BW: 3.0}
    simulated = simulate(schedule, CostModel(f=1.0, b=3.0, w=0.0))
    per_rank = []
    for rank in range(len(schedule.programs)):
        # each op issued up to 0.5 before its simulated start, waiting for its input until that start
        ends = (-1.0, *simulated.end[rank][:-1])
        issued = [max(a - 0.5, previous) for a, previous in zip(simulated.start[rank], ends)]
        ops = list(zip(issued, simulated.end[rank]))
        waits = [((0, 0, i), t, a) for i, (t, a) in enumerate(zip(issued, simulated.start[rank])) if a > t]
        per_rank.append((ops, waits))
    timeline = build_timeline(schedule, per_rank)
    assert timeline.start == simulated.start and timeline.iteration_time == simulated.iteration_time
    costs = measured_costs([timeline])
    assert (
        costs.f == (durations[Kind.F],) * 2 and costs.b == (durations[Kind.BW],) * 2 and costs.w == (0.0, 0.0)
    )
    assert abs(timeline.bubble_rate - simulated.bubble_rate) < 1e-12
