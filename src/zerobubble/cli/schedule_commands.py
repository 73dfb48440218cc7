"""The schedule commands: ``schedules``, ``simulate``, ``show``, ``export`` and ``compare`` (the
schedule layer only: no torch).  ``simulate``, ``show`` and ``export`` lower the schedule first
when given ``--dp`` (:mod:`.comm_options`): then they report, draw and trace its communication too."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from ..schedule import (
    REGISTRY,
    Schedule,
)
from ..schedule.compare import OPTIMIZER_MODES, compare_schedules, iteration_period
from ..schedule.paper import paper_models, paper_setup
from .base import (
    UsageError,
    add_setup_arguments,
    costs_from_args,
    non_negative_float,
    positive_float,
    positive_int,
    schedule_from_args,
    writing,
)
from .comm_options import LoweredRun, add_comm_arguments, lower_from_args, lowered_report, tried_table


def _cmd_schedules(args: argparse.Namespace) -> int:
    width = max(len(name) for name in REGISTRY)
    for name, spec in REGISTRY.items():
        chunks = "v≥1" if spec.chunks is None else f"v={spec.chunks}"
        print(f"{name:<{width}}  {chunks:<4}  {spec.summary}")
    return 0


def _simulation_report(args: argparse.Namespace) -> tuple[Schedule, Any, dict[str, Any]]:
    from ..schedule import validate_schedule

    schedule, costs = schedule_from_args(args)
    timeline = validate_schedule(schedule, costs)
    report = timeline.summary()
    report["period"] = iteration_period(timeline, args.optimizer, args.step_time)
    report["optimizer"] = args.optimizer
    for key in ("lower_bound", "optimal", "polish"):
        if key in schedule.meta:
            report[key] = schedule.meta[key]
    return schedule, timeline, report


def _cmd_simulate(args: argparse.Namespace) -> int:
    _, timeline, report = _simulation_report(args)
    lowered = lower_from_args(args, timeline)
    if lowered is not None:
        report = lowered_report(lowered, report, args.optimizer, args.step_time, args.memory_cap)
    if args.json:
        if lowered is not None and lowered.tried:
            report["candidates"] = tried_table(lowered)
        print(json.dumps(report))
        return 0
    for key, value in report.items():
        if isinstance(value, float):
            value = f"{value:.6g}"
        elif isinstance(value, list):
            value = " ".join(f"{v:.4g}" for v in value)
        print(f"{key:>22}: {value}")
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from ..schedule.render import render_image, render_text

    _, timeline, report = _simulation_report(args)
    lowered = lower_from_args(args, timeline)
    if lowered is not None:
        return _show_lowered(args, lowered)
    if args.output:
        with writing(args.output):
            render_image(timeline, args.output)
        print(
            f"wrote {args.output}: {report['schedule']}, iteration time {report['iteration_time']:.6g}, "
            f"bubble rate {report['bubble_rate']:.4f}"
        )
    else:
        print(render_text(timeline, width=args.width))
    return 0


def _show_lowered(args: argparse.Namespace, lowered: LoweredRun) -> int:
    """``show --dp``: the lowered timeline with a lane per communication group (text or SVG)."""
    from ..schedule.lowering import render_comm_svg, render_comm_text

    timeline = lowered.timeline
    if not args.output:
        print(render_comm_text(timeline, width=args.width or 100))
        return 0
    if not args.output.endswith(".svg"):
        raise UsageError(
            f"show --dp draws its communication lanes as SVG: give -o FILE.svg, not {args.output!r}"
        )
    with writing(args.output):
        render_comm_svg(timeline, args.output)
    lowering = timeline.lowered.options.describe(timeline.lowered.data_parallel)
    print(
        f"wrote {args.output}: {timeline.lowered.source.name} lowered ({lowering}), "
        f"iteration time {timeline.iteration_time:.6g}, exposed dp {timeline.exposed_dp:.4g}"
    )
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from ..schedule.export import describe_torch_placement, export, torch_placement_json

    if args.placement and args.format != "torch-csv":
        raise UsageError("--placement goes with --format torch-csv (the placement its CSV needs)")
    schedule, timeline, _ = _simulation_report(args)
    lowered = lower_from_args(args, timeline)
    if lowered is not None:
        text = _export_lowered(args, lowered)
    else:
        text = export(timeline if args.format == "chrome-trace" else schedule, args.format)
    if args.output:
        _write(args.output, text)
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    if args.format != "torch-csv":
        return 0
    # the CSV holds no placement: torch's PipelineStage objects must be built to match it
    placement = args.placement or (_placement_path(args.output) if args.output else None)
    if placement:
        _write(placement, torch_placement_json(schedule))
    where = f"; written to {placement}" if placement else ""
    print(f"stage placement for this CSV: {describe_torch_placement(schedule)}{where}", file=sys.stderr)
    return 0


def _export_lowered(args: argparse.Namespace, lowered: LoweredRun) -> str:
    """``export --dp``: the lowered timeline as a Chrome trace, a thread per communication lane."""
    from ..schedule.lowering import to_comm_chrome_trace

    if args.format != "chrome-trace":
        raise UsageError(
            f"export --dp writes the lowered timeline as --format chrome-trace; {args.format} holds "
            "the compute ops only (export it without --dp)"
        )
    return to_comm_chrome_trace(lowered.timeline)


def _placement_path(output: str) -> str:
    """``plan.csv`` -> ``plan.placement.json``: where ``export --format torch-csv -o`` puts the placement."""
    stem = output[: -len(".csv")] if output.endswith(".csv") else output
    return stem + ".placement.json"


def _write(path: str, text: str) -> None:
    with writing(path), open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def _cmd_compare(args: argparse.Namespace) -> int:
    chunks = args.chunks
    if args.paper_model:
        setup = paper_setup(args.paper_model, args.microbatches)
        stages, costs = setup.stages, setup.costs
        chunks = chunks or setup.interleaved_chunks
        costs = costs.apply_memory_limit(args.memory_limit, stages)
    else:
        stages, costs = args.stages, costs_from_args(args, args.stages)
    names = args.schedules.split(",") if args.schedules else None
    if args.ilp:
        names = (names or [n for n in REGISTRY if n != "zb-ilp"]) + ["zb-ilp"]
    options = {"zb-ilp": {"time_limit": args.time_limit}} if args.time_limit is not None else None
    rows = compare_schedules(
        stages,
        args.microbatches,
        costs,
        names,
        chunks,
        args.optimizer,
        args.step_time,
        options,
        polish_seconds=args.polish,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "stages": stages,
                    "microbatches": args.microbatches,
                    "optimizer": args.optimizer,
                    "rows": [row.to_dict() for row in rows],
                }
            )
        )
        return 0
    print(_format_comparison(rows, stages, args.microbatches, args.optimizer))
    return 0


def _format_comparison(rows, stages: int, microbatches: int, optimizer: str) -> str:
    header = (
        f"{'schedule':<17}{'sync period':>13}{'post-val period':>16}{'bubble':>8}{'peak mem':>9}"
        f"{'vs 1f1b':>9}{'gap to LB':>10}"
    )
    lines = [
        f"p={stages} m={microbatches}; sorted by the {optimizer} period; speed-up and bubble use it too",
        header,
    ]
    for row in rows:
        if row.error:
            lines.append(f"{row.schedule:<17}n/a: {row.error}")
            continue
        # the analytic bound may sit a float rounding above an optimal schedule: show that as 0
        gap = f"{max(row.gap_to_bound, 0.0) * 100:.2f}%" if row.gap_to_bound is not None else "-"
        if row.optimal:
            gap += "*"
        bubble = row.bubble_rate if optimizer == "post-validation" else row.bubble_rate_makespan
        memory = f"{row.peak_memory:.2f}" + ("" if row.fits_memory else "!")
        name = row.schedule + ("+" if row.polished else "")
        lines.append(
            f"{name:<17}{row.period_sync:>13.6g}{row.period_post_validation:>16.6g}{bubble:>8.4f}"
            f"{memory:>9}{row.speedup_vs_1f1b or 0:>8.3f}x{gap:>10}"
        )
    lines.append(
        "sync period = makespan + step; post-val period = iteration time + step (optimizer post-validation);"
    )
    lines.append(
        "peak mem in M_B (max over ranks; ! = above --memory-limit); gap to LB = iteration time over the "
        "best lower bound known for its placement and its memory (* = proven optimal)"
    )
    if any(row.polished is not None for row in rows):
        lines.append("+ = made faster by --polish (CP-SAT reordered its last ops); vs 1f1b: the unpolished")
    return "\n".join(lines)


def _no_arguments(parser: argparse.ArgumentParser) -> None:
    """A command without options."""


def _add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``simulate``, and the first ones of ``show`` and ``export``."""
    add_setup_arguments(parser)
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZER_MODES,
        default="post-validation",
        help="sync: period = makespan + step; post-validation: iteration time + step",
    )
    parser.add_argument(
        "--step-time", type=non_negative_float, default=0.0, help="optimizer step time (default 0)"
    )
    parser.add_argument("--time-limit", type=positive_float, help="seconds for zb-ilp (default 60)")
    add_comm_arguments(parser)


def _add_show_arguments(parser: argparse.ArgumentParser) -> None:
    _add_simulate_arguments(parser)
    parser.add_argument("--output", "-o", help="write a picture (.svg or .png) instead of text")
    parser.add_argument("--width", type=int, help="text width in columns")


def _add_export_arguments(parser: argparse.ArgumentParser) -> None:
    _add_simulate_arguments(parser)
    parser.add_argument("--format", choices=("json", "torch-csv", "chrome-trace"), default="json")
    parser.add_argument("--output", "-o", help="file to write (default: stdout)")
    parser.add_argument(
        "--placement",
        metavar="FILE",
        help="torch-csv: write the stage placement the CSV needs (JSON) here (default with -o X.csv: "
        "X.placement.json; it is always printed on stderr)",
    )


def _add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    add_setup_arguments(parser, schedule=False)
    parser.add_argument(
        "--chunks", type=positive_int, help="chunks for interleaved-1f1b (default 2, or the paper's)"
    )
    parser.add_argument("--schedules", help="comma-separated names (default: all but zb-ilp)")
    parser.add_argument("--paper-model", choices=paper_models(), help="use the paper's profiled setup")
    parser.add_argument("--optimizer", choices=OPTIMIZER_MODES, default="post-validation")
    parser.add_argument(
        "--step-time", type=non_negative_float, default=0.0, help="optimizer step time (default 0)"
    )
    parser.add_argument("--ilp", action="store_true", help="also solve the integer program (zb-ilp)")
    parser.add_argument("--time-limit", type=positive_float, help="seconds for zb-ilp (default 60)")


COMMANDS: tuple[
    tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]], ...
] = (
    ("schedules", "list the schedules", _no_arguments, _cmd_schedules),
    ("simulate", "simulate a schedule and print its numbers", _add_simulate_arguments, _cmd_simulate),
    ("show", "draw a schedule's timeline (text, or --output FILE.svg|.png)", _add_show_arguments, _cmd_show),
    ("export", "write a schedule as JSON, torch-csv or a Chrome trace", _add_export_arguments, _cmd_export),
    ("compare", "compare every schedule for one setup", _add_compare_arguments, _cmd_compare),
)
"""(name, help, add_arguments, run) of each command here, in ``zerobubble --help`` order."""
