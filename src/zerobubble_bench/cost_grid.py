"""The cost grid of issue 29: seeded cost settings off the paper's, for build time and search quality.

:func:`cost_grid` draws ``count`` settings from one seed (the same seed gives the same grid on every
machine): per setting the mean ratios T_B/T_F in 0.8–1.5, T_W/T_F in 0.3–1.2, T_comm/T_F in 0–0.1
and M_W/M_B in 0–1, each rank's F, B, W, M_B and M_W varying by up to ±30 % around them (the spread
itself drawn per setting, so some settings are near uniform), and a memory limit of 1p–3p·M_B.
:data:`GRID_SCHEDULES` says how each schedule takes the limit: zb-1p and zb-2p have their own by
name, the others plan under the setting's limit (v-half and v-min under the smaller of it and their
own).

:func:`measure` builds and validates one schedule on one setting; :func:`record_baseline` and
:func:`load_baseline` keep those iteration times in a JSON file, so a change to the builders can be
checked against what they built before (``benchmarks/data/schedulers_grid_baseline.json``).
"""

from __future__ import annotations

import gc
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerobubble.schedule import REGISTRY, CostModel, build_schedule, validate_schedule

#: The schedules the grid builds, and whether each plans under the setting's memory limit.
GRID_SCHEDULES: dict[str, bool] = {
    "zb-1p": False,
    "zb-2p": False,
    "zb-auto": True,
    "zb-v": True,
    "v-half": True,
    "v-min": True,
}

#: The grid the baseline file records: issue 29's p = 32, m = 256, 60 settings from seed 29.
DEFAULT_GRID = {"stages": 32, "microbatches": 256, "count": 60, "seed": 29}

#: Where the recorded iteration times live (in the repository, beside the benchmark scripts).
BASELINE_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "schedulers_grid_baseline.json"


@dataclass(frozen=True)
class GridSetting:
    """One cost setting of the grid: its costs (memory limit included) and a short description."""

    index: int
    costs: CostModel
    label: str

    def costs_for(self, schedule: str) -> CostModel:
        """The costs ``schedule`` is built with: the limit only where it plans under one."""
        return self.costs if GRID_SCHEDULES.get(schedule, True) else self.costs.with_memory_limit(None)


def _draw_setting(rng: random.Random, index: int, stages: int) -> GridSetting:
    b_ratio = rng.uniform(0.8, 1.5)
    w_ratio = rng.uniform(0.3, 1.2)
    comm_ratio = rng.uniform(0.0, 0.1)
    mem_ratio = rng.uniform(0.0, 1.0)
    limit_factor = round(rng.uniform(1.0, 3.0), 2)
    spread = rng.uniform(0.0, 0.3)

    def per_rank(mean: float) -> list[float]:
        return [round(mean * rng.uniform(1 - spread, 1 + spread), 3) for _ in range(stages)]

    f, b, w = per_rank(1000.0), per_rank(1000.0 * b_ratio), per_rank(1000.0 * w_ratio)
    mem_b = per_rank(5.0)
    # M_W ≤ M_B on every rank: B keeps a share of what F allocated
    mem_w = [round(mb * min(1.0, mem_ratio * rng.uniform(1 - spread, 1 + spread)), 4) for mb in mem_b]
    costs = CostModel(f=f, b=b, w=w, comm=round(1000.0 * comm_ratio, 3), mem_b=mem_b, mem_w=mem_w)
    costs = costs.apply_memory_limit(f"{limit_factor}p", stages)
    label = (
        f"B/F {b_ratio:.2f} W/F {w_ratio:.2f} comm {comm_ratio:.3f} MW/MB {mem_ratio:.2f} "
        f"±{spread:.0%} limit {limit_factor}p"
    )
    return GridSetting(index, costs, label)


def cost_grid(*, stages: int, count: int, seed: int) -> list[GridSetting]:
    """``count`` settings for ``stages`` ranks drawn from ``seed`` (see the module docstring)."""
    rng = random.Random(seed)
    return [_draw_setting(rng, index, stages) for index in range(count)]


@dataclass(frozen=True)
class Measured:
    """One schedule built on one setting: seconds to build and to validate (wall clock, and the
    process's CPU time: on a machine other jobs load, the closer to what an idle one would show),
    and its iteration time."""

    build_s: float
    validate_s: float
    cpu_s: float
    iteration_time: float

    @property
    def total_s(self) -> float:
        """What ``build_schedule`` costs a user (it validates what it builds)."""
        return self.build_s + self.validate_s


def measure(setting: GridSetting, name: str, *, stages: int, microbatches: int) -> Measured:
    """Build ``name`` on ``setting`` (timed), then validate it (timed) and read its iteration time."""
    costs = setting.costs_for(name)
    gc.collect()  # the previous build's garbage is not this one's cost
    cpu_started, started = time.process_time(), time.perf_counter()
    schedule = build_schedule(name, stages, microbatches, costs, validate=False)
    built = time.perf_counter()
    timeline = validate_schedule(schedule, REGISTRY[name].resolve_costs(costs, stages))
    done = time.perf_counter()
    cpu = time.process_time() - cpu_started
    return Measured(built - started, done - built, cpu, timeline.iteration_time)


def record_baseline(
    path: Path, grid: dict[str, int], schedules: Sequence[str] = tuple(GRID_SCHEDULES)
) -> None:
    """Build every schedule once on every setting of ``grid`` and write the results as JSON: the
    grid's parameters, the iteration times and (one noisy round, for reference) the seconds."""
    stages, microbatches = grid["stages"], grid["microbatches"]
    settings = cost_grid(stages=stages, count=grid["count"], seed=grid["seed"])
    results = {
        name: [measure(setting, name, stages=stages, microbatches=microbatches) for setting in settings]
        for name in schedules
    }
    data = {
        "grid": grid,
        "iteration_time": {name: [r.iteration_time for r in runs] for name, runs in results.items()},
        "build_s": {name: [round(r.build_s, 4) for r in runs] for name, runs in results.items()},
        "validate_s": {name: [round(r.validate_s, 4) for r in runs] for name, runs in results.items()},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def load_baseline(path: Path) -> tuple[dict[str, int], dict[str, list[float]]]:
    """The grid parameters and iteration times :func:`record_baseline` wrote."""
    data: dict[str, Any] = json.loads(path.read_text())
    return dict(data["grid"]), {
        name: list(map(float, times)) for name, times in data["iteration_time"].items()
    }
