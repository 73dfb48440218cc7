"""A Pipeline lowers its schedule at construction, validates it, and its executor runs that program.

Two gloo ranks as two data-parallel replicas of a one-rank zb-v pipeline (two chunks: two all-reduces):
``pipe.lowered`` is the validated lowering, the executor's entries are the rank's lowered actions minus
the filtered ones, a recorded step's trace draws the all-reduces in a ``rank 0 comm`` lane; and a
lowering whose replicas issue their all-reduces in different orders (monkeypatched) raises the same
clear PipelineError on both ranks before anything runs.

Two gloo ranks as a two-rank zb-v pipeline (a V: each rank hands stages over locally too): the
executor's entries are the compute ops and every send's and receive's issue and wait, as lowered;
the trace draws them in each rank's comm lane; and a lowering whose receives on a channel are out of
the sender's order (monkeypatched) raises on both ranks before the first step.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from _dist import rich_batch, rich_layers, run_ranks, token_loss

from zerobubble.runtime import PipelineError
from zerobubble.runtime.construct import lowering
from zerobubble.runtime.execute.program import CommAction
from zerobubble.runtime.launch import init_distributed
from zerobubble.runtime.observe.trace import build_timeline, measured_chrome_trace
from zerobubble.schedule.channels import sending_stage
from zerobubble.schedule.lowering import CommKind, Compute, Issue, Wait


def _pipeline():
    from zerobubble import Pipeline

    return Pipeline(
        rich_layers(seed=0), schedule="zb-v", microbatches=4, loss_fn=token_loss, data_parallel=2, trace=True
    )


def _swapped_lower(*args, **kwargs):
    """The real lowering, but replica 1 issues its two all-reduces in the other order."""
    lowered = lowering_lower(*args, **kwargs)
    program = list(lowered.programs[0])
    at = [i for i, a in enumerate(program) if isinstance(a, Issue) and a.comm.kind is CommKind.ALL_REDUCE]
    program[at[0]], program[at[1]] = program[at[1]], program[at[0]]
    return dataclasses.replace(lowered, replica_programs={(1, 0): tuple(program)})


lowering_lower = lowering.lower


def _executor_entries(pipe) -> list[str]:
    """The executor's compute ops and communication actions, by name (the start entries, e.g. the
    settle, aside)."""
    entries = [e[0] for e in pipe._executor.program if e[2] is not None or isinstance(e[0], CommAction)]
    return [e.name if isinstance(e, CommAction) else str(e) for e in entries]


def _refusal(build, patched_lower) -> str:
    """What building a Pipeline with ``build()`` raises while ``lowering.lower`` is ``patched_lower``."""
    lowering.lower = patched_lower
    try:
        build()
        return "no error"
    except PipelineError as error:
        return str(error)
    finally:
        lowering.lower = lowering_lower


def worker() -> dict:
    torch.set_num_threads(1)
    init_distributed(backend="gloo", timeout=60)
    torch.manual_seed(0)
    pipe = _pipeline()
    inputs, targets = rich_batch(8, seed=1)
    for _ in range(2):
        pipe.step(inputs, targets)
    program = pipe.lowered.program_of(pipe.rank, pipe.layout.grid.dp_index)
    expected = [
        str(a.op) if isinstance(a, Compute) else str(a)
        for a in program
        if (isinstance(a, Compute) and a.first)
        or (isinstance(a, (Issue, Wait)) and a.comm.kind is CommKind.ALL_REDUCE)
    ]
    got = _executor_entries(pipe)
    steps = pipe.recorder.seconds()
    timeline = build_timeline(pipe.schedule, [steps[-1]])
    trace = json.loads(measured_chrome_trace(timeline))
    refused = _refusal(_pipeline, _swapped_lower)
    return {
        "same": got == expected,
        "got": got,
        "expected": expected,
        "lanes": sorted({e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}),
        "comm": sorted({e["name"] for e in trace["traceEvents"] if e.get("cat") == "comm"}),
        "refused": refused,
    }


@pytest.fixture(scope="module")
def outcomes() -> list[dict]:
    return run_ranks(worker, 2)


@pytest.mark.multiprocess
def test_the_executor_runs_the_lowered_program_of_its_rank(outcomes):
    for r in outcomes:
        assert r["same"], (r["got"], r["expected"])
        assert sum(name.startswith("issue all_reduce") for name in r["got"]) == 2


@pytest.mark.multiprocess
def test_the_trace_draws_the_communication_in_a_lane_of_its_own(outcomes):
    for r in outcomes:
        assert "rank 0 comm" in r["lanes"], r["lanes"]
        assert {name.split("(")[0] for name in r["comm"]} == {"issue all_reduce", "wait all_reduce"}


@pytest.mark.multiprocess
def test_a_lowering_whose_replicas_disagree_is_refused_on_every_rank_before_anything_runs(outcomes):
    for r in outcomes:
        assert "failed its check before the first step" in r["refused"], r["refused"]
        assert "all_reduce" in r["refused"] and "order" in r["refused"], r["refused"]


# -- two pipeline ranks: the sends and receives are entries of the program ---------------------------


def _pipeline_of_two():
    from zerobubble import Pipeline

    return Pipeline(rich_layers(seed=0), schedule="zb-v", microbatches=4, loss_fn=token_loss, trace=True)


def _receives_swapped(*args, **kwargs):
    """The real lowering, but rank 1 posts its first two receives from rank 0 in the other order."""
    lowered = lowering_lower(*args, **kwargs)
    source = lowered.source
    program = list(lowered.programs[1])
    at = [
        i
        for i, a in enumerate(program)
        if isinstance(a, Issue)
        and a.comm.kind is CommKind.RECV
        and source.placement.rank_of(sending_stage(a.comm.message)) == 0
    ]
    program[at[0]], program[at[1]] = program[at[1]], program[at[0]]
    return dataclasses.replace(lowered, programs=(lowered.programs[0], tuple(program)))


def transfers_worker() -> dict:
    torch.set_num_threads(1)
    init_distributed(backend="gloo", timeout=60)
    torch.manual_seed(0)
    pipe = _pipeline_of_two()
    inputs, targets = rich_batch(8, seed=1)
    losses = [pipe.step(inputs, targets) for _ in range(2)]  # shape headers, then posted where lowered
    transfers = (CommKind.SEND, CommKind.RECV)
    expected = [
        str(a.op) if isinstance(a, Compute) else str(a)
        for a in pipe.lowered.program_of(pipe.rank)
        if isinstance(a, Compute) or (isinstance(a, (Issue, Wait)) and a.comm.kind in transfers)
    ]
    got = _executor_entries(pipe)
    timelines = pipe.measured_timelines()  # collective: every rank's, on rank 0
    lanes: dict[int, set[str]] = {}
    if timelines is not None:
        for e in json.loads(measured_chrome_trace(timelines[-1]))["traceEvents"]:
            if e.get("cat") == "comm":
                lanes.setdefault(e["tid"] - 2, set()).add(e["name"].split("(")[0])
    refused = _refusal(_pipeline_of_two, _receives_swapped)
    return {
        "got": got,
        "expected": expected,
        "losses": [float(loss) for loss in losses if loss is not None],  # on the last stage's rank
        "comm": {rank: sorted(names) for rank, names in lanes.items()},  # per rank's lane, on rank 0
        "refused": refused,
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(transfers_worker, 2)


@pytest.mark.multiprocess
def test_the_sends_and_receives_are_entries_of_the_program_as_lowered(two_ranks):
    for r in two_ranks:
        assert r["got"] == r["expected"]
        assert any(name.startswith("issue send") for name in r["got"])
        assert any(name.startswith("wait recv") for name in r["got"])
    losses = two_ranks[0]["losses"] + two_ranks[1]["losses"]
    assert len(losses) == 2 and all(loss > 0 for loss in losses)


@pytest.mark.multiprocess
def test_the_trace_draws_the_transfers_in_the_comm_lane(two_ranks):
    lanes = two_ranks[0]["comm"]
    assert sorted(lanes) == [0, 1], lanes
    for names in lanes.values():
        assert {"issue send", "wait send", "issue recv", "wait recv"} <= set(names), lanes


@pytest.mark.multiprocess
def test_a_lowering_with_receives_out_of_order_is_refused_on_every_rank_before_the_first_step(two_ranks):
    for r in two_ranks:
        assert "failed its check before the first step" in r["refused"], r["refused"]
        assert "recv" in r["refused"] or "receive" in r["refused"], r["refused"]
