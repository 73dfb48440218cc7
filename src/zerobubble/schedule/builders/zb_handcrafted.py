"""The paper's two handcrafted zero-bubble schedules, ZB-H1 and ZB-H2 (Qi et al., 2024, §2).

Both split the backward into B and W and use W to fill the idle time 1F1B leaves.  ZB-H1 keeps
1F1B's warm-up and its p·M_B peak, holding back the first ``r`` W ops of rank ``r`` for the
cool-down; ZB-H2 doubles the warm-up (peak (2p−1)·M_B) and holds back ``2r``.  Their closed-form
bubbles, the effect of transfer time and the small-``m`` behaviour are derived in
``docs/schedulers.md``.
"""

from __future__ import annotations

from ..costs import CostModel
from ..ir import B, F, Op, Placement, Schedule, ScheduleError, W


def rank_program(rank: int, stages: int, microbatches: int, depth: int) -> list[Op]:
    """One rank's program of the ZB-H family; ``depth`` 1 is ZB-H1, 2 is ZB-H2.

    Rank ``r`` warms up with ``depth·(p−1−r)`` forwards, then for each microbatch ``i`` runs the
    next forward (while any is left) and ``B(i)``, followed by the oldest pending W once
    ``i ≥ depth·r`` (the W ops it skipped before fill the cool-down), and finally the rest of the W.
    """
    warmup = min(depth * (stages - 1 - rank), microbatches)
    program = [F(rank, j) for j in range(warmup)]
    next_w = 0
    for i in range(microbatches):
        if warmup + i < microbatches:
            program.append(F(rank, warmup + i))
        program.append(B(rank, i))
        if i >= depth * rank:
            program.append(W(rank, next_w))
            next_w += 1
    program += [W(rank, j) for j in range(next_w, microbatches)]
    return program


def _build(name: str, depth: int, stages: int, microbatches: int, chunks: int) -> Schedule:
    if chunks != 1:
        raise ScheduleError(f"{name} runs one stage per rank; it cannot take chunks={chunks}")
    programs = [rank_program(rank, stages, microbatches, depth) for rank in range(stages)]
    return Schedule(name, Placement.loop(stages), microbatches, programs, {"warmup_depth": depth})


def build_h1(stages: int, microbatches: int, costs: CostModel | None = None, chunks: int = 1) -> Schedule:
    """ZB-H1: 1F1B's memory (``p·M_B``), W ops postponed into the cool-down bubbles."""
    return _build("zb-h1", 1, stages, microbatches, chunks)


def build_h2(stages: int, microbatches: int, costs: CostModel | None = None, chunks: int = 1) -> Schedule:
    """ZB-H2: twice 1F1B's warm-up (peak ``(2p−1)·M_B``), W fills what the forwards leave."""
    return _build("zb-h2", 2, stages, microbatches, chunks)
