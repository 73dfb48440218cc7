"""The paper's two handcrafted zero-bubble schedules, ZB-H1 and ZB-H2 (Qi et al., 2024, §2).

Both split the backward into B (input gradient, which the previous stage waits for) and W (weight
gradient, which nobody waits for) and use W to fill the idle time 1F1B leaves.

* **ZB-H1** keeps 1F1B's warm-up of ``p−1−r`` forwards on rank ``r`` but holds back the first ``r``
  W ops; they run in the cool-down where 1F1B idles.  Peak memory stays ``p·M_B`` (rank ``i``,
  1-indexed: ``(p−i+1)·M_B + (i−1)·M_W``) and, with ``T_comm = 0``, the makespan bubble shrinks from
  ``(p−1)(T_F+T_B+T_W)`` to ``(p−1)(T_F+T_B−T_W)``.
* **ZB-H2** doubles the warm-up to ``2(p−1−r)`` forwards so the warm-up bubble fills with forwards,
  and holds back the first ``2r`` W ops for the cool-down.  Peak memory is ``(2p−1)·M_B``; with
  ``T_comm = 0`` the iteration-time bubble is ``(p−1)(T_F+T_B−2T_W)`` while that is ≥ 0.

Those closed forms hold with ``T_comm = 0`` when ``T_W ≤ min(T_F, T_B)`` (the paper's setting) and
``m ≥ p`` (ZB-H1) or ``m ≥ 2p−1`` (ZB-H2).  With transfer time ZB-H2's bubble becomes
``(p−1)(T_F+T_B+2T_comm−2T_W)`` (the figure the paper's Table 5 uses); ZB-H1's grows by at least
``2(p−1)T_comm`` because its cool-down waits on the transfers.

Small microbatch counts: the warm-up is capped at ``m``.  With ``m ≤ p−1−r`` (ZB-H1) or
``m ≤ 2(p−1−r)`` (ZB-H2) a rank runs all its forwards first, then all its B ops, and holds back only
the W ops its threshold asks for (the rest follow their B directly), i.e. the schedule becomes
GPipe with split backwards; it stays valid for every ``m ≥ 1`` and its peak memory never exceeds the
figures above.
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
