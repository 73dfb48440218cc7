"""1F1B (PipeDream-Flush): warm up with p−1−r forwards, then alternate one forward and one fused
backward, then drain the backwards.

Same bubble as GPipe, (p−1)(T_F+T_B+T_W), but at most p microbatches in flight (peak p·M_B).
"""

from __future__ import annotations

from ..costs import CostModel
from ..ir import BW, F, Op, Placement, Schedule


def rank_program(rank: int, stages: int, microbatches: int) -> list[Op]:
    """The 1F1B program of one rank of a ``stages``-deep pipeline."""
    warmup = min(stages - 1 - rank, microbatches)
    program = [F(rank, j) for j in range(warmup)]
    for j in range(microbatches - warmup):
        program += [F(rank, warmup + j), BW(rank, j)]
    program += [BW(rank, j) for j in range(microbatches - warmup, microbatches)]
    return program


def build(stages: int, microbatches: int, costs: CostModel, chunks: int = 1) -> Schedule:
    """1F1B for ``stages`` ranks, one stage each."""
    programs = [rank_program(rank, stages, microbatches) for rank in range(stages)]
    return Schedule("1f1b", Placement.loop(stages), microbatches, programs)
