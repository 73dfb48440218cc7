"""Rank workers of the profiler tests: a step under ``torch.profiler.profile`` and the ranges it saw.

Module-level so spawned ranks can import them; they return plain Python values to the parent.
"""

from __future__ import annotations

import torch
from torch import nn

from zerobubble.runtime.launch import init_distributed

PREFIX = "zerobubble/"


def tiny_layers(seed: int, count: int = 4, width: int = 6) -> list[nn.Module]:
    """``count`` Linear + Tanh layers of ``width`` features (float32)."""
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(count)]


def squared_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).square().mean()


def range_names(prof) -> list[str]:
    """Every ``zerobubble/`` range a finished profiler recorded, in start order."""
    events = sorted((e for e in prof.events() if e.name.startswith(PREFIX)), key=lambda e: e.time_range.start)
    return [e.name for e in events]


def profiled_steps(cases: list[tuple[str, int]]) -> dict[int, dict]:
    """For each ``(schedule, microbatches)``: the ranges of one profiled step (after an unprofiled one)
    and of one profiled evaluation; the program and hook names they should match; the gradients of
    the profiled step against the unprofiled one (largest difference)."""
    init_distributed(backend="gloo", timeout=60)
    from zerobubble import Pipeline
    from zerobubble.runtime.execute.executor import Hook

    results = {}
    for index, (name, microbatches) in enumerate(cases):
        pipe = Pipeline(
            tiny_layers(index), schedule=name, microbatches=microbatches, loss_fn=squared_loss, timeout=60
        )
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.0)  # lr 0: the second step's gradients match
        torch.manual_seed(100 + index)
        inputs, targets = torch.randn(2 * microbatches, 6), torch.randn(2 * microbatches, 6)
        pipe.step(inputs, targets)
        plain = {n: p.grad.clone() for n, p in pipe.named_parameters()}
        pipe.optimizer_step(optimizer)
        pipe.zero_grad()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            pipe.step(inputs, targets)
        step_names = range_names(prof)
        difference = max(float((p.grad - plain[n]).abs().max()) for n, p in pipe.named_parameters())
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            pipe.evaluate(inputs, targets)
        results[index] = {
            "rank": pipe.rank,
            "program": [str(op) for op in pipe.schedule.programs[pipe.rank]],
            "hooks": [entry[0].name for entry in pipe._executor.program if isinstance(entry[0], Hook)],
            "step": step_names,
            "evaluate": range_names(prof),
            "difference": difference,
        }
    return results
