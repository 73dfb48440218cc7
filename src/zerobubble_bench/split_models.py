"""``bench wgrad --models``: the share of W in the backward of each stage of the split models.

:func:`w_shares` measures ``T_W / (T_B + T_W)`` of each stage on 2 ranks for the models of
:mod:`zerobubble_demo.split_models` (:func:`~zerobubble_demo.split_models.split_model`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from zerobubble import Pipeline
from zerobubble.runtime.launch import init_distributed, launch
from zerobubble_demo.split_models import SPLIT_MODELS, split_model

from .tables import Table


def w_shares(
    models: Sequence[str] = SPLIT_MODELS,
    width: int = 256,
    seq: int = 64,
    microbatches: int = 8,
    steps: int = 5,
    schedule: str = "zb-h1",
    blocks: int = 2,
) -> Table:
    """Measured ``T_W / (T_B + T_W)`` per stage of each model on 2 ranks.

    A stage whose parameters all get their gradients in B shows a share near 0; a Linear-dominated
    stage near 0.5 (W is as many FLOPs as the input gradient).  Two measurements: the op times of
    ``Pipeline(trace=True)`` (wall clock), and the same ops timed by each rank's thread CPU time,
    which load from other processes does not inflate; the CPU times of F, B and W per microbatch
    show what B holds besides the input gradient (under checkpointing: the recomputed forward).
    """
    arguments = (list(models), width, seq, microbatches, steps, schedule, blocks)
    results = launch(_w_share_rank, 2, arguments, threads=1)[0]
    table = Table(
        f"W share of the backward per stage: {schedule}, 2 CPU ranks, {microbatches} microbatches, "
        f"width {width}, sequence {seq}, {blocks} blocks (checkpointed, blocks)",
        [
            "model",
            "stage 0 (trace=True)",
            "stage 1 (trace=True)",
            "stage 0 (CPU time)",
            "stage 1 (CPU time)",
            "T_B + T_W per microbatch, stage 0 / 1 (ms)",
            "T_F, T_B, T_W per microbatch, stage 0; stage 1 (ms, CPU time)",
        ],
    )
    for name, (shares, totals, cpu_shares, cpu_times) in results.items():
        table.rows.append(
            [
                name,
                *(f"{share:.3f}" for share in shares),
                *(f"{share:.3f}" for share in cpu_shares),
                " / ".join(f"{t * 1e3:.1f}" for t in totals),
                "; ".join(", ".join(f"{t * 1e3:.2f}" for t in stage) for stage in cpu_times),
            ]
        )
    table.notes.append(
        f"W share = sum of W op times / sum of B and W op times of the stage over steps 2..{steps}, "
        "1 thread per rank. trace=True: wall-clock op times recorded by Pipeline(trace=True), which "
        f"load from other processes on a shared machine makes noisy; CPU time: {steps - 1} more steps "
        "with each op timed by its rank's thread CPU time. Under checkpointing B recomputes the forward: "
        "compare its T_B with T_F + T_B of the same blocks without it (blocks)."
    )
    return table


class _CpuTimeRecorder:
    """A Pipeline recorder timing each op by the rank's thread CPU time, summed per (stage, kind)."""

    clock = staticmethod(time.thread_time)

    def __init__(self) -> None:
        self.totals: dict[tuple[int, Any], float] = {}

    def op(self, op: Any, start: float, end: float) -> None:
        key = (op.stage, op.kind)
        self.totals[key] = self.totals.get(key, 0.0) + end - start

    def wait(self, key: Any, start: float, end: float) -> None:
        """Transfer waits are not compute: ignored."""


def _w_share_rank(
    models: list[str], width: int, seq: int, microbatches: int, steps: int, schedule: str, blocks: int
) -> dict[str, Any]:
    from zerobubble.schedule import Kind

    init_distributed(backend="gloo", timeout=120)
    shares = {}
    for name in models:
        side = min(seq, 16)  # conv net images: 16×16 (at 64×64 a microbatch takes half a second)
        model = split_model(
            name, width=width, batch=2 * microbatches, seq=side if name == "convnet" else seq, blocks=blocks
        )
        pipe = Pipeline(
            model.layers, schedule=schedule, microbatches=microbatches, loss_fn=model.loss_fn, trace=True
        )
        for _ in range(steps):
            pipe.step(model.inputs, model.targets)
            pipe.zero_grad()
        timelines = pipe.measured_timelines()
        cpu = _CpuTimeRecorder()
        pipe.recorder = cpu
        for _ in range(steps - 1):
            pipe.step(model.inputs, model.targets)
            pipe.zero_grad()
        ops = microbatches * (steps - 1)  # of each kind, per stage
        kinds = (Kind.F, Kind.B, Kind.W)
        local = [tuple(cpu.totals.get((s, kind), 0.0) / ops for kind in kinds) for s in pipe.stages]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        if timelines is not None:
            cpu_times = [stage for rank in gathered for stage in rank]
            cpu_shares = [w / (b + w) if b + w else 0.0 for _, b, w in cpu_times]
            shares[name] = (*_stage_w_share(timelines[1:] or timelines, microbatches), cpu_shares, cpu_times)
    return shares


def _stage_w_share(timelines: Sequence[Any], microbatches: int) -> tuple[list[float], list[float]]:
    """Per stage: W share, and ``(T_B + T_W)`` per microbatch, summed over measured steps."""
    from zerobubble.schedule import Kind

    times: dict[int, dict[Kind, float]] = {}
    for timeline in timelines:
        for rank, program in enumerate(timeline.schedule.programs):
            for op, start, end in zip(program, timeline.start[rank], timeline.end[rank]):
                per_kind = times.setdefault(op.stage, {})
                per_kind[op.kind] = per_kind.get(op.kind, 0.0) + end - start
    stages = sorted(times)
    backward = [times[s].get(Kind.B, 0.0) + times[s].get(Kind.W, 0.0) for s in stages]
    shares = [times[s].get(Kind.W, 0.0) / total if total else 0.0 for s, total in zip(stages, backward)]
    return shares, [total / (microbatches * len(timelines)) for total in backward]
