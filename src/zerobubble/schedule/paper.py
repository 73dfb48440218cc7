"""The paper's profiled setups (arXiv 2401.10241, Tables 3, 5 and 9), shipped with the package.

:func:`paper_setup` turns a model name and microbatch count into the stage count, costs, memory and
interleaving the paper used, so ``compare --paper-model 1.5B`` reproduces its comparisons.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from .costs import CostModel
from .ir import ScheduleError

__all__ = [
    "PaperSetup",
    "authors_reference",
    "authors_reference_source",
    "paper_models",
    "paper_rows",
    "paper_setup",
]


@dataclass(frozen=True)
class PaperSetup:
    """One row of the paper's tables: a model on ``stages`` ranks with ``microbatches`` microbatches."""

    model: str
    stages: int
    microbatches: int
    costs: CostModel
    interleaved_chunks: int
    bubble_rates: dict[str, float]
    exact_row: bool


@lru_cache(maxsize=1)
def _rows() -> tuple[dict[str, Any], ...]:
    text = resources.files("zerobubble").joinpath("data/paper_table5.json").read_text()
    return tuple(json.loads(text)["rows"])


def paper_models() -> tuple[str, ...]:
    """Names of the paper's models, e.g. ``"1.5B"``."""
    return tuple(dict.fromkeys(row["model"] for row in _rows()))


def paper_rows() -> tuple[PaperSetup, ...]:
    """Every setup of Table 5, in the table's order."""
    return tuple(_setup(row, exact=True) for row in _rows())


def paper_setup(model: str, microbatches: int | None = None) -> PaperSetup:
    """The setup of ``model`` with ``microbatches`` microbatches.

    When the table has no row for that count, the costs of the model's first row are used (the
    profiled costs barely change with the count) and ``exact_row`` is False.
    """
    rows = [row for row in _rows() if row["model"].lower() == model.lower()]
    if not rows:
        raise ScheduleError(f"unknown paper model {model!r}; known: {', '.join(paper_models())}")
    chosen = next((row for row in rows if row["microbatches"] == microbatches), None)
    if chosen is not None or microbatches is None:
        return _setup(chosen or rows[0], exact=True)
    setup = _setup(rows[0], exact=False)
    return PaperSetup(
        setup.model, setup.stages, microbatches, setup.costs, setup.interleaved_chunks, {}, False
    )


def row_costs(row: Mapping[str, Any]) -> CostModel:
    """The cost model of one row of the shipped Table 5 (its profiled times and memory, no limit)."""
    return CostModel(
        f=row["cost_f"],
        b=row["cost_b"],
        w=row["cost_w"],
        comm=row["cost_comm"],
        mem_b=row["mem_b"],
        mem_w=row["mem_w"],
    )


def _setup(row: dict[str, Any], exact: bool) -> PaperSetup:
    costs = row_costs(row)
    return PaperSetup(
        row["model"],
        row["stages"],
        row["microbatches"],
        costs,
        row["interleaved_chunks"],
        dict(row["bubble_rate"]),
        exact,
    )


# The authors' own schedulers on the Table 5 setups: file and field of each schedule's iteration time.
_AUTHORS_FILES = {
    "zb-v": ("data/authors_zbv_table5.json", "zbv_iteration_time"),
    "v-half": ("data/authors_vhalf_vmin_table5.json", "vhalf"),
    "v-min": ("data/authors_vhalf_vmin_table5.json", "vmin"),
}


@lru_cache(maxsize=4)
def _authors_file(path: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(resources.files("zerobubble").joinpath(path).read_text())
    return data


def _authors_entry(schedule: str) -> tuple[str, str]:
    try:
        return _AUTHORS_FILES[schedule]
    except KeyError:
        raise ScheduleError(
            f"no reference from the authors for {schedule!r}; known: {', '.join(_AUTHORS_FILES)}"
        ) from None


def authors_reference(schedule: str) -> dict[tuple[str, int], float]:
    """Iteration time of the authors' own ``schedule`` ("zb-v", "v-half", "v-min") on each Table 5
    setup, keyed by ``(model, microbatches)``, in the unit of the paper's costs."""
    path, field = _authors_entry(schedule)
    return {
        (row["model"], int(row.get("microbatches", row.get("m")))): float(row[field])
        for row in _authors_file(path)["rows"]
    }


def authors_reference_source(schedule: str) -> str:
    """How the authors' reference for ``schedule`` was made (the data file's ``source`` field)."""
    return str(_authors_file(_authors_entry(schedule)[0])["source"])
