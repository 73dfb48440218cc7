"""``benchmarks/memory.py``: each schedule's measured activation peak against the simulator's bound.

:func:`peak_memory` (a rank worker) measures the live activation bytes of every
``(schedule, microbatches)`` with :class:`zerobubble.runtime.memory.ActivationMeter` on
Linear–GELU–Linear blocks; :func:`memory_table` runs it on local ranks and renders the ratios
(``tests/test_runtime_memory.py`` checks them against the bound).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from zerobubble.runtime.launch import init_distributed, launch
from zerobubble.runtime.memory import ActivationMeter
from zerobubble.runtime.pipeline import Pipeline

from .tables import preserved_torch_state

WIDTH, ROWS, BLOCKS = 16, 4, 8


def mlp_blocks(seed: int) -> list[nn.Module]:
    """``BLOCKS`` Linear–GELU–Linear blocks (a transformer MLP without the residual)."""
    with preserved_torch_state():
        torch.manual_seed(seed)
        return [
            nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
            for _ in range(BLOCKS)
        ]


def peak_memory(cases: list[tuple[str, int]]) -> dict:
    """Peak live activation bytes of each ``(schedule, microbatches)`` on this rank (second step)."""
    init_distributed(backend="gloo", timeout=60)
    results = {}
    for name, m in cases:
        pipe = Pipeline(mlp_blocks(0), schedule=name, microbatches=m, loss_fn=F.mse_loss, timeout=60)
        inputs = torch.randn(ROWS * m, WIDTH)
        targets = torch.randn(ROWS * m, WIDTH)
        meter = ActivationMeter(pipe, (inputs, targets))
        pipe.step(inputs, targets)  # first step: shapes and headers
        pipe.recorder = meter
        with meter.hooks():
            pipe.step(inputs, targets)
        stages = pipe.schedule.num_stages
        predicted = pipe.timeline.peak_memory[pipe.rank]
        results[(name, m)] = {"peak": meter.peak, "predicted": predicted, "blocks_per_stage": BLOCKS / stages}
    return results


def memory_table(schedules: Sequence[str], counts: Sequence[int] = (8, 16, 32), ranks: int = 2) -> list[str]:
    """Markdown table: each schedule's measured peak per rank over the simulator's bound, per m.

    The bound is the simulated peak (units of M_B) times the bytes of one M_B, taken from 1F1B's
    measured peak on rank 0 at the smallest m.
    """
    cases = [("1f1b", counts[0])] + [(name, m) for name in schedules for m in counts]
    per_rank = launch(peak_memory, ranks, (cases,), threads=1)
    first = per_rank[0][("1f1b", counts[0])]
    unit = first["peak"] / first["predicted"]
    header = "| schedule | " + " | ".join(f"m = {m}: peak / bound per rank" for m in counts) + " |"
    lines = [header, "|---" * (len(counts) + 1) + "|"]
    for name in schedules:
        cells = []
        for m in counts:
            ratios = [r[(name, m)]["peak"] / (r[(name, m)]["predicted"] * unit) for r in per_rank]
            cells.append(" ".join(f"{ratio:.3f}" for ratio in ratios))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines
