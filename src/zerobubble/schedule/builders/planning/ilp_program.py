"""The pieces of zb-ilp's integer program: sparse rows, the formulated program and order helpers.

:class:`Rows` collects constraint rows, :class:`Program` is one formulated program solved by HiGHS
(``scipy.optimize.milp``); the helpers work on a rank's precedence matrix in the local numbering
``F_j = j, B_j = m + j, W_j = 2m + j``.  Used by :mod:`..zb_ilp` (the model and the build).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from ...ir import Kind, Op

#: The 0/1 variable of "op u before op v" on a rank, keyed by ``(rank, u, v)``.
PairIndex = dict[tuple[int, int, int], int]

#: The relative MIP gap HiGHS stops at (and the slack of "proven optimal").
RELATIVE_GAP = 1e-6


@dataclass(frozen=True)
class Program:
    """A formulated program: objective, integrality, variable bounds, rows, binary variables."""

    objective: np.ndarray
    integrality: np.ndarray
    bounds: Bounds
    constraints: LinearConstraint | None
    pair_index: PairIndex

    def run(self, integrality: np.ndarray, time_limit: float) -> Any:
        """Solve with HiGHS under ``integrality`` (all zeros for the relaxation)."""
        return milp(
            self.objective,
            integrality=integrality,
            bounds=self.bounds,
            constraints=[self.constraints] if self.constraints is not None else None,
            options={"time_limit": time_limit, "mip_rel_gap": RELATIVE_GAP, "disp": False},
        )


class Rows:
    """Sparse constraint rows ``lower ≤ a·x ≤ upper`` collected before one LinearConstraint."""

    def __init__(self) -> None:
        self.row: list[int] = []
        self.col: list[int] = []
        self.val: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []

    def add(self, coefficients: dict[int, float], lower: float, upper: float) -> None:
        index = len(self.lower)
        for column, value in coefficients.items():
            if value != 0.0:
                self.row.append(index)
                self.col.append(column)
                self.val.append(value)
        self.lower.append(lower)
        self.upper.append(upper)

    def constraint(self, size: int) -> LinearConstraint | None:
        if not self.lower:
            return None
        matrix = coo_matrix((self.val, (self.row, self.col)), shape=(len(self.lower), size)).tocsr()
        return LinearConstraint(matrix, np.array(self.lower), np.array(self.upper))


def closure(order: np.ndarray) -> np.ndarray:
    """Transitive closure of a precedence matrix."""
    closed = order.copy()
    while True:
        step = closed | ((closed.astype(np.int32) @ closed.astype(np.int32)) > 0)
        if np.array_equal(step, closed):
            return closed
        closed = step


def covering_pairs(order: np.ndarray) -> list[tuple[int, int]]:
    """Precedences not implied by two others (the edges of the transitive reduction)."""
    implied = (order.astype(np.int32) @ order.astype(np.int32)) > 0
    return [(int(u), int(v)) for u, v in zip(*np.nonzero(order & ~implied))]


def local_index(op: Op, m: int) -> int:
    """Position of ``op`` in a rank's local numbering (F_j = j, B_j = m + j, W_j = 2m + j)."""
    return {Kind.F: 0, Kind.B: 1, Kind.W: 2}[op.kind] * m + op.microbatch


def structural_successors(k: int, m: int) -> tuple[int, ...]:
    """Ops that always follow local op ``k`` directly: the next of its kind, and its B or W."""
    kind, j = divmod(k, m)
    successors = [k + 1] if j + 1 < m else []
    if kind < 2:
        successors.append(k + m)
    return tuple(successors)
