"""What the ``zerobubble`` commands share: the one-line usage error, the parser, the types of its
numeric options, the setup options (ranks, microbatches, costs) and the schedule they describe."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from collections.abc import Callable, Iterator
from typing import NoReturn

from ..errors import UsageError
from ..schedule import (
    REGISTRY,
    CostModel,
    Schedule,
    build_schedule,
    polish_schedule,
)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line and exit 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer ≥ 1 (a count: ranks, microbatches, sizes, steps)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse ``type``: an integer ≥ 0 (a count that may be none: transformer blocks)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number > 0 (seconds, a learning rate, a norm)."""
    return _finite(text, "a positive number", lambda value: value > 0)


def non_negative_float(text: str) -> float:
    """An argparse ``type``: a finite number ≥ 0 (a time that may be nothing)."""
    return _finite(text, "a non-negative number", lambda value: value >= 0)


def _finite(text: str, what: str, accept: Callable[[float], bool]) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and accept(value)):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


@contextlib.contextmanager
def writing(path: str) -> Iterator[None]:
    """Turn a failure to write ``path`` (no such folder, no permission) into a one-line UsageError."""
    try:
        yield
    except OSError as error:
        raise UsageError(f"cannot write {path!r}: {error.strerror or error}") from None


def number_list(text: str, name: str, low: int, high: int) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"{name} must be comma-separated numbers, got {text!r}") from None
    if not low <= len(values) <= high:
        raise UsageError(f"{name} takes {low}..{high} comma-separated numbers, got {len(values)}")
    return values


def costs_from_args(args: argparse.Namespace, stages: int) -> CostModel:
    """The CostModel described by --cost/--memory/--memory-limit/--costs-file."""
    if getattr(args, "costs_file", None):
        try:
            with open(args.costs_file, encoding="utf-8") as handle:
                costs = CostModel.from_dict(json.load(handle))
        except (OSError, json.JSONDecodeError) as error:
            raise UsageError(f"cannot read costs file {args.costs_file!r}: {error}") from None
    else:
        f, b, w, *comm = number_list(args.cost, "--cost", 3, 4)
        mem_b, mem_w = number_list(args.memory, "--memory", 2, 2)
        costs = CostModel(f=f, b=b, w=w, comm=comm[0] if comm else 0.0, mem_b=mem_b, mem_w=mem_w)
    return costs.apply_memory_limit(args.memory_limit, stages)


def add_setup_arguments(parser: argparse.ArgumentParser, schedule: bool = True) -> None:
    if schedule:
        parser.add_argument(
            "--schedule", "-s", default="zb-h1", help="schedule name (see 'zerobubble schedules')"
        )
        parser.add_argument(
            "--schedule-file", help="read a schedule JSON (from 'export --format json') instead"
        )
        parser.add_argument(
            "--chunks", type=positive_int, help="virtual stages per rank, for schedules that take it"
        )
    parser.add_argument("--stages", "-p", type=positive_int, default=4, help="pipeline ranks P (default 4)")
    parser.add_argument(
        "--microbatches", "-m", type=positive_int, default=8, help="microbatches M (default 8)"
    )
    parser.add_argument(
        "--cost", default="1,1,1,0", help="T_F,T_B,T_W[,T_comm] per rank-stage (default 1,1,1,0)"
    )
    parser.add_argument("--memory", default="1,0", help="M_B,M_W per rank-stage (default 1,0)")
    parser.add_argument(
        "--memory-limit", help="per-rank limit: an amount in --memory's unit, or Np = N·p·M_B"
    )
    parser.add_argument(
        "--costs-file", help="JSON CostModel (per-stage lists allowed) instead of --cost/--memory"
    )
    parser.add_argument(
        "--polish",
        type=positive_float,
        metavar="SECONDS",
        help="then reorder the last ops with CP-SAT for up to SECONDS, kept when faster "
        "(pip install 'zerobubble[solver]')",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def schedule_from_args(args: argparse.Namespace) -> tuple[Schedule, CostModel]:
    if args.schedule_file:
        try:
            with open(args.schedule_file, encoding="utf-8") as handle:
                schedule = Schedule.from_json(handle.read())
        except OSError as error:
            raise UsageError(f"cannot read schedule file: {error}") from None
        costs = costs_from_args(args, schedule.num_ranks)
        if args.polish is not None:
            schedule = polish_schedule(schedule, costs, seconds=args.polish)
        return schedule, costs
    costs = costs_from_args(args, args.stages)
    options = {"time_limit": args.time_limit} if getattr(args, "time_limit", None) is not None else {}
    schedule = build_schedule(
        args.schedule,
        args.stages,
        args.microbatches,
        costs,
        chunks=args.chunks,
        polish_seconds=args.polish,
        **options,
    )
    return schedule, REGISTRY[args.schedule].resolve_costs(costs, args.stages)
