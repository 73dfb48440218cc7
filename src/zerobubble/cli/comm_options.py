"""The communication options of ``simulate``, ``show`` and ``export``: lower the schedule first.

``--dp N`` turns the lowering on (:mod:`zerobubble.schedule.lowering`, ``docs/communication.md``):
the schedule becomes each rank's program with its sends and receives, and with ``N`` ≥ 2 replicas
the data-parallel collectives (``--sharding``: replicated all-reduce per bucket, FSDP's unshard,
reshard and reduce-scatter per unit, or HSDP), timed on ``--dp-link`` with communication overlapping
compute.  ``--choose`` lets the chooser pick the units, reshard policy, prefetch and bucket under
``--memory-cap``.  Sizes are in ``--memory``'s unit (give ``--memory`` in bytes to read bytes).
This module parses those options and describes the result; the library does the work.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError
from ..schedule.grid import Grid, Link
from ..schedule.lowering import (
    CollectiveCosts,
    CommTimeline,
    StageBytes,
    choose_options,
    lower,
    simulate_lowered,
    validate_lowered,
)
from ..schedule.sharding import FSDPOptions
from ..schedule.simulate import Timeline
from .base import non_negative_int, positive_int

SHARDINGS = ("replicate", "fsdp", "hsdp")

#: ``--reshard``: (reshard after forward, reshard after backward).
RESHARD = {
    "keep": (False, False),
    "after-forward": (True, False),
    "after-backward": (False, True),
    "both": (True, True),
}

#: The options that shape the lowering, and the shardings each one applies to.
_APPLIES = {
    "units": ("fsdp", "hsdp"),
    "reshard": ("fsdp", "hsdp"),
    "prefetch": ("fsdp", "hsdp"),
    "dp_shard": ("hsdp",),
    "bucket": ("replicate",),
    "dp_link": SHARDINGS,
}

_AMOUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(?:([kKMGT]?)(i?)B)?\s*$")


def amount(text: str) -> float:
    """An argparse ``type``: an amount ≥ 0, a number or bytes with a unit (``2``, ``512MiB``, ``1.5GB``;
    ``B`` is bytes, so a lower-case ``b``, bits, is refused)."""
    match = _AMOUNT.match(text)
    value = float(match.group(1)) if match else math.inf
    if match is None or not math.isfinite(value):
        raise argparse.ArgumentTypeError(
            f"must be an amount: a number or bytes with a unit (2, 512MiB, 1.5GB), got {text!r}"
        )
    prefix, binary = match.group(2) or "", bool(match.group(3))
    if binary and not prefix:
        raise argparse.ArgumentTypeError(f"'iB' needs a prefix (KiB, MiB, GiB), got {text!r}")
    power = " KMGT".index(prefix.upper()) if prefix else 0
    return value * (2 ** (10 * power) if binary else 10 ** (3 * power))


def positive_amount(text: str) -> float:
    """An argparse ``type``: an :func:`amount` > 0 (a memory cap, a layer's bytes)."""
    value = amount(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive amount, got {text!r}")
    return value


def link(text: str) -> Link:
    """An argparse ``type``: ``LATENCY,BANDWIDTH`` — seconds (in ``--cost``'s unit) and an amount per
    second (``4``, ``25GB/s``)."""
    latency, comma, bandwidth = text.partition(",")
    try:
        alpha = float(latency)
    except ValueError:
        alpha = -1.0
    if not comma or not 0 <= alpha < float("inf"):
        raise argparse.ArgumentTypeError(
            f"must be LATENCY,BANDWIDTH: a time ≥ 0 and an amount per time unit (0.05,4 or 5e-6,25GB/s), "
            f"got {text!r}"
        )
    return Link(alpha, positive_amount(bandwidth.strip().removesuffix("/s")))


def units(text: str) -> str | int:
    """An argparse ``type``: an FSDP unit — ``chunk`` (a whole stage), ``layer``, or ``N`` layers."""
    if text in ("chunk", "layer"):
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be chunk, layer or a positive number of layers, got {text!r}"
        ) from None


def add_comm_arguments(parser: argparse.ArgumentParser) -> None:
    """The lowering's options (module docstring), in a group of their own."""
    group = parser.add_argument_group("communication (lower the schedule first; docs/communication.md)")
    group.add_argument(
        "--dp",
        type=positive_int,
        metavar="N",
        help="lower the schedule: its sends and receives, and with N ≥ 2 replicas their collectives",
    )
    group.add_argument(
        "--sharding", choices=SHARDINGS, help="how the replicas hold parameters (default replicate)"
    )
    group.add_argument(
        "--dp-shard", type=positive_int, metavar="N", help="hsdp: the replicas a parameter is cut over"
    )
    group.add_argument("--units", type=units, help="FSDP unit: chunk (default), layer or N layers")
    group.add_argument(
        "--layers-per-stage", type=positive_int, metavar="N", help="layers of each virtual stage (default 4)"
    )
    group.add_argument(
        "--layer-bytes",
        type=positive_amount,
        metavar="AMOUNT",
        help="parameters of a layer, in --memory's unit: 1 (default), 512MiB, ...",
    )
    group.add_argument("--reshard", choices=tuple(RESHARD), help="FSDP: when a unit is freed (default keep)")
    group.add_argument(
        "--prefetch", type=non_negative_int, metavar="K", help="FSDP: gather K parts ahead (default 1)"
    )
    group.add_argument(
        "--bucket",
        type=amount,
        metavar="AMOUNT",
        help="replicate: all-reduce bucket size (default 0: per stage)",
    )
    group.add_argument(
        "--dp-link",
        type=link,
        metavar="LATENCY,BANDWIDTH",
        help="the replicas' link: latency in --cost's unit, bandwidth per time unit (default 0,4)",
    )
    group.add_argument(
        "--choose",
        action="store_true",
        help="pick units, reshard, prefetch or bucket: the fastest under --memory-cap",
    )
    group.add_argument(
        "--memory-cap",
        type=positive_amount,
        metavar="AMOUNT",
        help="--choose: per-rank cap on activations plus parameters, in --memory's unit",
    )


@dataclass(frozen=True)
class LoweredRun:
    """A lowered, validated and simulated schedule, and the chooser's reason and table (``--choose``)."""

    timeline: CommTimeline
    grid: Grid
    model: StageBytes
    reason: str | None = None
    tried: tuple[tuple[Any, float, float], ...] = ()


def lower_from_args(args: argparse.Namespace, timeline: Timeline) -> LoweredRun | None:
    """The schedule of ``timeline`` lowered as ``args`` say, or None without ``--dp``."""
    _check_combination(args)
    if args.dp is None:
        return None
    schedule, costs = timeline.schedule, timeline.costs
    sharding = args.sharding or "replicate"
    grid = Grid(
        dp=args.dp,
        sharding=None if sharding == "replicate" else sharding,  # refused for dp 1, in one line
        dp_shard=args.dp_shard,
        dp_link=args.dp_link or Link(0.0, 4.0),
        pp=schedule.num_ranks,
    )
    model = StageBytes.uniform(schedule.num_stages, args.layers_per_stage or 4, args.layer_bytes or 1.0)
    collectives = CollectiveCosts.from_grid(grid)
    if args.choose:
        choice = choose_options(
            schedule, costs, grid, model, memory_cap=args.memory_cap, collectives=collectives
        )
        validate_lowered(choice.timeline.lowered)
        return LoweredRun(choice.timeline, grid, model, choice.reason, choice.tried)
    forward, backward = RESHARD[args.reshard or "keep"]
    options = FSDPOptions(
        units=args.units or "chunk",
        reshard_after_forward=forward,
        reshard_after_backward=backward,
        prefetch=1 if args.prefetch is None else args.prefetch,
        bucket_bytes=args.bucket or 0.0,
    )
    lowered = lower(schedule, options, grid=grid, model=model)
    validate_lowered(lowered)
    return LoweredRun(simulate_lowered(lowered, costs, collectives), grid, model)


def _check_combination(args: argparse.Namespace) -> None:
    """Refuse options that would be ignored: every one of them without ``--dp``, those of another
    sharding, ``--memory-cap`` without ``--choose`` and the chooser's own choices with it."""
    given = [
        name for name in (*_APPLIES, "sharding", "layers_per_stage", "layer_bytes") if _given(args, name)
    ]
    given += [name for name in ("choose", "memory_cap") if getattr(args, name)]
    if args.dp is None:
        if given:
            raise UsageError(f"{_flag(given[0])} goes with --dp N (which lowers the schedule first)")
        return
    sharding = args.sharding or "replicate"
    for name, shardings in _APPLIES.items():
        if _given(args, name) and (sharding not in shardings or args.dp == 1):
            which = "" if shardings == SHARDINGS else f"--sharding {' or '.join(shardings)} "
            raise UsageError(
                f"{_flag(name)} applies to {which}data parallelism (--dp ≥ 2), "
                f"not to --sharding {sharding} with --dp {args.dp}"
            )
    if args.memory_cap is not None and not args.choose:
        raise UsageError("--memory-cap goes with --choose (the chooser's cap on each rank's peak)")
    chosen = [name for name in ("units", "reshard", "prefetch", "bucket") if _given(args, name)]
    if args.choose and chosen:
        raise UsageError(f"--choose picks {_flag(chosen[0])} itself: give one or the other")


def _given(args: argparse.Namespace, name: str) -> bool:
    return getattr(args, name) is not None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def describe_setup(run: LoweredRun) -> str:
    """The lowering's assumptions in words: replicas, model sizes, link."""
    grid, model = run.grid, run.model
    stages = f"{model.num_stages} virtual stages × {len(model.params[0])} layers of {model.params[0][0]:g}"
    if grid.dp == 1:
        return f"no data parallelism; {stages}"
    sharding = {None: "replicated", "fsdp": "FSDP", "hsdp": f"HSDP, shards of {grid.shard}"}[grid.sharding]
    link = grid.dp_link
    return f"dp {grid.dp} ({sharding}); {stages}; dp link {link.latency:g} + size / {link.bandwidth:g}"


def lowered_report(
    run: LoweredRun, plain: dict[str, Any], optimizer: str, step_time: float, memory_cap: float | None
) -> dict[str, Any]:
    """``simulate``'s numbers for a lowered schedule: ``plain`` is the report without communication."""
    timeline = run.timeline
    period = (timeline.makespan if optimizer == "sync" else timeline.iteration_time) + step_time
    report: dict[str, Any] = {
        "schedule": plain["schedule"],
        "stages": plain["stages"],
        "microbatches": plain["microbatches"],
        "setup": describe_setup(run),
        "lowering": timeline.lowered.options.describe(run.grid.dp_mode),
        "iteration_time": timeline.iteration_time,
        "makespan": timeline.makespan,
        "period": period,
        "optimizer": optimizer,
        "compute_only_time": plain["iteration_time"],
        "exposed_dp": [exposed["dp"] for exposed in timeline.exposed],
        "exposed_pp": [exposed["pp"] for exposed in timeline.exposed],
    }
    if timeline.lowered.source.vocab_shards:
        report["exposed_vocab"] = [exposed["vocab"] for exposed in timeline.exposed]
    report["peak_activations"] = list(timeline.memory.activations)
    report["peak_parameters"] = list(timeline.memory.parameters)
    report["peak_memory"] = list(timeline.memory.total)
    if run.reason is not None:
        report["choice"] = run.reason
    if memory_cap is not None:
        report["fits_memory_cap"] = max(timeline.peak_memory) <= memory_cap
    return report


def tried_table(run: LoweredRun) -> list[dict[str, Any]]:
    """The chooser's candidates as JSON rows: lowering, iteration time, peak memory."""
    return [
        {"lowering": options.describe(run.grid.dp_mode), "iteration_time": time, "peak_memory": peak}
        for options, time, peak in run.tried
    ]
