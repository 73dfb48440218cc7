"""``bench schedulers``: how long the searching schedulers take to build, and how good they are.

:func:`scheduler_build_times` times building and validating each schedule at ``p`` stages and
``m`` microbatches; :func:`schedulers_against_authors` sets our V schedules beside the authors'
on the paper's Table 5 setups.  Pure schedule layer: no ranks, no torch.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Sequence

from zerobubble.schedule import REGISTRY, CostModel, build_schedule, simulate

from . import Benchmark
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


def schedulers_against_authors() -> Table:
    """Our zb-v, v-half and v-min against the authors' own schedulers on the paper's Table 5
    setups: iteration time over theirs (< 1 is faster) and both bubble rates."""
    from zerobubble.schedule.paper import authors_reference, paper_rows

    names = ("zb-v", "v-half", "v-min")
    references = {name: authors_reference(name) for name in names}
    columns = ["setup"]
    for name in names:
        columns += [f"{name} ours / theirs", f"{name} bubble ours (theirs)"]
    table = Table("Our V schedules against the authors' on the paper's Table 5 setups", columns)
    for row in paper_rows():
        p, m, costs = row.stages, row.microbatches, row.costs
        cells = [f"{row.model} p{p} m{m}"]
        for name in names:
            timeline = simulate(build_schedule(name, p, m, costs), costs)
            theirs = references[name][(row.model, m)]
            ideal = timeline.ideal
            cells += [
                f"{timeline.iteration_time / theirs:.4f}",
                f"{timeline.bubble_rate:.4f} ({1 - ideal / theirs:.4f})",
            ]
        table.rows.append(cells)
    table.notes.append(
        "Theirs: the authors' public ZB-V heuristic, and their V-Half / V-Min orders timed by our "
        "simulator, under the same costs and memory limits (`src/zerobubble/data/authors_*.json`)."
    )
    return table


# ---- the ``zerobubble bench schedulers`` command ----


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``zerobubble bench schedulers``."""
    parser.add_argument("--stages", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of interleaved measurements")
    parser.add_argument("--schedules", nargs="+", default=list(BENCH_SCHEDULERS))
    parser.add_argument(
        "--table5", action="store_true", help="also compare zb-v, v-half, v-min with the authors' on Table 5"
    )


def run(args: argparse.Namespace) -> list[Table]:
    """``zerobubble bench schedulers``: the build times, and with ``--table5`` the authors' comparison."""
    results = [scheduler_build_times(args.stages, args.microbatches, args.rounds, args.schedules)]
    if args.table5:
        results.append(schedulers_against_authors())
    return results


BENCHMARK = Benchmark("schedulers", "build time of the searching schedulers", add_arguments, run)
