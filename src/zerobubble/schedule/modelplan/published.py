"""The cluster planner against published training runs: predictions beside the published figures.

``src/zerobubble/data/published_runs.json`` holds, for each run, the model's sizes (a Hugging Face
style config), the cluster, the layout as published (pp, dp, tp, microbatch size, schedule,
recomputation, how the replicas share gradients) and the published figure: Megatron-LM's
teraFLOP/s a GPU (Narayanan et al. 2021, Table 1, counted with their formula,
:func:`megatron_flops`) or torchtitan's tokens/s a GPU.  :func:`predict` plans each run's layout
with :func:`~.cluster.plan_cluster` at one matmul efficiency; :func:`calibrate` finds the efficiency
that predicts one run exactly (bisection: the prediction grows with it); :func:`published_table`
prints every run's figure, prediction and ratio as Markdown (``zerobubble plan --published``).
Pure Python; no torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..grid import Grid
from ..ir import ScheduleError
from ..sharding import ONCE_PER_STEP, FSDPOptions
from .amounts import format_bytes
from .cluster import (
    CALIBRATED_EFFICIENCY,
    Cluster,
    ClusterOption,
    ClusterSearch,
    TransformerShape,
    plan_cluster,
)

RUNS = Path(__file__).resolve().parents[2] / "data" / "published_runs.json"
"""The published runs shipped with the package."""


def load_runs(path: str | Path = RUNS) -> dict[str, Any]:
    """The runs file: ``cluster`` (the links and GPUs they share), ``calibrate_on`` and ``runs``."""
    try:
        return dict(json.loads(Path(path).read_text()))
    except (OSError, json.JSONDecodeError) as error:
        raise ScheduleError(f"cannot read published runs {str(path)!r}: {error}") from None


def megatron_flops(batch: int, seq_len: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of one step as Narayanan et al. (2021, eq. 3) count them, recomputation included:
    ``96·B·s·l·h²·(1 + s/6h + V/16lh)``."""
    return (
        96.0
        * batch
        * seq_len
        * layers
        * hidden**2
        * (1 + seq_len / (6 * hidden) + vocab / (16 * layers * hidden))
    )


@dataclass(frozen=True)
class Prediction:
    """One run: the published figure, ours (same unit; 0 when nothing fits) and the planned option."""

    run: Mapping[str, Any]
    predicted: float
    option: ClusterOption

    @property
    def ratio(self) -> float:
        """Predicted over published."""
        return self.predicted / float(self.run["published"])


def run_cluster(run: Mapping[str, Any], shared: str, efficiency: float) -> Cluster:
    """The cluster of ``run``: its nodes, the shared links and GPUs, at ``efficiency``."""
    return replace(Cluster.parse(f"nodes={run['nodes']},{shared}"), efficiency=efficiency)


def run_grid(run: Mapping[str, Any]) -> Grid:
    """The published layout, its replicas' sharding as run (FSDP units or all-reduce buckets)."""
    fsdp = run["data_parallel"] == "fsdp" and run["dp"] > 1
    return Grid(
        dp=run["dp"],
        tp=run["tp"],
        sharding="fsdp" if fsdp else None,
        pp=run["pp"],
        comm=run_comm(run),
    )


def run_comm(run: Mapping[str, Any]) -> FSDPOptions:
    """The published run's communication record: ``unit_layers`` 0 (or absent) is the chunk gathered
    once a step; N ≥ 1 FSDP units of N layers, resharded after each backward (and after each forward
    with ``reshard_after_forward``); ``bucket_bytes`` the replicated all-reduce's buckets;
    ``reduce_after_step`` every reduction after the step (Megatron-LM 2021's DDP)."""
    unit = int(run.get("unit_layers", 0))
    bucket = float(run.get("bucket_bytes", 0.0))
    after = bool(run.get("reduce_after_step", False))
    if not unit:
        return replace(ONCE_PER_STEP, bucket_bytes=bucket, reduce_after_step=after)
    return FSDPOptions(
        units="layer" if unit == 1 else unit,
        reshard_after_forward=bool(run.get("reshard_after_forward", True)),
        reshard_after_backward=True,
        prefetch=int(run.get("prefetch", 1)),
        bucket_bytes=bucket,
        reduce_after_step=after,
    )


def predict(run: Mapping[str, Any], shared: str, efficiency: float, *, choose: bool = False) -> Prediction:
    """Plan ``run``'s published layout at ``efficiency`` (its sharding as published, or with
    ``choose`` the planner's choice) and express the step in the published figure's unit."""
    shape = TransformerShape.from_config(run["model"])
    cluster = run_cluster(run, shared, efficiency)
    (option,) = plan_cluster(
        shape,
        cluster,
        run["tokens_per_step"],
        run["seq_len"],
        microbatch_size=run["microbatch_size"],
        recompute=run["recompute"],
        layouts=[run_grid(run)],
        search=ClusterSearch((run["schedule"],), (run["chunks"],), refine=0, choose_sharding=choose),
    )
    if option.plan is None:
        return Prediction(run, 0.0, option)
    if run["metric"] == "megatron_tflops":
        sizes = (shape.layers, shape.hidden, shape.vocab)
        flops = megatron_flops(run["tokens_per_step"] // run["seq_len"], run["seq_len"], *sizes)
        return Prediction(run, flops / option.step_time / cluster.size / 1e12, option)
    return Prediction(run, option.tokens_per_second, option)


def calibrate(run: Mapping[str, Any], shared: str, *, low: float = 0.05, high: float = 1.0) -> float:
    """The efficiency at which ``run`` is predicted exactly (to 1e-4 of the figure): the prediction
    grows about in proportion with the efficiency, so each guess steps to where it would be exact,
    kept inside the bracket of guesses that predict too little and too much (else bisects it)."""
    guess = min(max(CALIBRATED_EFFICIENCY, low), high)
    for _ in range(60):
        ratio = predict(run, shared, guess).ratio
        if abs(ratio - 1) < 1e-4:
            return round(guess, 4)
        low, high = (guess, high) if ratio < 1 else (low, guess)
        if high - low < 1e-5:
            break
        step = guess / ratio if ratio > 0 else high
        guess = step if low < step < high else (low + high) / 2
    raise ScheduleError(
        f"{run['name']}: no efficiency within [{low:g}, {high:g}] predicts it: the last guess "
        f"{guess:g} predicts {ratio:.3f} of the published figure"
    )


@dataclass(frozen=True)
class AnchorSpread:
    """The runs predicted at the efficiency calibrated on ``anchor``: the efficiency, every
    prediction, and the lowest and highest ratio among the rows of Narayanan et al.'s Table 1."""

    anchor: str
    efficiency: float
    predictions: tuple[Prediction, ...]

    @property
    def table1(self) -> list[Prediction]:
        """The predictions of the Table 1 rows (the runs counted in Megatron's teraFLOP/s)."""
        return [p for p in self.predictions if p.run["metric"] == "megatron_tflops"]

    @property
    def low(self) -> Prediction:
        """The Table 1 row predicted lowest against its figure."""
        return min(self.table1, key=lambda p: p.ratio)

    @property
    def high(self) -> Prediction:
        """The Table 1 row predicted highest against its figure."""
        return max(self.table1, key=lambda p: p.ratio)


def anchor_spreads(data: Mapping[str, Any]) -> list[AnchorSpread]:
    """Every Table 1 row of ``data`` taken in turn as the anchor: how far the predictions move with
    the choice of the one row the efficiency is calibrated on."""
    spreads = []
    for anchor in (run for run in data["runs"] if run["metric"] == "megatron_tflops"):
        efficiency, predictions = predict_all(data, calibrate(anchor, data["cluster"]))
        spreads.append(AnchorSpread(anchor["name"], efficiency, tuple(predictions)))
    return spreads


def anchor_table(data: Mapping[str, Any]) -> str:
    """A Markdown table, one line an anchor: its efficiency, the lowest and highest Table 1 ratio
    and each other run's ratio and memory (``zerobubble plan --published --anchors``)."""
    spreads = anchor_spreads(data)
    others = [p.run["name"] for p in spreads[0].predictions if p.run["metric"] != "megatron_tflops"]
    lines = [
        "### Every anchor",
        "",
        "| anchor | efficiency | Table 1: lowest | Table 1: highest | " + " | ".join(others) + " |",
        "|---|---|---|---|" + "---|" * len(others),
    ]
    for spread in spreads:
        low, high = spread.low, spread.high
        rest = [_ratio_text(p) for p in spread.predictions if p.run["metric"] != "megatron_tflops"]
        lines.append(
            f"| {spread.anchor} | {spread.efficiency:.4f} | {low.ratio:.3f} ({_short(low)}) | "
            f"{high.ratio:.3f} ({_short(high)}) | " + " | ".join(rest) + " |"
        )
    ratios = [p.ratio for spread in spreads for p in spread.table1]
    lines += ["", f"over every anchor: Table 1 ratios from {min(ratios):.3f} to {max(ratios):.3f}"]
    return "\n".join(lines)


def _short(prediction: Prediction) -> str:
    """A Table 1 row's size, e.g. ``39.1B``."""
    return str(prediction.run["name"]).rsplit(" ", 1)[-1]


def _ratio_text(prediction: Prediction) -> str:
    if prediction.option.plan is None:
        return "does not fit"
    return f"{prediction.ratio:.3f}, {format_bytes(prediction.option.memory)}"


def predict_all(data: Mapping[str, Any], efficiency: float | None = None) -> tuple[float, list[Prediction]]:
    """Every run of ``data`` (:func:`load_runs`) at ``efficiency``, by default calibrated on the run
    named ``data["calibrate_on"]``; the efficiency used and the predictions."""
    runs: Sequence[Mapping[str, Any]] = data["runs"]
    if efficiency is None:
        named = [run for run in runs if run["name"] == data["calibrate_on"]]
        if not named:
            names = ", ".join(run["name"] for run in runs)
            raise ScheduleError(f"no published run is named {data['calibrate_on']!r}; the runs are {names}")
        efficiency = calibrate(named[0], data["cluster"])
    return efficiency, [predict(run, data["cluster"], efficiency) for run in runs]


def published_table(data: Mapping[str, Any], efficiency: float | None = None) -> str:
    """A Markdown table of every run: published, predicted, ratio, the layout and its memory."""
    used, predictions = predict_all(data, efficiency)
    anchor = data["calibrate_on"] if efficiency is None else None
    peak = Cluster.parse(f"nodes=1,{data['cluster']}").flops
    lines = [
        "### Published runs",
        "",
        f"matmul efficiency {used:g}" + (f", calibrated on {anchor}" if anchor else ", as given"),
        "",
        "| run | layout | published | predicted | ratio | memory/GPU |",
        "|---|---|---|---|---|---|",
    ]
    for p in predictions:
        run, option = p.run, p.option
        layout = f"pp {run['pp']} × dp {run['dp']} × tp {run['tp']}, {run['schedule']}"
        layout += f" ×{run['chunks']}" if run["chunks"] > 1 else ""
        unit = "TFLOP/s" if run["metric"] == "megatron_tflops" else "tok/s"
        if option.plan is None:
            lines.append(f"| {run['name']} | {layout} | {run['published_text']} | does not fit | — | — |")
            continue
        share = p.predicted * 1e12 / peak if unit == "TFLOP/s" else option.mfu
        label = "% of peak" if unit == "TFLOP/s" else "MFU"
        lines.append(
            f"| {run['name']} | {layout} | {run['published_text']} | {p.predicted:.0f} {unit}, "
            f"{label} {share:.1%} | {p.ratio:.2f} | {format_bytes(option.memory)} |"
        )
    return "\n".join(lines)
