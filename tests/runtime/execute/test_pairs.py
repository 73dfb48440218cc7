"""Overlapped F&B pairs (dualpipe-v) in the executor: one program entry per pair, exact by default and
under a user's overlap hook.

The compiled program folds each pair of the schedule into one :class:`OverlappedPair` entry whose
folded entries are the lowered program's, in order (generated ranks, microbatches and data-parallel
modes).  On one rank (both stages of the V), a step gives the gradients of plain autograd over
several steps whichever way the halves run: in program order, reversed, or phase by phase; a hook
that leaves a half out, or runs a phase out of order, is a clear error; a recorder sees each half as
an op, in program order, and the pair as an event.  The multi-rank runs are in
``tests/runtime/test_training_equivalence.py`` (drawn with and without hooks) and
``tests/runtime/test_runtime_pipeline.py``.
"""

from __future__ import annotations

import pytest
import torch
from _dist import LocalComm
from _training_equivalence import backward_first, by_phases
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from zerobubble.runtime import PipelineError
from zerobubble.runtime.execute.executor import Executor, StageState
from zerobubble.runtime.execute.pairs import OverlappedPair, expand_pairs
from zerobubble.runtime.execute.program import CommAction
from zerobubble.runtime.wgrad import WeightGradStore, install_deferral
from zerobubble.schedule import Kind, build_schedule
from zerobubble.schedule.grid import Grid
from zerobubble.schedule.lowering import CommKind, Compute, Issue, StageBytes, lower
from zerobubble.schedule.sharding import FSDPOptions

MODES = {
    "none": (Grid(), None),
    "replicate": (Grid(dp=2), None),
    "fsdp-layer": (Grid(dp=2, sharding="fsdp"), FSDPOptions(units="layer", prefetch=1)),
}


class Everything:
    """Binds every communication action to nothing (so every one is an entry)."""

    def comm_handler(self, action):
        return lambda: None

    def compute_handler(self, op, handler):
        return handler


def _executor(schedule, rank: int, layers: dict | None = None) -> Executor:
    last = schedule.num_stages - 1
    stages = {}
    for stage in schedule.placement.stages_of(rank):
        module = (layers or {}).get(stage) or nn.Linear(2, 2)
        store = WeightGradStore()
        install_deferral([module], store, None, generic=True)
        stages[stage] = StageState(stage, module, store, stage == 0, stage == last, f"s{stage}")
    return Executor(schedule, rank, stages, LocalComm(), lambda out, y: ((out - y) ** 2).mean())


@settings(max_examples=30, deadline=None)
@given(ranks=st.integers(1, 4), extra=st.integers(0, 3), mode=st.sampled_from(sorted(MODES)))
def test_each_pair_is_one_entry_folding_the_lowered_actions_between_its_ops(ranks, extra, mode):
    schedule = build_schedule("dualpipe-v", ranks, 2 * ranks + extra)
    grid, options = MODES[mode]
    lowered = lower(schedule, options, grid=grid, model=StageBytes.uniform(schedule.num_stages, 3, 100.0))
    for rank in range(ranks):
        executor = _executor(schedule, rank)
        executor.follow(lowered.program_of(rank))
        executor.communicate(Everything())
        pairs = [entry[0] for entry in executor.program if isinstance(entry[0], OverlappedPair)]
        overlapped = [pair for pair in schedule.overlapped if pair[0] in schedule.programs[rank]]
        assert [(p.forward.op, p.backward.op) for p in pairs] == overlapped
        expected = [
            a.op if isinstance(a, Compute) else str(a)
            for a in lowered.program_of(rank)
            if not isinstance(a, Compute) or a.first
        ]
        names = [e[0].name if isinstance(e[0], CommAction) else e[0] for e in expand_pairs(executor.program)]
        assert names == [x for x in expected if x != "step"], "the folded entries are the lowered ones"
        for pair in pairs:
            forward_tail = [e[0].lowered for e in pair.forward._surround[0]]
            assert all(
                isinstance(a, Issue) and a.comm.kind in (CommKind.SEND, CommKind.RESHARD)
                for a in forward_tail
            )
            assert pair.entries[0][0] == pair.forward.op and pair.entries[-1][0] == pair.backward.op


def _model(seed: int) -> dict[int, nn.Module]:
    torch.manual_seed(seed)
    return {
        0: nn.Sequential(nn.Linear(3, 4), nn.Tanh()).double(),
        1: nn.Sequential(nn.Linear(4, 2)).double(),
    }


def _batch(step: int, m: int) -> tuple[list, list]:
    generator = torch.Generator().manual_seed(step)
    inputs = [(torch.randn(2, 3, generator=generator, dtype=torch.float64),) for _ in range(m)]
    targets = [torch.randn(2, 2, generator=generator, dtype=torch.float64) for _ in range(m)]
    return inputs, targets


@pytest.mark.parametrize(
    "hook",
    [None, backward_first, by_phases, "threads"],
    ids=["program order", "reversed", "phases", "threads"],
)
def test_a_pair_gives_plain_autograds_gradients_over_several_steps_whichever_way_it_runs(hook):
    m, steps = 4, 3
    layers, reference = _model(0), _model(0)
    executor = _executor(build_schedule("dualpipe-v", 1, m), 0, layers)
    executor.overlap = hook
    params = [p for stage in (0, 1) for p in layers[stage].parameters()]
    expected = [p for stage in (0, 1) for p in reference[stage].parameters()]
    for step in range(steps):
        inputs, targets = _batch(step, m)
        losses = executor.run_step(inputs, targets)
        total = sum(((reference[1](reference[0](x)) - y) ** 2).mean() for (x,), y in zip(inputs, targets))
        (total / m).backward()
        assert sorted(executor.loss_microbatches) == list(range(m)) and len(losses) == m
        for mine, theirs in zip(params, expected):
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-12, atol=1e-14)
        with torch.no_grad():  # a plain SGD step on both
            for mine, theirs in zip(params, expected):
                mine -= 0.1 * mine.grad
                theirs -= 0.1 * theirs.grad
                mine.grad = theirs.grad = None
    evaluated = executor.run_forward(*_batch(9, m))  # a forward-only step runs the pairs' forwards
    assert len(evaluated) == m


@pytest.mark.parametrize(
    "hook, message",
    [
        (lambda pair: pair.forward(), r"without running BW0\.0 of the overlapped pair F1\.1&BW0\.0"),
        (lambda pair: pair.backward.compute(), r"BW0\.0: compute\(\) called before receive\(\)"),
        (lambda pair: (pair.forward(), pair.forward()), r"F1\.1: run\(\) called after send"),
    ],
    ids=["a half left out", "compute before receive", "a half twice"],
)
def test_a_hook_that_breaks_the_contract_is_a_clear_error(hook, message):
    executor = _executor(build_schedule("dualpipe-v", 1, 2), 0, _model(0))
    executor.overlap = hook
    with pytest.raises(PipelineError, match=message):
        executor.run_step(*_batch(0, 2))


def test_threads_runs_the_forward_half_on_one_worker_and_raises_its_failure_on_the_caller():
    import threading

    executor = _executor(build_schedule("dualpipe-v", 1, 4), 0, _model(0))
    executor.overlap = "threads"
    seen: set[str] = set()
    stage = executor.stages[1].module
    stage.register_forward_hook(lambda *_: seen.add(threading.current_thread().name.split("_")[0]))
    executor.run_step(*_batch(0, 4))
    executor.run_step(*_batch(1, 4))
    assert seen == {"MainThread", "zerobubble-pair"}, "pairs' forwards on one worker, made once"

    def fail(*_):
        if threading.current_thread().name.startswith("zerobubble-pair"):
            raise ValueError("the forward half failed")

    stage.register_forward_hook(fail)
    with pytest.raises(PipelineError) as raised:
        executor.run_step(*_batch(2, 4))
    assert "the forward half failed" in repr(raised.value.__cause__)


def test_threads_are_refused_where_both_halves_share_a_collective_group():
    from zerobubble.runtime.execute.pairs import check_threaded_grid
    from zerobubble.schedule.grid import Grid

    check_threaded_grid("threads", Grid.of_mesh(("pp", "ep"), (2, 2)))  # ep: a group per half
    check_threaded_grid(None, Grid.of_mesh(("pp", "tp"), (2, 2)))
    for grid in (
        Grid.of_mesh(("pp", "tp"), (2, 2)),
        Grid.of_mesh(("pp", "dp"), (2, 2), data_parallel="fsdp"),
    ):
        with pytest.raises(PipelineError, match=r'overlap="threads" .* \(tensor-parallel or FSDP\)'):
            check_threaded_grid("threads", grid)
    check_threaded_grid(None, Grid(), vocab_parallel=True)  # the halves one after the other: allowed
    with pytest.raises(PipelineError, match=r'overlap="threads" .* vocabulary-parallel head'):
        check_threaded_grid("threads", Grid(), vocab_parallel=True)


def test_an_unknown_overlap_is_refused_clearly():
    executor = _executor(build_schedule("dualpipe-v", 1, 2), 0, _model(0))
    with pytest.raises(PipelineError, match=r"overlap='thread': pass None .*\"threads\""):
        executor.overlap = "thread"


class Recorder:
    def __init__(self):
        self.ops, self.events, self.now = [], [], 0.0

    def clock(self):
        self.now += 1.0
        return self.now

    def begin_step(self):
        pass

    def op(self, op, start, end):
        self.ops.append((op, start, end))

    def wait(self, key, start, end):
        pass

    def event(self, name, start, end):
        self.events.append((name, start, end))


@pytest.mark.parametrize("hook", [None, backward_first])
def test_a_recorder_sees_both_halves_as_ops_in_program_order_and_the_pair_as_an_event(hook):
    schedule = build_schedule("dualpipe-v", 1, 3)
    executor = _executor(schedule, 0)
    executor.overlap = hook
    executor.recorder = recorder = Recorder()
    executor.run_step([(torch.ones(2, 2),)] * 3, [torch.zeros(2, 2)] * 3)
    assert [op for op, _, _ in recorder.ops] == list(schedule.programs[0])
    pairs = {f"overlapped pair {f}&{b}": (f, b) for f, b in schedule.overlapped}
    named = [event for event in recorder.events if event[0] in pairs]
    assert [name for name, _, _ in named] == list(pairs)
    spans = {op: (start, end) for op, start, end in recorder.ops}
    for name, start, end in named:
        forward, backward = (spans[op] for op in pairs[name])
        assert all(start <= s < e <= end for s, e in (forward, backward)), "the halves inside the pair"
        if hook is backward_first:
            assert backward[1] <= forward[0]
        else:
            assert forward[1] <= backward[0]


def test_the_forward_tail_holds_the_forwards_sends_only():
    schedule = build_schedule("dualpipe-v", 2, 4)
    executor = _executor(schedule, 0)
    for entry in executor.program:
        if isinstance(entry[0], OverlappedPair):
            for tail in entry[0].forward._surround[0]:
                assert tail[0].lowered.comm.message.boundary == entry[0].forward.op.stage
                assert entry[0].forward.op.kind is Kind.F
