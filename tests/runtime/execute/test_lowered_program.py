"""The executor runs the lowered program: its entries are the rank's lowered actions minus the unbound ones.

Generated schedules and data-parallel modes: the compiled entries, in order, are the compute ops (one
per op, at its first part), every send's and receive's ``issue``/``wait`` (bound by
:class:`~zerobubble.runtime.execute.transfers.Transfers`), and the communication actions a
:class:`Communication` binds; nothing else.  A forward-only step runs the forwards and the
activations' transfers only.
"""

from __future__ import annotations

import pytest
import torch
from _dist import LocalComm
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from zerobubble.runtime import PipelineError
from zerobubble.runtime.execute.executor import Executor, StageState
from zerobubble.runtime.execute.pairs import expand_pairs
from zerobubble.runtime.execute.program import CommAction, NoCommunication, forward_entries
from zerobubble.runtime.execute.transfers import forward_transfer
from zerobubble.runtime.wgrad import WeightGradStore
from zerobubble.schedule import REGISTRY, Kind, Op, ScheduleError, build_schedule
from zerobubble.schedule.channels import receiving_stage, sending_stage
from zerobubble.schedule.compare import SLOW_SCHEDULES
from zerobubble.schedule.grid import Grid
from zerobubble.schedule.lowering import CommKind, Compute, Issue, StageBytes, Wait, lower
from zerobubble.schedule.sharding import FSDPOptions

SCHEDULES = ["1f1b", "zb-h1", "zb-v", "interleaved-1f1b", "dualpipe-v"]
# dualpipe-v (slow for the planner, not here): each overlapped pair's entries are folded into one
REGISTRY_SCHEDULES = sorted({*(name for name in REGISTRY if name not in SLOW_SCHEDULES), "dualpipe-v"})
MODES = {
    "none": (Grid(), None),
    "replicate": (Grid(dp=2), None),
    "fsdp-chunk": (Grid(dp=2, sharding="fsdp"), None),
    "fsdp-layer": (Grid(dp=2, sharding="fsdp"), FSDPOptions(units="layer", prefetch=1)),
}
BOUND = (CommKind.ALL_REDUCE, CommKind.UNSHARD, CommKind.REDUCE_SCATTER)
TRANSFERS = (CommKind.SEND, CommKind.RECV)


class Binder(NoCommunication):
    """Binds every all-reduce, unshard and reduce-scatter action; logs what runs."""

    def __init__(self, log: list):
        self.log = log

    def comm_handler(self, action):
        if action.comm.kind not in BOUND:
            return None
        return lambda: self.log.append(str(action))


def _executor(schedule, rank: int) -> Executor:
    last = schedule.num_stages - 1
    stages = {
        op.stage: StageState(
            op.stage, nn.Linear(2, 2), WeightGradStore(), op.stage == 0, op.stage == last, "s"
        )
        for op in schedule.programs[rank]
    }
    return Executor(schedule, rank, stages, LocalComm(), lambda out, y: out.sum())


def _lowered(name: str, ranks: int, microbatches: int, mode: str):
    schedule = build_schedule(name, ranks, microbatches * ranks)  # interleaved: a multiple of the ranks
    return schedule, _lower(schedule, mode)


def _lower(schedule, mode: str):
    grid, options = MODES[mode]
    model = StageBytes.uniform(schedule.num_stages, 3, 100.0)
    return lower(schedule, options, grid=grid, model=model)


def _names(program) -> list:
    """Each entry as its op, or its communication action's name (a pair's: those it folded)."""
    return [
        entry[0].name if isinstance(entry[0], CommAction) else entry[0] for entry in expand_pairs(program)
    ]


@given(
    name=st.sampled_from(SCHEDULES),
    ranks=st.integers(2, 3),
    microbatches=st.integers(2, 6),
    mode=st.sampled_from(sorted(MODES)),
)
def test_the_executor_program_is_the_lowered_program_minus_what_nobody_binds(name, ranks, microbatches, mode):
    schedule, lowered = _lowered(name, ranks, microbatches, mode)
    for rank in range(ranks):
        executor = _executor(schedule, rank)
        executor.follow(lowered.program_of(rank))
        executor.communicate(Binder([]))
        expected = [
            action.op if isinstance(action, Compute) else str(action)
            for action in lowered.program_of(rank)
            if (isinstance(action, Compute) and action.first)
            or (isinstance(action, (Issue, Wait)) and action.comm.kind in (*BOUND, *TRANSFERS))
        ]
        assert _names(executor.program) == expected
        assert [e[0] for e in expand_pairs(executor.program) if not isinstance(e[0], CommAction)] == list(
            schedule.programs[rank]
        )
        # without data-parallel binding, the ops and the transfers only
        executor.communicate(NoCommunication())
        assert all(
            entry[0].lowered.comm.kind in TRANSFERS
            for entry in expand_pairs(executor.program)
            if isinstance(entry[0], CommAction)
        )


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(REGISTRY_SCHEDULES), ranks=st.integers(2, 4), microbatches=st.integers(1, 5))
def test_the_program_holds_every_send_and_receive_exactly_as_lowered(name, ranks, microbatches):
    """Every registry schedule: the executor's program is the lowered program's compute ops and
    send/recv actions, in the lowered order — each receive posted and waited, each send issued and
    waited where the lowering placed it — and by default (no ``follow``) it is that same program."""
    try:
        schedule = build_schedule(name, ranks, microbatches * ranks)
    except ScheduleError:
        return  # the builder refuses this (p, m)
    lowered = _lower(schedule, "none")
    rank_of = schedule.placement.rank_of
    for rank in range(ranks):
        program = lowered.program_of(rank)
        expected = [
            a.op if isinstance(a, Compute) else str(a)
            for a in program
            if isinstance(a, Compute) or (isinstance(a, (Issue, Wait)) and a.comm.kind in TRANSFERS)
        ]
        executor = _executor(schedule, rank)
        assert _names(executor.program) == expected, "the default program is the lowered one"
        executor.follow(program)
        assert _names(executor.program) == expected
        for entry in expand_pairs(executor.program):
            if isinstance(entry[0], CommAction):  # no local hand-over is a transfer
                message = entry[0].lowered.comm.message
                assert rank_of(sending_stage(message)) != rank_of(receiving_stage(message))
        # a forward-only step runs the forwards and the activations' transfers only
        forward = forward_entries(expand_pairs(executor.program), {Kind.F}, forward_transfer)
        assert _names(forward) == [
            x
            for x in expected
            if (isinstance(x, Op) and x.kind is Kind.F) or (isinstance(x, str) and "(act " in x)
        ]


def test_a_program_of_other_compute_ops_is_refused():
    schedule, lowered = _lowered("1f1b", 2, 4, "none")
    executor = _executor(schedule, 0)
    with pytest.raises(PipelineError, match="other compute ops"):
        executor.follow(lowered.program_of(1))


def test_a_step_runs_the_bound_actions_where_the_lowered_program_places_them():
    schedule, lowered = _lowered("1f1b", 1, 3, "replicate")
    executor = _executor(schedule, 0)
    log: list = []
    executor.follow(lowered.program_of(0))
    executor.communicate(Binder(log))
    executor.run_step([(torch.ones(1, 2),)] * 3, [None] * 3)
    assert log == ["issue all_reduce(bucket 0.0)", "wait all_reduce(bucket 0.0)"]
