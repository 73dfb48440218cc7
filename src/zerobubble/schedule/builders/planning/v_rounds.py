"""ZB-V's round planner: every round each rank takes one backward, then one forward.

:class:`RoundPlanner` runs one :class:`RoundVariant` on the shared planning core (:mod:`.core`);
:mod:`..zb_v` tries :data:`ZB_V_ROUND_VARIANTS` among its candidates.  The op-class table below is
shared with the V greedy (:mod:`.v_greedy`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...costs import StageCosts, within_limit
from .core import PlanState, Stuck

_TOLERANCE = 1e-9

# Op classes a rank chooses between; chunk 0 is stage r, chunk 1 is stage 2p-1-r.
_F0, _F1, _B0, _B1 = "F0", "F1", "B0", "B1"

# Op classes by index: the forward and backward of chunk 0 (stage r) and chunk 1 (stage 2p-1-r).
_CLASSES = (_F0, _F1, _B0, _B1)
_CHUNK = (0, 1, 0, 1)
_IS_FORWARD = (True, True, False, False)


@dataclass(frozen=True)
class RoundVariant:
    """One variant of the round-based V planner (:class:`RoundPlanner`).

    * ``warmup_share`` — warm-up forwards of chunk 0 stop once a rank's memory would pass this share
      of its limit, leaving the rest for chunk-1 activations and for W ops kept for the cool-down.
    * ``b0_first`` — when both backwards are ready in a round, run chunk 0's (else chunk 1's).
    * ``reserve`` — chunk-1 activations a new chunk-0 forward leaves room for.
    """

    warmup_share: float = 0.5
    b0_first: bool = False
    reserve: int = 1

    @property
    def label(self) -> str:
        """A short name for ``Schedule.meta["variant"]``."""
        first = "b0first" if self.b0_first else "b1first"
        return f"rounds-{self.warmup_share:g}-{first}-reserve{self.reserve}"


# Round-planner candidates for ZB-V, most often best first.
ZB_V_ROUND_VARIANTS: tuple[RoundVariant, ...] = (
    RoundVariant(0.5, False, 1),
    RoundVariant(0.5, True, 2),
    RoundVariant(0.6, True, 1),
)


class RoundPlanner:
    """Round-based V planner: every round each rank takes one backward, then one forward.

    A 1F1B-like rhythm on both chunks keeps independent work on every rank, which hides transfer
    time.  Choices in a phase see only ops placed in earlier phases, so an input chain advances one
    hop per round instead of making ranks wait for a whole chain.  The warm-up runs chunk-0 forwards
    on ranks ``0..r`` until rank ``r``'s chunk-1 input arrives (within ``warmup_share`` of memory).
    W ops fill every gap they fit, shorter gaps only when waiting would make the rank the idlest
    (always before a backward), and run whenever memory requires.
    """

    def __init__(self, costs: StageCosts, microbatches: int, variant: RoundVariant):
        self.state = PlanState(costs, microbatches)
        self.m, self.variant = microbatches, variant
        self.p, self.S = self.state.p, self.state.S
        self.count = [[0, 0, 0, 0] for _ in range(self.p)]  # ops placed per class F0, F1, B0, B1

    def _stage(self, rank: int, k: int) -> int:
        return rank if _CHUNK[k] == 0 else self.S - 1 - rank

    def _ready(self, rank: int, k: int) -> float | None:
        """Arrival of class ``k``'s next input, or None when nothing is due or it is not placed yet."""
        done = self.count[rank]
        j, stage = done[k], self._stage(rank, k)
        if _IS_FORWARD[k]:
            if j >= self.m or (k == 1 and j >= done[0]):
                return None
            arrival = self.state.forward_arrival(stage, j)
        else:
            if j >= done[k - 2]:
                return None
            arrival = self.state.backward_arrival(stage, j)
        return arrival if arrival >= 0 else None

    def _put(self, rank: int, k: int) -> None:
        j, stage = self.count[rank][k], self._stage(rank, k)
        if _IS_FORWARD[k]:
            self.state.put_forward(rank, stage, j)
        else:
            self.state.put_backward(rank, stage, j)
        self.count[rank][k] = j + 1

    def _fill_gap(self, rank: int, ready: float, fill_short: bool) -> None:
        state = self.state
        state.fill_gap(rank, ready, share=1 - _TOLERANCE)
        gap = ready - state.clock[rank]
        if (
            fill_short
            and state.has_weight(rank)
            and gap > _TOLERANCE
            and gap > state.max_idle - state.idle[rank]
        ):
            state.put_weight(rank)

    def _warm_up(self) -> None:
        state, p = self.state, self.p
        mem_b, f = state.mem_b, state.f
        share = self.variant.warmup_share
        for rank in range(p):
            self._put(rank, 0)
        for rank in range(p - 1, -1, -1):
            arrival = self._ready(rank, 1) if rank < p - 1 else None
            while arrival is not None and state.clock[rank] + f[rank] <= arrival * (1 + _TOLERANCE):
                upstream = range(rank + 1)
                if any(self.count[q][0] >= self.m for q in upstream):
                    break
                if not all(
                    within_limit(
                        state.memory[q] + mem_b[q] + mem_b[self._stage(q, 1)], share * state.limit[q]
                    )
                    for q in upstream
                ):
                    break
                for q in upstream:
                    self._put(q, 0)
            state.make_room(rank, mem_b[self._stage(rank, 1)])
            self._put(rank, 1)

    def _backward_round(self) -> int:
        order = (2, 3) if self.variant.b0_first else (3, 2)
        choices = []
        for rank in range(self.p):
            for k in order:
                ready = self._ready(rank, k)
                if ready is not None:
                    choices.append((rank, k, ready))
                    break
        state = self.state
        for rank, k, ready in choices:
            stage = self._stage(rank, k)
            growth = state.mem_w[stage] - state.mem_b[stage]
            if growth > 0:
                state.make_room(rank, growth)
            self._fill_gap(rank, ready, fill_short=True)
            self._put(rank, k)
        return len(choices)

    def _forward_round(self) -> int:
        state = self.state
        mem_b = state.mem_b
        choices = []
        for rank in range(self.p):
            k = 1 if self._ready(rank, 1) is not None else 0
            ready = self._ready(rank, k)
            if ready is None:
                continue
            need = mem_b[self._stage(rank, k)]
            if k == 0:
                done = self.count[rank]
                need += min(self.variant.reserve, done[0] + 1 - done[1]) * mem_b[self._stage(rank, 1)]
            if state.can_make_room(rank, need):
                choices.append((rank, need, k, ready))
        for rank, need, k, ready in choices:
            state.make_room(rank, need)
            self._fill_gap(rank, ready, fill_short=False)
            self._put(rank, k)
        return len(choices)

    def run(self, bound: float = math.inf) -> PlanState | None:
        """The plan, or None when this variant gets stuck or cannot beat ``bound``."""
        state = self.state
        try:
            self._warm_up()
            remaining = 4 * self.m * self.p - sum(map(sum, self.count))
            while remaining:
                placed = self._backward_round() + self._forward_round()
                if not placed:
                    raise Stuck
                remaining -= placed
                if any(state.cannot_beat(rank, bound) for rank in range(self.p)):
                    return None
            for rank in range(self.p):
                state.drain(rank)
        except Stuck:
            return None
        return state
