"""The text and picture of a cluster plan (:func:`~.cluster.plan_cluster`): the table of the fastest
layouts, the winner's two lines, its schedule drawn.  Pure Python; no torch."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..ir import ScheduleError
from .amounts import format_bytes
from .cluster import ClusterOption


def cluster_table(options: Sequence[ClusterOption], top: int) -> str:
    """The ``top`` fastest layouts as a text table, and how many fit nothing."""
    header = (
        "  pp   dp   tp  sharding   m  schedule            step s  bubble  memory/GPU  tok/s/GPU   MFU   HFU"
    )
    experts = any(o.ep > 1 for o in options)  # a mixture of experts: its ep column
    lines = [header.replace("   tp", "   tp   ep") if experts else header]
    for option in [o for o in options if o.plan is not None][:top]:
        assert option.plan is not None
        winner = option.plan.winner
        bubble = max(winner.bubble_rate or 0.0, 0.0)
        ep = f" {option.ep:4d}" if experts else ""
        lines.append(
            f"{option.pp:4d} {option.dp:4d} {option.tp:4d}{ep}  {option.sharding or 'replicate':9s}"
            f"{option.microbatches:4d}  {winner.label:16s} {option.step_time:8.3f}  {bubble:6.1%}"
            f"  {format_bytes(option.memory) + ('' if option.fits else '!'):>10s}"
            f" {option.tokens_per_second:10.0f} {option.mfu:6.1%}"
            f" {option.hfu:5.1%}"
        )
    if any(not o.fits for o in options if o.plan is not None):
        lines.append("(!: over the memory budget with every sharding tried; its lowest peak shown)")
    failed = sum(o.plan is None and not o.pruned for o in options)
    if failed:
        lines.append(f"({failed} of {len(options)} layouts fit nothing or do not split the batch)")
    pruned = [o for o in options if o.pruned]
    if pruned:
        lines.append(
            f"({len(pruned)} layouts not simulated: their busiest GPU's compute alone is slower than the "
            f"{len(lines) - 1}. fastest step)"
        )
    return "\n".join(lines)


def best_layout_text(options: Sequence[ClusterOption]) -> str:
    """Two lines on the winner (its layout and throughput; its data-parallel sharding and why), or
    why nothing runs."""
    fitting = [o for o in options if o.plan is not None]
    if not fitting:
        reasons = "; ".join(f"pp {o.pp} dp {o.dp} tp {o.tp}: {o.note}" for o in options[:3])
        raise ScheduleError(f"no layout of the cluster fits: {reasons}")
    best = fitting[0]
    assert best.plan is not None
    return (
        f"best: pp {best.pp} × dp {best.dp} ({best.sharding or 'replicate'}) × tp {best.tp}"
        + (f" × ep {best.ep} (within dp)" if best.ep > 1 else "")
        + f", {best.plan.winner.label} with {best.microbatches} microbatches: {best.tokens_per_second:.0f} "
        f"tokens/s per GPU, MFU {best.mfu:.1%} (HFU {best.hfu:.1%})"
        + ("" if best.fits else "; over the memory budget: no layout fits it")
        + "\n"
        f"data parallel: {best.reason}"
    )


def render_cluster_option(option: ClusterOption, path: str | Path) -> None:
    """Draw the schedule ``option`` chose (one pipeline replica's simulated timeline; SVG or PNG by
    the suffix of ``path``), titled with its layout."""
    if option.plan is None:
        raise ScheduleError(
            f"pp {option.pp} dp {option.dp} tp {option.tp} has no plan to draw: {option.note}"
        )
    winner = option.plan.winner
    title = (
        f"pp {option.pp} × dp {option.dp} ({option.sharding or 'replicate'}) × tp {option.tp}: "
        f"{winner.label}, {option.microbatches} microbatches, partition {list(option.plan.partition)}"
    )
    option.plan.render(path, title=title)
