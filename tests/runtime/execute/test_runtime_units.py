"""The runtime's pure helpers and the executor's hooks, without spawning ranks.

Each of these is reached in training only through spawned ranks, where a bug shows as a timeout;
here each is checked directly: shape headers, partition bounds, batch splitting, the gradient
averager's plan, memory-limit parsing, transfer latencies, the trace writer and the hooks.
"""

from __future__ import annotations

import json
import re
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist
from _dist import LocalComm
from torch import nn

from zerobubble.runtime import PipelineError
from zerobubble.runtime import executor as executor_module
from zerobubble.runtime.construct.staging import partition_bounds as _partition_bounds
from zerobubble.runtime.construct.staging import split_batch as _split
from zerobubble.runtime.execute.comm import HEADER_LENGTH, decode_header, encode_header
from zerobubble.runtime.execute.executor import Executor, Hook, StageState
from zerobubble.runtime.failures import PeerFailure, PeerMonitor
from zerobubble.runtime.observe.recorder import Recorder, RecorderDefaults, as_recorder
from zerobubble.runtime.observe.trace import (
    build_timeline,
    measured_chrome_trace,
    transfer_latencies,
    write_trace,
)
from zerobubble.runtime.parallel.data_parallel import bucket_parameters, first_forward, last_gradient_ops
from zerobubble.runtime.wgrad import WeightGradStore
from zerobubble.schedule import CostModel, Kind, ScheduleError, build_schedule, parse_memory_limit, simulate
from zerobubble.schedule.channels import MessageKey
from zerobubble.schedule.partition import even_partition

# -- shape headers ------------------------------------------------------------------------------------


def test_header_round_trip_keeps_shapes_and_dtypes():
    tensors = [
        torch.zeros(2, 3),
        torch.zeros((), dtype=torch.int64),
        torch.zeros(1, 2, 3, 4, dtype=torch.bfloat16),
    ]
    header = encode_header(tensors)
    assert len(header) == HEADER_LENGTH and header[0] == 3
    assert decode_header(header) == [
        ((2, 3), torch.float32),
        ((), torch.int64),
        ((1, 2, 3, 4), torch.bfloat16),
    ]
    assert decode_header(encode_header([])) == []


def test_header_refuses_what_it_cannot_describe():
    with pytest.raises(PipelineError, match="dtype"):
        encode_header([torch.zeros(2, dtype=torch.complex64)])
    with pytest.raises(PipelineError, match="at most 64 fit"):
        encode_header([torch.zeros(1, 1, 1, 1)] * 11)  # 1 + 11·6 = 67 entries


# -- partition bounds and batch splitting -------------------------------------------------------------


def test_even_partition_gives_the_first_chunks_the_extra_layers():
    assert even_partition(10, 4) == [3, 6, 8]
    assert even_partition(4, 4) == [1, 2, 3]
    assert even_partition(5, 1) == []


def test_partition_bounds_default_and_given():
    assert _partition_bounds(10, 4, None) == [0, 3, 6, 8, 10]
    assert _partition_bounds(10, 3, [2, 9]) == [0, 2, 9, 10]
    with pytest.raises(PipelineError, match="cannot fill 4 pipeline chunks"):
        _partition_bounds(3, 4, None)
    for bad in ([2], [5, 5], [0, 4], [4, 10], [6, 3]):
        with pytest.raises(PipelineError, match="strictly increasing"):
            _partition_bounds(10, 3, bad)


def test_split_makes_equal_microbatches_of_every_tensor():
    x, y = torch.arange(12).reshape(6, 2), torch.arange(6)
    pieces = _split((x, y), 3, "inputs", torch.device("cpu"))
    assert pieces is not None and len(pieces) == 3
    for j, (a, b) in enumerate(pieces):
        assert torch.equal(a, x[2 * j : 2 * j + 2]) and torch.equal(b, y[2 * j : 2 * j + 2])
    single = _split(x, 2, "inputs", torch.device("cpu"))
    assert single is not None and [len(p) for p in single] == [1, 1]
    assert _split(None, 2, "inputs", torch.device("cpu")) is None


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (torch.zeros(5, 2), "does not split into 2 equal microbatches"),
        (torch.tensor(1.0), "a scalar"),
        (torch.zeros(0, 2), "empty"),
        ({"x": torch.zeros(4)}, "are a dict"),
        ((torch.zeros(4), [1, 2]), "hold a list at position 1"),
    ],
)
def test_split_names_what_is_wrong(batch, message):
    with pytest.raises(PipelineError, match=message):
        _split(batch, 2, "inputs", torch.device("cpu"))


# -- the gradient averager's plan ---------------------------------------------------------------------


def test_every_chunk_is_reduced_once_after_its_last_gradient_op():
    schedule = build_schedule("zb-v", 2, 4)
    for program in schedule.programs:
        last = last_gradient_ops(program)
        for stage, position in last.items():
            later = [op for op in program[position + 1 :] if op.stage == stage]
            assert all(op.kind is Kind.F for op in later), "no gradient op of the stage after its reduction"
        assert program[first_forward(program)].kind is Kind.F
        assert all(op.kind is not Kind.F for op in program[: first_forward(program)])


def test_a_shared_parameter_is_reduced_with_the_chunk_reduced_last():
    shared = nn.Linear(2, 2)
    stages = {
        0: StageState(0, nn.Sequential(shared, nn.Linear(2, 2)), WeightGradStore(), True, False, "a"),
        1: StageState(1, nn.Sequential(nn.Linear(2, 2), shared), WeightGradStore(), False, True, "b"),
    }
    chunks = {stage: buckets[0] for stage, buckets in bucket_parameters(stages, {0: 9, 1: 4}).items()}
    ids = {stage: {id(p) for p in params} for stage, params in chunks.items()}  # stage 0 reduced last
    assert {id(shared.weight), id(shared.bias)} <= ids[0] and not ids[0] & ids[1]
    assert len(chunks[0]) == 4 and len(chunks[1]) == 2


# -- memory-limit parsing ------------------------------------------------------------------------------


def test_memory_limit_in_units_of_p_or_absolute():
    assert parse_memory_limit("2p", 4, 1.5) == pytest.approx(12.0)
    assert parse_memory_limit("1.5p", 4, [1.0, 2.0, 3.0, 2.0]) == pytest.approx(12.0)  # per-rank mean 2
    assert parse_memory_limit("12", 4) == 12.0 and parse_memory_limit(3, 4) == 3.0
    assert parse_memory_limit(None, 4) is None
    for bad in ("lots", "-1", "0p", "nan"):
        with pytest.raises(ScheduleError):
            parse_memory_limit(bad, 4)


# -- recorded timelines ---------------------------------------------------------------------------------


def _recorded(name: str = "1f1b", ranks: int = 2, m: int = 3, lag: float = 0.5):
    """A measured-like timeline: the simulator's times, every receiving op issued ``lag`` early and
    waiting for its input until its simulated start; each rank settles the optimizer first."""
    schedule = build_schedule(name, ranks, m)
    simulated = simulate(schedule, CostModel(f=1.0, b=2.0, w=1.0))
    per_rank = []
    for rank, program in enumerate(schedule.programs):
        ops, waits, previous_end = [], [], float("-inf")
        for op, a, b in zip(program, simulated.start[rank], simulated.end[rank]):
            key = None
            if op.kind is Kind.F and op.stage > 0:
                key = MessageKey(0, op.stage - 1, op.microbatch)
            elif op.computes_input_grad and op.stage < schedule.num_stages - 1:
                key = MessageKey(1, op.stage, op.microbatch)
            issued = max(a - lag, previous_end)  # an op is issued once the previous one ended
            if key is None or issued == a:
                ops.append((a, b))
            else:
                ops.append((issued, b))
                waits.append((key, issued, a))
            previous_end = b
        per_rank.append((ops, waits, [("optimizer settle", ops[0][0] - 0.25, ops[0][0])]))
    return schedule, simulated, build_timeline(schedule, per_rank)


def test_transfer_latency_is_producer_end_to_consumer_wait_end():
    schedule, simulated, timeline = _recorded(lag=0.5)
    assert timeline.start == simulated.start, "an op starts when the wait inside it ends"
    produced = {}
    for rank, program in enumerate(schedule.programs):
        for op, end in zip(program, simulated.end[rank]):
            if op.kind is Kind.F:
                produced[(0, op.stage, op.microbatch)] = end
            elif op.computes_input_grad:
                produced[(1, op.stage - 1, op.microbatch)] = end
    expected = [
        b - produced[key] for waits in timeline.waits for key, a, b in waits if a <= produced[key] <= b
    ]
    assert expected and transfer_latencies(timeline) == expected
    assert all(0.0 <= x <= 0.5 for x in expected)


def test_transfer_latency_ignores_waits_that_began_after_the_message_arrived():
    schedule = build_schedule("1f1b", 2, 1)
    ends = [[1.0, 10.0], [3.0, 5.0]]  # rank 0: F0 ends 1, B0 ends 10; rank 1: F1 ends 3, B1 ends 5
    per_rank = [
        ([(0.0, 1.0), (5.0, 10.0)], [(MessageKey(1, 0, 0), 5.0, 6.0)]),  # B0 waits 5..6 for B1 (ended 5)
        ([(2.0, 3.0), (3.0, 5.0)], [(MessageKey(0, 0, 0), 2.0, 2.5)]),  # F1 waited 2..2.5, F0 ended 1
    ]
    timeline = build_timeline(schedule, per_rank)
    assert [list(e) for e in timeline.end] == ends
    assert transfer_latencies(timeline) == [1.0], "only the wait covering the producer's end counts"


def test_build_timeline_refuses_a_partial_step():
    schedule = build_schedule("1f1b", 2, 2)
    with pytest.raises(PipelineError, match="record a whole step"):
        build_timeline(schedule, [([(0.0, 1.0)], []), ([], [])])


def test_write_trace_from_timelines_writes_the_four_files_with_runtime_events(tmp_path):
    _, _, timeline = _recorded("zb-h1", 2, 4)
    report = write_trace([timeline, timeline], tmp_path)
    names = sorted(path.rsplit("/", 1)[-1] for path in report.files)
    assert names == ["predicted.json", "summary.json", "timeline.png", "trace.json"]
    assert report.steps == 2 and report.measured_iteration_time == pytest.approx(timeline.iteration_time)
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    settles = [e for e in events if e.get("cat") == "runtime"]
    assert [(e["name"], e["tid"]) for e in settles] == [("optimizer settle", 0), ("optimizer settle", 1)]
    assert min(e["ts"] for e in events if "ts" in e) == 0.0, "the earliest event starts the clock"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary) == {
        "measured",
        "predicted",
        "costs_seconds",
        "layer_bounds",
        "transfer_latency",
        "layer_profile",
    }
    assert summary["layer_bounds"] == [] and summary["layer_profile"] is None
    with pytest.raises(PipelineError, match="no step was recorded"):
        write_trace([], tmp_path)


def test_chrome_trace_names_waits_by_message():
    _, _, timeline = _recorded()
    events = json.loads(measured_chrome_trace(timeline))["traceEvents"]
    waits = [e for e in events if e.get("cat") == "wait"]
    assert waits and all(e["name"].startswith(("wait act ", "wait grad ")) for e in waits)
    assert any(e["name"] == "wait act 0->1 mb 0" and e["args"]["key"] == [0, 0, 0] for e in waits)


# -- the executor's hooks and the recorder protocol --------------------------------------------------


class _Log(RecorderDefaults):
    def __init__(self, log: list):
        self.log = log

    def op(self, op, start, end) -> None:
        self.log.append(("op", str(op)))

    def wait(self, key, start, end) -> None:
        self.log.append(("wait", key))

    def event(self, name, start, end) -> None:
        self.log.append(("event", name))


def _logged(handler, kind: Kind, log: list):
    def run(state, j: int) -> None:
        log.append(("run", f"{kind.value}{j}"))
        handler(state, j)

    return run


def _one_rank_executor(log: list) -> Executor:
    schedule = build_schedule("zb-h1", 1, 2)
    stage = StageState(0, nn.Linear(3, 1), WeightGradStore(), True, True, "linear")
    executor = Executor(schedule, 0, {0: stage}, LocalComm(), nn.functional.mse_loss)  # type: ignore[arg-type]
    executor.handlers = {kind: _logged(handler, kind, log) for kind, handler in executor.handlers.items()}
    executor.compile()
    return executor


def _step(executor: Executor) -> None:
    inputs = [(torch.ones(2, 3),), (torch.ones(2, 3),)]
    executor.run_step(inputs, [torch.zeros(2, 1), torch.zeros(2, 1)])


@pytest.mark.parametrize("entry", ["engine entry point", "public backward"])
def test_the_backward_call_accumulates_as_backward_does(monkeypatch, entry):
    """B starts the engine through torch's entry point (or ``backward()`` where torch lacks it):
    the same ``.grad`` as ``torch.autograd.backward`` for given output gradients."""
    if entry == "public backward":
        monkeypatch.setattr(executor_module, "_engine_run_backward", None)
    torch.manual_seed(0)
    layer, x, grad = nn.Linear(3, 2), torch.randn(4, 3, requires_grad=True), torch.randn(4, 2)
    for _ in range(2):  # the second call adds into the first's .grad
        torch.autograd.backward([layer(x)], [grad])
    reference = [t.grad.clone() for t in (x, *layer.parameters())]
    for t in (x, *layer.parameters()):
        t.grad = None
    for _ in range(2):
        executor_module._run_backward([layer(x)], [grad])
    assert all(torch.equal(t.grad, r) for t, r in zip((x, *layer.parameters()), reference))


@pytest.mark.parametrize("entry", ["engine entry point", "public backward"])
def test_a_one_stage_step_gives_the_gradient_of_the_mean_loss(monkeypatch, entry):
    if entry == "public backward":
        monkeypatch.setattr(executor_module, "_engine_run_backward", None)
    executor = _one_rank_executor([])
    layer = executor.stages[0].module
    expected = torch.autograd.grad(
        sum(nn.functional.mse_loss(layer(torch.ones(2, 3)), torch.zeros(2, 1)) for _ in range(2)) / 2,
        list(layer.parameters()),
    )
    _step(executor)
    assert all(torch.allclose(p.grad, e) for p, e in zip(layer.parameters(), expected))


def test_hooks_run_around_their_op_and_survive_a_recompile():
    log: list = []
    executor = _one_rank_executor(log)
    program = executor.schedule.programs[0]
    executor.add_hook(first_forward(program), Hook("settle", lambda: log.append("settle")))
    executor.add_hook(len(program) - 1, Hook("reduce", lambda: log.append("reduce")), after=True)
    executor.compile()  # e.g. after replacing handlers: the hooks stay
    _step(executor)
    ran = [entry for entry in log if entry in ("settle", "reduce") or entry[0] == "run"]
    assert ran[0] == "settle" and ran[1] == ("run", "F0") and ran[-1] == "reduce"
    assert len(ran) == len(program) + 2
    log.clear()
    executor.run_forward([(torch.ones(2, 3),), (torch.ones(2, 3),)], [torch.zeros(2, 1)] * 2)
    assert "settle" not in log and "reduce" not in log, "an evaluation pass runs no training hook"
    with pytest.raises(PipelineError, match="no op at position"):
        executor.add_hook(len(program), Hook("late", lambda: None))


def test_a_recorder_sees_hooks_as_events_and_ops_as_ops():
    log: list = []
    executor = _one_rank_executor([])
    executor.add_hook(0, Hook("optimizer settle", lambda: None))
    executor.recorder = _Log(log)
    _step(executor)
    program = executor.schedule.programs[0]
    assert log[0] == ("event", "optimizer settle")
    assert [entry[1] for entry in log[1:]] == [str(op) for op in program], "one op record per op"


def test_a_recorder_with_only_op_and_wait_is_completed_once():
    class Minimal:
        def __init__(self):
            self.ops = 0

        def op(self, op, start, end):
            self.ops += 1

        def wait(self, key, start, end):
            pass

    minimal = Minimal()
    complete = as_recorder(minimal)
    assert isinstance(complete, Recorder) and complete is not minimal
    executor = _one_rank_executor([])
    executor.add_hook(0, Hook("optimizer settle", lambda: None))
    executor.recorder = complete
    _step(executor)
    assert minimal.ops == len(executor.schedule.programs[0])
    full = _Log([])
    assert as_recorder(full) is full and as_recorder(None) is None
    with pytest.raises(PipelineError, match="op\\(op, start, end\\)"):
        as_recorder(object())  # type: ignore[arg-type]


def test_a_failing_hook_is_reported_by_name():
    posted: list = []
    executor = _one_rank_executor([])
    executor.comm.monitor = type("Monitor", (), {"post": lambda self, text: posted.append(text)})()  # type: ignore[misc]

    def fail() -> None:
        raise RuntimeError("boom")

    executor.add_hook(0, Hook("optimizer settle", fail))
    with pytest.raises(RuntimeError, match="boom"):
        _step(executor)
    assert posted == ["rank 0 failed in the optimizer settle: RuntimeError: boom"]


# -- waits: the peer monitor's watchdog ------------------------------------------------------------


class _BlockingWork:
    """A transfer that never completes by itself; like gloo's, a ``wait(timeout)`` closes it."""

    def __init__(self):
        self._closed = threading.Event()
        self.waits_with_timeout = 0

    def wait(self, timeout=None):
        if timeout is not None:
            self.waits_with_timeout += 1
            self._closed.set()
            raise RuntimeError("gloo: timed out, channel closed")
        if not self._closed.wait(30.0):
            raise AssertionError("the watchdog never ended this wait")
        raise RuntimeError("gloo: connection closed by the other end")


class _SlowWork:
    """A transfer that completes after ``seconds``: long enough for the watchdog to look at it."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def wait(self, timeout=None):
        time.sleep(self.seconds)
        return True


def test_a_wait_past_its_deadline_raises_a_timeout_naming_what_it_waited_for():
    monitor = PeerMonitor(None, 3, timeout=0.1)
    work = _BlockingWork()
    started = time.monotonic()
    expected = re.escape("rank 3: waiting for the gradient of x failed (timeout 0.1 s)")
    with pytest.raises(PipelineError, match=expected):
        monitor.wait(work, lambda: "the gradient of x")
    assert time.monotonic() - started < 5.0 and work.waits_with_timeout == 1


def test_a_peer_notice_ends_the_wait_with_the_peers_error():
    store = dist.HashStore()
    waiting = PeerMonitor("pipe", 0, timeout=30.0, store=store)
    failing = PeerMonitor("pipe", 1, timeout=30.0, store=store)
    threading.Timer(0.05, failing.post, ["rank 1 failed in op F1.0: ValueError: bad batch"]).start()
    expected = re.escape("rank 0 stopped because rank 1 failed in op F1.0: ValueError: bad batch")
    with pytest.raises(PeerFailure, match=expected):
        waiting.wait(_BlockingWork(), "the activations of stage 0")
    assert waiting.failure is not None


def test_a_completed_wait_leaves_no_reference_to_its_work():
    # a Work still referenced (by the watchdog) when its process group is gone aborts the process at exit
    monitor = PeerMonitor(None, 0, timeout=5.0)
    work = _SlowWork(0.1)  # the watchdog looks at it a few times while it is armed
    alive = weakref.ref(work)
    monitor.wait(work, "a send")
    del work
    assert alive() is None  # at once: the watchdog refers to a Work only while it looks at it


# -- how local ranks start ---------------------------------------------------------------------------


def test_ranks_start_spawned_unless_a_start_method_is_named(monkeypatch):
    from zerobubble.runtime.launch import start_context

    monkeypatch.delenv("ZEROBUBBLE_START_METHOD", raising=False)
    assert start_context().get_start_method() == "spawn"
    monkeypatch.setenv("ZEROBUBBLE_START_METHOD", "forkserver")
    assert start_context().get_start_method() == "forkserver"
    assert start_context("spawn").get_start_method() == "spawn"  # the argument wins over the environment


def test_an_unknown_start_method_is_refused_naming_the_choices(monkeypatch):
    from zerobubble.runtime.launch import start_context

    with pytest.raises(PipelineError, match="'fork' is not one of spawn, forkserver"):
        start_context("fork")
    monkeypatch.setenv("ZEROBUBBLE_START_METHOD", "threads")
    with pytest.raises(PipelineError, match="'threads' is not one of"):
        start_context()
