"""GPipe (Huang et al., 2019): every forward first, then every fused backward.

Simple and bubble-heavy: (p−1)(T_F+T_B+T_W) idle per rank, and all m microbatches' activations
alive at once (peak m·M_B).
"""

from __future__ import annotations

from ..costs import CostModel
from ..ir import BW, F, Placement, Schedule


def build(stages: int, microbatches: int, costs: CostModel, chunks: int = 1) -> Schedule:
    """GPipe for ``stages`` ranks, one stage each."""
    programs = [
        [F(rank, j) for j in range(microbatches)] + [BW(rank, j) for j in range(microbatches)]
        for rank in range(stages)
    ]
    return Schedule("gpipe", Placement.loop(stages), microbatches, programs)
