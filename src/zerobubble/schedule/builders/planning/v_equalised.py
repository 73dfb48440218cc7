"""The equalised V planner: fill every rank to the memory limit, equalise, then F, B, W.

Our implementation, on :mod:`.core`, of the strategy of the ZB-V authors' public heuristic:
ranks add down forwards while they would otherwise idle for their first up input (fill), the deeper
ranks get extra forwards until all hold the same number of activations (equalise), then rounds of
one backward and one forward per rank with W ops in the gaps and whenever memory blocks the next op
(steady state), then the remaining W ops (drain).  A second pass lets ranks that idled little take
a short gap; passes repeat while the iteration time improves.  It is zb-v's first candidate.

The four phases step by step: ``docs/schedulers.md``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ...costs import StageCosts, within_limit
from .core import PlanState, Stuck


@dataclass(frozen=True)
class EqualisedVariant:
    """The choices of the equalised planner.

    ``fill_before_up_backward`` / ``fill_before_forward``: run a W in a gap shorter than a W
    before an up-stage backward / a forward when leaving the gap idle would make the rank the
    idlest (before a down-stage backward this is always done).
    """

    fill_before_up_backward: bool = True
    fill_before_forward: bool = True

    @property
    def label(self) -> str:
        """A short name for ``Schedule.meta["variant"]``."""
        return "equalised-{}-{}".format(
            "fillb" if self.fill_before_up_backward else "keepb",
            "fillf" if self.fill_before_forward else "keepf",
        )


EQUALISED_VARIANTS = tuple(EqualisedVariant(*choice) for choice in itertools.product((True, False), repeat=2))


def _makes_idlest(gap: float, idle: float, max_idle: float, approved_margin: float) -> bool:
    """Whether idling ``gap`` more takes a rank with ``idle`` past the largest idle so far (or the
    idle the largest approved one leaves it, ``approved_margin``)."""
    return gap > max(max_idle, approved_margin) - idle


class _EqualisedPass:
    """One pass of the equalised planner (all state in the instance and its :class:`PlanState`)."""

    def __init__(
        self,
        costs: StageCosts,
        microbatches: int,
        variant: EqualisedVariant,
        approved: Sequence[float] | None,
        bound: float = math.inf,
    ) -> None:
        self.plan = PlanState(costs, microbatches)
        self.variant = variant
        self.p, self.m, self.S = self.plan.p, microbatches, self.plan.S
        # ops placed per rank: down forwards, up forwards, up backwards, down backwards
        self.down_f = [0] * self.p
        self.up_f = [0] * self.p
        self.up_b = [0] * self.p
        self.down_b = [0] * self.p
        self.approved = list(approved) if approved is not None else [0.0] * self.p
        self.max_approved = max(self.approved)
        self.bound = bound
        # Every question asked of the approved idle times: (rank, gap, the rank's idle, the largest
        # idle then).  Replaying them with other approved times tells whether a pass under those
        # would decide anything differently (:meth:`repeats_with`).
        self.gap_questions: list[tuple[int, float, float, float]] = []

    def run(self) -> PlanState:
        """Plan every op (raises :class:`Stuck` when the variant cannot go on)."""
        self._fill()
        self._equalise()
        self._steady()
        for rank in range(self.p):
            self.plan.drain(rank)
        return self.plan

    # -- one op ------------------------------------------------------------------------------

    def _up(self, rank: int) -> int:
        return self.S - 1 - rank

    def _forward(self, rank: int, up: bool) -> None:
        if up:
            self.plan.put_forward(rank, self._up(rank), self.up_f[rank])
            self.up_f[rank] += 1
        else:
            self.plan.put_forward(rank, rank, self.down_f[rank])
            self.down_f[rank] += 1

    def _short_gap_worth_a_weight(self, rank: int, gap: float) -> bool:
        """Whether idling ``gap`` would make ``rank`` the idlest, counting its approved idle."""
        idle, max_idle = self.plan.idle[rank], self.plan.max_idle
        self.gap_questions.append((rank, gap, idle, max_idle))
        return _makes_idlest(gap, idle, max_idle, self.max_approved - self.approved[rank])

    def repeats_with(self, approved: Sequence[float]) -> bool:
        """Whether a pass under ``approved`` idle times would plan exactly this pass's ops.

        The approved times enter only :meth:`_short_gap_worth_a_weight`; when every answer it
        gave stays the same, the other pass takes the same decisions from the same states.
        """
        mine, most_mine = self.approved, self.max_approved
        theirs, most_theirs = list(approved), max(approved)
        return all(
            _makes_idlest(gap, idle, max_idle, most_mine - mine[rank])
            == _makes_idlest(gap, idle, max_idle, most_theirs - theirs[rank])
            for rank, gap, idle, max_idle in self.gap_questions
        )

    def _fill_wait(self, rank: int, arrival: float, short_gap: bool) -> None:
        plan = self.plan
        pending = plan.pending_w[rank]
        if not pending:
            return  # the common case in the steady state: nothing to fill the wait with
        clock, w = plan.clock, plan.w
        while pending and clock[rank] + w[pending[0]] <= arrival:  # PlanState.fill_gap, inlined
            plan.put_weight(rank)
        if short_gap and pending and self._short_gap_worth_a_weight(rank, arrival - clock[rank]):
            plan.put_weight(rank)

    # -- phases ------------------------------------------------------------------------------

    def _fill(self) -> None:
        plan, p, m = self.plan, self.p, self.m
        mem_b = plan.mem_b
        for rank in range(p):
            self._forward(rank, up=False)
        for rank in range(p - 1, -1, -1):
            if rank < p - 1:
                arrival = plan.forward_arrival(self._up(rank), 0)
                reserve = (rank + 1) * (mem_b[rank] + mem_b[self._up(rank)])
                while (
                    self.down_f[rank] < m
                    and within_limit(plan.memory[rank] + reserve, plan.limit[rank])
                    and plan.clock[rank] + plan.f[rank] <= arrival
                ):
                    for upstream in range(rank + 1):
                        self._forward(upstream, up=False)
            self._forward(rank, up=True)

    def _equalise(self) -> None:
        plan, p, m, S = self.plan, self.p, self.m, self.S
        down_f, up_f = self.down_f, self.up_f
        up = False
        for rank in range(1, p):
            idle_sweeps = 0  # consecutive sweeps that gave rank ``rank`` nothing
            while idle_sweeps < 2 and (
                down_f[rank] + up_f[rank] < down_f[rank - 1] + up_f[rank - 1]
                or up_f[rank] <= up_f[rank - 1] < m
            ):
                counts = up_f if up else down_f
                before = counts[rank]
                for deeper in range(p - 1, rank - 1, -1):
                    # With per-stage costs a sweep may find a rank full or its input not yet
                    # computed (the authors' equal-cost pattern never does): that rank skips it.
                    stage = S - 1 - deeper if up else deeper
                    if (
                        counts[deeper] < m
                        and plan.fits(deeper, plan.mem_b[stage])
                        and plan.forward_arrival(stage, counts[deeper]) >= 0
                    ):
                        self._forward(deeper, up)
                idle_sweeps = idle_sweeps + 1 if counts[rank] == before else 0
                up = not up

    def _backward_choice(self, rank: int) -> bool | None:
        """True: the down stage's backward next; False: the up stage's; None: no backward left."""
        plan = self.plan
        if self.down_b[rank] >= self.up_f[rank] and self.up_b[rank] >= self.up_f[rank]:
            return None
        if self.down_b[rank] >= self.up_b[rank]:
            return False
        if rank == self.p - 1 or self.up_b[rank] >= self.m:
            return True
        return plan.b_end[rank + 1][self.down_b[rank]] >= 0

    def _steady(self) -> None:
        plan, p, m, S = self.plan, self.p, self.m, self.S
        down_b, up_b = self.down_b, self.up_b
        fill_before_up = self.variant.fill_before_up_backward
        growth = [w - b for b, w in zip(plan.mem_b, plan.mem_w)]
        total = 2 * m * p
        placed_b = 0
        bounded = math.isfinite(self.bound)
        choose = self._backward_choice
        while placed_b < total:
            before = placed_b
            choices = [choose(rank) for rank in range(p)]
            order = [(rank, True) for rank in range(p - 1, -1, -1) if choices[rank] is True]
            order += [(rank, False) for rank in range(p) if choices[rank] is False]
            for rank, down in order:
                stage, j = (rank, down_b[rank]) if down else (S - 1 - rank, up_b[rank])
                arrival = plan.backward_arrival(stage, j)
                if arrival < 0:
                    continue
                if growth[stage] > 0:
                    plan.make_room(rank, growth[stage])
                self._fill_wait(rank, arrival, down or fill_before_up)
                plan.put_backward(rank, stage, j)
                if down:
                    down_b[rank] += 1
                else:
                    up_b[rank] += 1
                placed_b += 1
            placed_f = self._forward_round()
            if placed_b == before and not placed_f:
                raise Stuck
            if bounded and any(plan.cannot_beat(rank, self.bound) for rank in range(p)):
                raise Stuck

    def _forward_round(self) -> int:
        plan, p, m, S = self.plan, self.p, self.m, self.S
        up_f, down_f, f_end, mem_b = self.up_f, self.down_f, plan.f_end, plan.mem_b
        short_gap = self.variant.fill_before_forward
        placed = 0
        for rank in range(p):
            j_up = up_f[rank]
            if j_up >= m:
                continue
            # the up forward when its input is computed (the older chain), else the down one
            up = j_up < down_f[rank] and (rank == p - 1 or f_end[S - 2 - rank][j_up] >= 0)
            if up:
                stage, j = S - 1 - rank, j_up
            elif down_f[rank] < m:
                stage, j = rank, down_f[rank]
            else:
                continue
            arrival = plan.forward_arrival(stage, j)
            if arrival < 0:
                continue
            plan.make_room(rank, mem_b[stage])
            self._fill_wait(rank, arrival, short_gap)
            plan.put_forward(rank, stage, j)
            if up:
                up_f[rank] = j + 1
            else:
                down_f[rank] = j + 1
            placed += 1
        return placed


def equalised_plan(
    costs: StageCosts,
    microbatches: int,
    variant: EqualisedVariant,
    bound: float = math.inf,
    *,
    floor: float = 0.0,
) -> tuple[PlanState | None, int]:
    """The best plan of ``variant`` over its approval passes, and the ops placed in all passes.

    The plan is None when the variant gets stuck within the memory limit or cannot beat ``bound``
    (a pass is abandoned as soon as some rank is sure to end above the best time so far).  The
    passes stop once a plan reaches ``floor``, a lower bound on every schedule's time.
    """
    best: PlanState | None = None
    approved: list[float] | None = None
    effort = 0
    while True:
        attempt = _EqualisedPass(costs, microbatches, variant, approved, bound)
        try:
            plan = attempt.run()
        except Stuck:
            plan = None
        effort += attempt.plan.placed
        if plan is None or (best is not None and plan.iteration_time() >= best.iteration_time()):
            break
        best = plan
        if plan.iteration_time() <= floor * (1 + 1e-9):
            break  # nothing can beat it: a further pass would be wasted
        if attempt.repeats_with(plan.idle):
            break  # the next pass would plan the same ops, so it would not be better
        bound = min(bound, plan.iteration_time())
        approved = plan.idle
    return best, effort
