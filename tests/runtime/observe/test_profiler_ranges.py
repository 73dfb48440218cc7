"""Under ``torch.profiler.profile`` every op, transfer and hook of a step is a ``zerobubble/`` range.

A one-process executor checks names, nesting and that a profiled step computes what a plain one
does; two gloo ranks (one spawn) profile a real Pipeline step and evaluation of zb-h1, zb-v and
1f1b and find exactly their rank's program, its messages and its hooks.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from _dist import LocalComm, run_ranks
from _profiling import profiled_steps, range_names
from torch import nn

from zerobubble.runtime.execute.executor import Executor, Hook, StageState
from zerobubble.runtime.observe import ranges
from zerobubble.runtime.observe.recorder import RecorderDefaults
from zerobubble.runtime.wgrad import WeightGradStore
from zerobubble.schedule import Kind, Op, build_schedule
from zerobubble.schedule.channels import ACTIVATIONS, GRADIENTS, MessageKey, channel_messages

CASES = [("zb-h1", 4), ("zb-v", 4), ("1f1b", 3)]


def _op_name(text: str) -> str:
    return ranges.op_range(Op.parse(text))


def test_range_names():
    assert ranges.op_range(Op(Kind.F, 0, 3)) == "zerobubble/F s0 mb3"
    assert ranges.op_range(Op(Kind.BW, 2, 1)) == "zerobubble/BW s2 mb1"
    assert ranges.hook_range("optimizer settle") == "zerobubble/hook optimizer settle"
    # named after this rank's op: F of stage 1 sends the 1->2 activations, F of stage 2 receives them
    assert ranges.send_range(MessageKey(ACTIVATIONS, 1, 4)) == "zerobubble/send F s1 mb4"
    assert ranges.recv_range(MessageKey(ACTIVATIONS, 1, 4)) == "zerobubble/recv F s2 mb4"
    assert ranges.send_range(MessageKey(GRADIENTS, 1, 4)) == "zerobubble/send B s2 mb4"
    assert ranges.recv_range(MessageKey(GRADIENTS, 1, 4)) == "zerobubble/recv B s1 mb4"
    assert not ranges.profiling()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert ranges.profiling()
    assert not ranges.profiling()


def _one_rank_executor():
    torch.manual_seed(0)
    schedule = build_schedule("zb-v", 1, 4)
    stages = {
        s: StageState(s, nn.Linear(4, 4), WeightGradStore(), s == 0, s == 1, f"chunk {s}") for s in (0, 1)
    }
    executor = Executor(schedule, 0, stages, LocalComm(), lambda out, y: out.square().mean())
    executor.add_hook(0, Hook("optimizer settle", lambda: None))
    return executor, [(torch.randn(2, 4),) for _ in range(4)]


def _grads(executor) -> list[torch.Tensor]:
    grads = [p.grad.clone() for s in executor.stages.values() for p in s.module.parameters()]
    for state in executor.stages.values():
        state.module.zero_grad(set_to_none=True)
    return grads


def test_one_rank_profiled_step_has_every_op_in_program_order():
    executor, inputs = _one_rank_executor()
    executor.run_step(inputs, [None] * 4)
    plain = _grads(executor)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        losses = executor.run_step(inputs, [None] * 4)
    assert len(losses) == 4
    assert all(torch.equal(a, b) for a, b in zip(plain, _grads(executor)))
    names = range_names(prof)
    program = [str(op) for op in executor.schedule.programs[0]]
    assert names == ["zerobubble/step", "zerobubble/hook optimizer settle", *map(_op_name, program)]
    step = next(e for e in prof.events() if e.name == "zerobubble/step")
    ops = [e for e in prof.events() if e.name.startswith("zerobubble/") and e.name != "zerobubble/step"]
    assert all(
        step.time_range.start <= e.time_range.start <= e.time_range.end <= step.time_range.end for e in ops
    )
    # a recompile (a new hook) is picked up by the next profiled step; plain steps again after it
    executor.add_hook(len(program) - 1, Hook("last", lambda: None), after=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        executor.run_step(inputs, [None] * 4)
    assert range_names(prof)[-1] == "zerobubble/hook last"
    assert all(torch.equal(a, b) for a, b in zip(plain, _grads(executor)))
    executor.run_step(inputs, [None] * 4)
    assert all(torch.equal(a, b) for a, b in zip(plain, _grads(executor)))


class _Counting(RecorderDefaults):
    def __init__(self):
        self.ops, self.events = [], []

    def op(self, op, start, end):
        self.ops.append(str(op))

    def wait(self, key, start, end):
        pass

    def event(self, name, start, end):
        self.events.append(name)


def test_one_rank_profiled_step_with_a_recorder_records_and_ranges():
    executor, inputs = _one_rank_executor()
    executor.recorder = recorder = _Counting()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        executor.run_step(inputs, [None] * 4)
    program = [str(op) for op in executor.schedule.programs[0]]
    assert range_names(prof)[2:] == [_op_name(text) for text in program]
    assert recorder.ops == program and recorder.events == ["optimizer settle"]


def test_one_rank_profiled_failure_is_reported_with_its_op():
    executor, inputs = _one_rank_executor()
    posted = []
    executor.comm.monitor.post = posted.append
    executor.stages[1].module = lambda x: (_ for _ in ()).throw(RuntimeError("boom"))
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with profiler, pytest.raises(Exception, match="boom"):
        executor.run_step(inputs, [None] * 4)
    assert len(posted) == 1 and "stage 1" in posted[0]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(profiled_steps, 2, CASES)


def _expected(case: tuple[str, int], rank: int, hooks: list[str]) -> Counter:
    schedule = build_schedule(case[0], 2, case[1])
    names = [_op_name(str(op)) for op in schedule.programs[rank]]
    names += [ranges.send_range(key) for key in channel_messages(schedule, rank, 1 - rank)]
    names += [ranges.recv_range(key) for key in channel_messages(schedule, 1 - rank, rank)]
    names += [ranges.hook_range(hook) for hook in hooks] + ["zerobubble/step", "zerobubble/wait sends"]
    return Counter(names)


@pytest.mark.multiprocess
@pytest.mark.parametrize("index", range(len(CASES)), ids=[name for name, _ in CASES])
def test_two_ranks_profiled_step_shows_the_program(index, two_ranks):
    case = CASES[index]
    for result in two_ranks:
        rank = result[index]["rank"]
        got = Counter(result[index]["step"])
        assert "optimizer settle" in result[index]["hooks"]
        assert got == _expected(case, rank, result[index]["hooks"])
        per_kind = Counter(name.split()[0] for name in result[index]["step"])
        for kind, count in Counter(Op.parse(text).kind.value for text in result[index]["program"]).items():
            assert per_kind["zerobubble/" + kind] == count, kind
        kinds = {f"zerobubble/{kind.value}" for kind in Kind}
        ops = [name for name in result[index]["step"] if name.split()[0] in kinds]
        assert ops == [_op_name(text) for text in result[index]["program"]], "ranges in program order"
        assert result[index]["difference"] == 0.0, "a profiled step computes what a plain one does"
        forwards = [_op_name(text) for text in result[index]["program"] if text.startswith("F")]
        assert [n for n in result[index]["evaluate"] if n.startswith("zerobubble/F ")] == forwards
