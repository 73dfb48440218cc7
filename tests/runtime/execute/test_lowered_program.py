"""The executor runs the lowered program: its entries are the rank's lowered actions minus the filtered ones.

Generated schedules and data-parallel modes: the compiled entries, in order, are the compute ops (one
per op, at its first part) and the communication actions a :class:`Communication` binds; nothing
else.  The sends and receives stay inside the F/B handlers (:mod:`zerobubble.runtime.execute.comm`):
the lowered order of each channel's sends and receives is the order ``Comm`` posts them in.
"""

from __future__ import annotations

import pytest
import torch
from _dist import LocalComm
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from zerobubble.runtime import PipelineError
from zerobubble.runtime.execute.executor import Executor, StageState
from zerobubble.runtime.execute.program import CommAction, NoCommunication
from zerobubble.runtime.wgrad import WeightGradStore
from zerobubble.schedule import build_schedule
from zerobubble.schedule.channels import channel_messages, receiving_stage, sending_stage
from zerobubble.schedule.grid import Grid
from zerobubble.schedule.lowering import CommKind, Compute, Issue, StageBytes, Wait, lower
from zerobubble.schedule.lowering.lower import compute_ops
from zerobubble.schedule.sharding import FSDPOptions

SCHEDULES = ["1f1b", "zb-h1", "zb-v", "interleaved-1f1b"]
MODES = {
    "none": (Grid(), None),
    "replicate": (Grid(dp=2), None),
    "fsdp-chunk": (Grid(dp=2, sharding="fsdp"), None),
    "fsdp-layer": (Grid(dp=2, sharding="fsdp"), FSDPOptions(units="layer", prefetch=1)),
}
BOUND = (CommKind.ALL_REDUCE, CommKind.UNSHARD, CommKind.REDUCE_SCATTER)


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
    grid, options = MODES[mode]
    model = StageBytes.uniform(schedule.num_stages, 3, 100.0)
    return schedule, lower(schedule, options, grid=grid, model=model)


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
            or (isinstance(action, (Issue, Wait)) and action.comm.kind in BOUND)
        ]
        got = [
            entry[0] if not isinstance(entry[0], CommAction) else entry[0].name for entry in executor.program
        ]
        assert got == expected
        assert [e[0] for e in executor.program if not isinstance(e[0], CommAction)] == list(
            schedule.programs[rank]
        )
        # unbound, the communication costs no entry: the plain program, op for op
        executor.communicate(NoCommunication())
        assert [entry[0] for entry in executor.program] == list(schedule.programs[rank])


def test_a_program_of_other_compute_ops_is_refused():
    schedule, lowered = _lowered("1f1b", 2, 4, "none")
    executor = _executor(schedule, 0)
    with pytest.raises(PipelineError, match="other compute ops"):
        executor.follow(lowered.program_of(1))


@given(name=st.sampled_from(SCHEDULES), ranks=st.integers(2, 4), microbatches=st.integers(2, 6))
def test_each_channels_lowered_sends_and_receives_are_in_the_order_comm_posts_them(name, ranks, microbatches):
    schedule, lowered = _lowered(name, ranks, microbatches, "none")
    rank_of, S = schedule.placement.rank_of, schedule.num_stages
    for src in range(ranks):
        for dst in range(ranks):
            if src == dst:
                continue
            channel = channel_messages(schedule, src, dst)  # Comm posts the receives of (src, dst) so
            sends = [
                a.comm.message
                for a in lowered.program_of(src)
                if isinstance(a, Issue)
                and a.comm.kind is CommKind.SEND
                and rank_of(receiving_stage(a.comm.message)) == dst
            ]
            receives = [
                a.comm.message
                for a in lowered.program_of(dst)
                if isinstance(a, Issue)
                and a.comm.kind is CommKind.RECV
                and rank_of(sending_stage(a.comm.message)) == src
            ]
            assert sends == receives == list(channel), (src, dst, S)
    assert compute_ops(lowered.program_of(0)) == list(schedule.programs[0])


def test_a_step_runs_the_bound_actions_where_the_lowered_program_places_them():
    schedule, lowered = _lowered("1f1b", 1, 3, "replicate")
    executor = _executor(schedule, 0)
    log: list = []
    executor.follow(lowered.program_of(0))
    executor.communicate(Binder(log))
    executor.run_step([(torch.ones(1, 2),)] * 3, [None] * 3)
    assert log == ["issue all_reduce(bucket 0.0)", "wait all_reduce(bucket 0.0)"]
