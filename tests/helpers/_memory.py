"""Rank workers of the activation-memory tests: each schedule's measured peak next to its simulated one.

Module-level so spawned ranks can import them; they return plain Python numbers to the parent.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zerobubble import Pipeline
from zerobubble.runtime.launch import init_distributed
from zerobubble.runtime.observe.memory import ActivationMeter

WIDTH, ROWS, BLOCKS = 16, 4, 8


def mlp_blocks(seed: int) -> list[nn.Module]:
    """``BLOCKS`` Linear–GELU–Linear blocks (a transformer MLP without the residual); the caller's
    RNG state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return [
            nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
            for _ in range(BLOCKS)
        ]


def peak_memory(cases: list[tuple[str, int]]) -> dict:
    """Peak live activation bytes of each ``(schedule, microbatches)`` on this rank (second step), the
    simulated peak (units of M_B) and the blocks per stage."""
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
