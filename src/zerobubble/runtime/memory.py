"""Measuring the activation memory a Pipeline keeps, op by op, on any device.

:class:`ActivationMeter` counts the bytes of every distinct tensor storage that a step keeps for
later ops: tensors autograd saved for the backward (seen through saved-tensor hooks), the
executor's kept stage inputs/outputs and hand-overs, and the W stores' deferred tensors.
Parameters and the caller's batch are not activations and are left out.  It reads the total after
every op (it is the Pipeline's recorder) and keeps the peak.

:func:`peak_memory` (a rank worker) and :func:`memory_table` measure every schedule on 2 local
ranks with Linear–GELU–Linear blocks; ``python benchmarks/memory.py`` prints the table and
``tests/test_runtime_memory.py`` checks it against the simulator's bound.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .launch import init_distributed, launch

WIDTH, ROWS, BLOCKS = 16, 4, 8


class _Held:
    """What a saved-tensor hook stores instead of the tensor: lets the meter see it while alive."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class ActivationMeter:
    """Recorder + saved-tensor hooks measuring the live activation bytes of one Pipeline.

    Use: ``meter = ActivationMeter(pipe, (inputs, targets)); pipe.recorder = meter``, then run
    ``pipe.step`` inside ``with meter.hooks():``; ``meter.peak`` is the largest total seen after
    an op, in bytes.  It walks every kept tensor after every op: a measuring tool, not for training.
    """

    def __init__(self, pipe, batch: tuple[torch.Tensor, ...]):
        self.pipe = pipe
        # parameters and the caller's batch are not activations of the step
        self.excluded = {t.untyped_storage().data_ptr() for t in [*pipe.parameters(), *batch]}
        self.held: weakref.WeakSet = weakref.WeakSet()
        self.peak = 0

    def hooks(self):
        """Context manager to wrap ``pipe.step`` in."""

        def pack(tensor):
            if tensor.untyped_storage().data_ptr() in self.excluded:
                return tensor
            held = _Held(tensor)
            self.held.add(held)
            return held

        def unpack(value):
            return value.tensor if isinstance(value, _Held) else value

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def live_bytes(self) -> int:
        """Bytes of the distinct activation storages alive now."""
        executor = self.pipe._executor
        tensors = [held.tensor for held in list(self.held)]
        for state in executor.stages.values():
            tensors += _tensors_in(state.saved)
            tensors += state.store.held_tensors()  # whatever the W store keeps for W
        tensors += _tensors_in(executor._handoff)
        storages = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self.excluded:
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def op(self, op, start, end) -> None:
        """Recorder hook: called after every op; updates the peak."""
        self.peak = max(self.peak, self.live_bytes())

    def wait(self, key, start, end) -> None:
        """Recorder hook for transfer waits (nothing to measure)."""


def _tensors_in(value: Any, depth: int = 5) -> list[torch.Tensor]:
    """Tensors inside nested dicts, lists and tuples (a few levels deep)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth == 0:
        return []
    if isinstance(value, dict):
        items: Iterator[Any] = iter(value.values())
    elif isinstance(value, (list, tuple)):
        items = iter(value)
    else:
        return []
    return [tensor for item in items for tensor in _tensors_in(item, depth - 1)]


def mlp_blocks(seed: int) -> list[nn.Module]:
    """``BLOCKS`` Linear–GELU–Linear blocks (a transformer MLP without the residual)."""
    torch.manual_seed(seed)
    return [
        nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        for _ in range(BLOCKS)
    ]


def peak_memory(cases: list[tuple[str, int]]) -> dict:
    """Peak live activation bytes of each ``(schedule, microbatches)`` on this rank (second step)."""
    init_distributed(backend="gloo", timeout=60)

    from .pipeline import Pipeline

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
