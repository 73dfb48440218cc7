"""``bench schedulers``: how long the searching schedulers take to build, and how good they are.

:func:`scheduler_build_times` times building and validating each schedule at ``p`` stages and
``m`` microbatches; :func:`schedulers_against_authors` sets our V schedules beside the authors'
on the paper's Table 5 setups and :func:`gaps_to_bound` gives every schedule's distance to the lower
bound there; :func:`scheduler_grid_times` times them on issue 29's grid of
cost settings (:mod:`.cost_grid`) and compares their iteration times with the recorded baseline.
Pure schedule layer: no ranks, no torch.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Sequence
from pathlib import Path

from zerobubble.schedule import REGISTRY, CostModel, Schedule, build_schedule, simulate

from . import Benchmark
from .cost_grid import (
    BASELINE_PATH,
    DEFAULT_GRID,
    GRID_SCHEDULES,
    GridSetting,
    Measured,
    cost_grid,
    load_baseline,
    measure,
)
from .tables import Table, median

#: The builders ``zerobubble bench schedulers`` times by default.
BENCH_SCHEDULERS = ("zb-1p", "zb-2p", "zb-v", "v-half", "v-min")


def scheduler_build_times(
    stages: int = 32,
    microbatches: int = 256,
    rounds: int = 3,
    schedules: Sequence[str] = BENCH_SCHEDULERS,
    costs: CostModel | None = None,
) -> Table:
    """Wall time of building each schedule (median over ``rounds``, rotating order), and of
    validating it, with the iteration time and bubble rate of what was built.

    ``costs`` defaults to the paper's profiled 28.3B costs (Table 5), the setup of the speed goal.
    """
    from zerobubble.schedule import validate_schedule
    from zerobubble.schedule.paper import paper_setup

    if costs is None:
        costs = paper_setup("28.3B").costs
    build: dict[str, list[float]] = {name: [] for name in schedules}
    check: dict[str, list[float]] = {name: [] for name in schedules}
    results: dict[str, tuple[float, float, str]] = {}
    for round_index in range(rounds):
        shift = round_index % len(schedules)
        for name in [*schedules[shift:], *schedules[:shift]]:
            gc.collect()  # the previous schedule's garbage is not this one's cost
            started = time.perf_counter()
            schedule = build_schedule(name, stages, microbatches, costs, validate=False)
            build[name].append(time.perf_counter() - started)
            started = time.perf_counter()
            timeline = validate_schedule(schedule, REGISTRY[name].resolve_costs(costs, stages))
            check[name].append(time.perf_counter() - started)
            variant = str(schedule.meta.get("variant", ""))
            results[name] = (timeline.iteration_time, timeline.bubble_rate, variant)
            del schedule, timeline
    table = Table(
        f"Build time of the schedulers, p = {stages}, m = {microbatches}",
        ["schedule", "build (s, median)", "validate (s, median)", "iteration time", "bubble", "winner"],
    )
    for name in schedules:
        iteration_time, bubble_rate, variant = results[name]
        table.rows.append(
            [
                name,
                f"{median(build[name]):.3f}",
                f"{median(check[name]):.3f}",
                f"{iteration_time:.6g}",
                f"{bubble_rate:.4f}",
                variant,
            ]
        )
    table.notes.append(
        f"{rounds} rounds in rotating order; build = `build_schedule(..., validate=False)`; "
        "validate = `validate_schedule` of the result."
    )
    return table


def schedulers_against_authors(*, polish_seconds: float | None = None) -> Table:
    """Our zb-v, v-half and v-min against the authors' own schedulers on the paper's Table 5
    setups: iteration time over theirs (< 1 is faster) and both bubble rates; with
    ``polish_seconds`` also each schedule polished by CP-SAT for that long, and the solver's verdict."""
    from zerobubble.schedule.paper import authors_reference, paper_rows

    names = ("zb-v", "v-half", "v-min")
    references = {name: authors_reference(name) for name in names}
    columns = ["setup"]
    for name in names:
        columns += [f"{name} ours / theirs", f"{name} bubble ours (theirs)"]
        if polish_seconds is not None:
            columns.append(f"{name} polished / theirs")
    title = "Our V schedules against the authors' on the paper's Table 5 setups"
    table = Table(title + (f", polished for {polish_seconds:g} s" if polish_seconds else ""), columns)
    for row in paper_rows():
        p, m, costs = row.stages, row.microbatches, row.costs
        cells = [f"{row.model} p{p} m{m}"]
        for name in names:
            built = build_schedule(name, p, m, costs)
            timeline = simulate(built, costs)
            theirs = references[name][(row.model, m)]
            ideal = timeline.ideal
            cells += [
                f"{timeline.iteration_time / theirs:.4f}",
                f"{timeline.bubble_rate:.4f} ({1 - ideal / theirs:.4f})",
            ]
            if polish_seconds is not None:
                cells.append(_polished_cell(built, costs, polish_seconds, theirs))
        table.rows.append(cells)
    table.notes.append(
        "Theirs: the authors' public ZB-V heuristic, and their V-Half / V-Min orders timed by our "
        "simulator, under the same costs and memory limits (`src/zerobubble/data/authors_*.json`)."
    )
    if polish_seconds is not None:
        table.notes.append(
            "Polished: ours with its last ops reordered by CP-SAT (`polish_schedule`: ~40 per rank, "
            "doubled while the solver proves the freed ops' order optimal), replayed and validated, "
            "never above our peak memory; * = the last window's order is proven optimal given the ops "
            "before it. The limit is wall-clock on all cores, so unproven cells vary a little "
            "between runs and with the machine's load."
        )
    return table


def _polished_cell(schedule: Schedule, costs: CostModel, seconds: float, theirs: float) -> str:
    from zerobubble.schedule import polish_schedule

    report = polish_schedule(schedule, costs, seconds=seconds).meta["polish"]
    return f"{report['after'] / theirs:.5f}" + ("*" if report["status"] == "OPTIMAL" else "")


def gaps_to_bound(schedules: Sequence[str] = BENCH_SCHEDULERS) -> Table:
    """Each schedule's gap to the best lower bound known for its placement and memory on the paper's
    Table 5 setups, as ``zerobubble compare --paper-model MODEL -m M`` prints it (``*``: proven optimal)."""
    from zerobubble.schedule.compare import compare_schedules
    from zerobubble.schedule.paper import paper_rows

    table = Table("Gap to the lower bound on the paper's Table 5 setups", ["setup", *schedules])
    for row in paper_rows():
        gaps = {r.schedule: r for r in compare_schedules(row.stages, row.microbatches, row.costs, schedules)}
        cells = [f"{row.model} p{row.stages} m{row.microbatches}"]
        for name in schedules:
            found = gaps[name]
            if found.gap_to_bound is None:
                cells.append("-")
                continue
            # the analytic bound may sit a float rounding above an optimal schedule: 0, as compare shows
            cells.append(f"{max(found.gap_to_bound, 0.0) * 100:.2f}%" + ("*" if found.optimal else ""))
        table.rows.append(cells)
    table.notes.append(
        "Gap = iteration time over the best lower bound known for the schedule's placement at its own "
        "peak memory (`zerobubble/schedule/bounds.py`), minus 1."
    )
    return table


#: Issue 29's goals for build plus validation at p = 32, m = 256 (seconds, median over the grid;
#: the worst setting may take twice as long).
BUILD_GOALS = {"zb-1p": 0.25, "zb-2p": 0.25, "zb-v": 0.25, "v-half": 0.5, "v-min": 0.5}


def scheduler_grid_times(
    *,
    stages: int = DEFAULT_GRID["stages"],
    microbatches: int = DEFAULT_GRID["microbatches"],
    settings: int = DEFAULT_GRID["count"],
    seed: int = DEFAULT_GRID["seed"],
    rounds: int = 5,
    schedules: Sequence[str] = tuple(GRID_SCHEDULES),
    baseline: Path | None = BASELINE_PATH,
) -> Table:
    """Build (and validate) every schedule on the first ``settings`` settings of the cost grid,
    ``rounds`` times in rotating order, and report per schedule the median and the worst setting
    of the per-setting medians, and the iteration time against ``baseline`` (when it records
    this grid)."""
    grid = cost_grid(stages=stages, count=settings, seed=seed)
    runs: dict[str, list[list[Measured]]] = {name: [[] for _ in grid] for name in schedules}
    # rounds outermost: a burst of other load hits one round of many settings, not every round of one
    for round_index in range(rounds):
        for setting in grid:
            shift = (round_index + setting.index) % len(schedules)
            for name in [*schedules[shift:], *schedules[:shift]]:
                measured = measure(setting, name, stages=stages, microbatches=microbatches)
                runs[name][setting.index].append(measured)
    recorded = _recorded_times(baseline, stages=stages, microbatches=microbatches, seed=seed, count=settings)
    table = Table(
        f"Build time on the cost grid, p = {stages}, m = {microbatches}, {settings} settings",
        [
            "schedule",
            "goal (s)",
            "build (s)",
            "validate (s)",
            "build + validate (s)",
            "worst (s)",
            "worst setting",
            "CPU (s, median, worst)",
            "iteration / baseline (median, worst)",
        ],
    )
    for name in schedules:
        table.rows.append(_grid_row(name, runs[name], grid, recorded.get(name)))
    table.notes.append(
        f"Per setting the median of {rounds} rounds over the whole grid (rotating order); the "
        "columns are the median over the settings, `worst` the slowest setting's build + validate; "
        "CPU: the process's CPU time of build + validate (other jobs inflate the wall clock more). "
        "Grid (seed "
        f"{seed}): T_B/T_F 0.8–1.5, T_W/T_F 0.3–1.2, T_comm 0–10 % of T_F, M_W/M_B 0–1, per-rank "
        "costs ±30 %, memory limit 1p–3p·M_B (zb-1p and zb-2p keep their own)."
    )
    if not recorded:
        table.notes.append("No recorded baseline for this grid: the iteration-time ratios are not shown.")
    return table


def _recorded_times(
    path: Path | None, *, stages: int, microbatches: int, seed: int, count: int
) -> dict[str, list[float]]:
    """The baseline's iteration times when ``path`` records this grid (or a longer one), else {}."""
    if path is None or not path.exists():
        return {}
    grid, times = load_baseline(path)
    same = (grid["stages"], grid["microbatches"], grid["seed"]) == (stages, microbatches, seed)
    return times if same and grid["count"] >= count else {}


def _grid_row(
    name: str, runs: list[list[Measured]], grid: Sequence[GridSetting], recorded: list[float] | None
) -> list[str]:
    total = [median([r.total_s for r in setting_runs]) for setting_runs in runs]
    cpu = [median([r.cpu_s for r in setting_runs]) for setting_runs in runs]
    worst = max(range(len(grid)), key=total.__getitem__)
    goal = BUILD_GOALS.get(name)
    ratio_cell = "–"
    if recorded is not None:
        ratios = [setting_runs[0].iteration_time / recorded[i] for i, setting_runs in enumerate(runs)]
        ratio_cell = f"{median(ratios):.4f}, {max(ratios):.4f}"
    return [
        name,
        f"{goal:.2f}" if goal is not None else "–",
        f"{median([median([r.build_s for r in s]) for s in runs]):.3f}",
        f"{median([median([r.validate_s for r in s]) for s in runs]):.3f}",
        f"{median(total):.3f}",
        f"{total[worst]:.3f}",
        f"#{worst}: {grid[worst].label}",
        f"{median(cpu):.3f}, {max(cpu):.3f}",
        ratio_cell,
    ]


# ---- the ``zerobubble bench schedulers`` command ----


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``zerobubble bench schedulers``."""
    parser.add_argument("--stages", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of interleaved measurements")
    parser.add_argument("--schedules", nargs="+", default=list(BENCH_SCHEDULERS))
    parser.add_argument(
        "--table5",
        action="store_true",
        help="also compare zb-v, v-half, v-min with the authors' on Table 5, and print the gaps to the "
        "lower bound there",
    )
    parser.add_argument(
        "--polish",
        type=float,
        metavar="SECONDS",
        help="with --table5: also polish each V schedule with CP-SAT for SECONDS (zerobubble[solver])",
    )
    parser.add_argument(
        "--grid",
        action="store_true",
        help="time the schedulers on issue 29's grid of cost settings instead (with zb-auto)",
    )
    parser.add_argument(
        "--grid-settings", type=int, default=DEFAULT_GRID["count"], help="settings of the grid to build"
    )
    parser.add_argument("--grid-seed", type=int, default=DEFAULT_GRID["seed"])


def run(args: argparse.Namespace) -> list[Table]:
    """``zerobubble bench schedulers``: the build times (with ``--grid`` on the cost grid), and with
    ``--table5`` the authors' comparison and the gaps to the lower bound."""
    if args.grid:
        schedules = args.schedules if args.schedules != list(BENCH_SCHEDULERS) else list(GRID_SCHEDULES)
        table = scheduler_grid_times(
            stages=args.stages,
            microbatches=args.microbatches,
            settings=args.grid_settings,
            seed=args.grid_seed,
            rounds=args.rounds,
            schedules=schedules,
        )
        results = [table]
    else:
        results = [scheduler_build_times(args.stages, args.microbatches, args.rounds, args.schedules)]
    if args.table5:
        results.append(schedulers_against_authors(polish_seconds=args.polish))
        results.append(gaps_to_bound())
    return results


BENCHMARK = Benchmark("schedulers", "build time of the searching schedulers", add_arguments, run)
