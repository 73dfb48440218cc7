"""DualPipeV (DeepSeek-AI; Sea AI Lab's "cut-in-half" of DualPipe): a V over p ranks whose steady
state runs overlapped F&B pairs, so one microbatch's expert all-to-all hides behind another's compute.

Rank ``r`` holds stage ``r`` (phase 0, down the V) and stage ``2p−1−r`` (phase 1, up).  Its program
has eight steps (docs/schedulers.md, "DualPipeV"): forwards to fill the V, a zero-bubble warm-up of
split backwards, the main step of two F&B pairs per microbatch, and a drain of fused and split
backwards whose deferred W ops fill the tail's bubbles.  Backwards inside a pair are fused (BW);
the split ones (B now, W later, first in first out) are those the authors run "zero bubble".  It
needs m ≥ 2p microbatches, as the authors' and torch's implementations do.  The pattern is fixed:
costs change only the simulated times.  Bidirectional DualPipe (two copies of every stage, one per
direction) is not built: its two directions are two pipelines, which a placement cannot hold.
"""

from __future__ import annotations

from collections import deque

from ..costs import CostModel
from ..ir import BW, B, F, Op, Placement, Schedule, ScheduleError, W


class _RankProgram:
    """One rank's DualPipeV program under construction: its ops, its pairs, the next microbatch of
    each kind in each phase and the queue of deferred W ops."""

    def __init__(self, rank: int, ranks: int):
        self.stage = (rank, 2 * ranks - 1 - rank)  # phase 0 (down) and phase 1 (up)
        self.ops: list[Op] = []
        self.pairs: list[tuple[Op, Op]] = []
        self.next_forward = [0, 0]
        self.next_backward = [0, 0]
        self.deferred: deque[Op] = deque()

    def forward(self, phase: int) -> Op:
        op = F(self.stage[phase], self.next_forward[phase])
        self.next_forward[phase] += 1
        self.ops.append(op)
        return op

    def backward(self, phase: int, *, split: bool = False) -> Op:
        """A fused backward, or (``split``) its B now and its W deferred to a later :meth:`weight`."""
        stage, j = self.stage[phase], self.next_backward[phase]
        self.next_backward[phase] += 1
        op = B(stage, j) if split else BW(stage, j)
        if split:
            self.deferred.append(W(stage, j))
        self.ops.append(op)
        return op

    def weight(self) -> None:
        self.ops.append(self.deferred.popleft())

    def pair(self, forward_phase: int, backward_phase: int) -> None:
        """An overlapped F&B pair: a forward and another microbatch's fused backward."""
        self.pairs.append((self.forward(forward_phase), self.backward(backward_phase)))


def rank_program(rank: int, ranks: int, microbatches: int) -> tuple[list[Op], list[tuple[Op, Op]]]:
    """The DualPipeV program of rank ``rank`` of ``ranks``, and its overlapped pairs (the step
    structure of the authors' ``dualpipev.py``; docs/schedulers.md lists the steps)."""
    plan = _RankProgram(rank, ranks)
    last = ranks - 1
    below = last - rank  # ranks after this one
    for _ in range(2 * below):  # 1: fill the down leg
        plan.forward(0)
    for _ in range(rank + 1):  # 2: forwards of both phases
        plan.forward(0)
        plan.forward(1)
    for _ in range(below):  # 3: split backward of phase 1, its W, a forward
        plan.backward(1, split=True)
        plan.weight()
        plan.forward(1)
    for i in range(microbatches - 2 * ranks + rank + 1):  # 4: the main step, two pairs
        if i == 0 and rank == last:  # the V's tip: not overlapped, to shorten the bubble
            plan.forward(0)
            plan.backward(1)
        else:
            plan.pair(0, 1)
        plan.pair(1, 0)
    for _ in range(below):  # 5: a backward of phase 1, a pair
        plan.backward(1)
        plan.pair(1, 0)
    _drain(plan, rank, below)
    return plan.ops, plan.pairs


def _drain(plan: _RankProgram, rank: int, below: int) -> None:
    """Steps 6-8: backwards of both phases, the second half of them split; split backwards of
    phase 0 after a deferred W each; the W ops left."""
    split = False
    half = (rank + 1) // 2
    for i in range(rank + 1):
        if i == half and rank % 2 == 1:
            split = True
        plan.backward(1, split=split)
        if i == half and rank % 2 == 0:
            split = True
        plan.backward(0, split=split)
    for _ in range(below):
        plan.weight()
        plan.backward(0, split=True)
    while plan.deferred:
        plan.weight()


def build(stages: int, microbatches: int, costs: CostModel, chunks: int = 2) -> Schedule:
    """DualPipeV on ``stages`` ranks (2 stages each, V placement) for ``microbatches`` ≥ 2·ranks."""
    if microbatches < 2 * stages:
        raise ScheduleError(
            f"dualpipe-v needs at least 2·ranks = {2 * stages} microbatches to fill its V, got "
            f"{microbatches}; raise the microbatch count or use zb-v"
        )
    programs, pairs = [], []
    for rank in range(stages):
        ops, rank_pairs = rank_program(rank, stages, microbatches)
        programs.append(ops)
        pairs += rank_pairs
    return Schedule("dualpipe-v", Placement.vshape(stages), microbatches, programs, overlapped=pairs)
