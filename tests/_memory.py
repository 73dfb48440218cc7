"""Measuring the activation memory the runtime keeps, op by op (for tests/test_runtime_memory.py).

:class:`ActivationMeter` counts the bytes of every distinct tensor storage that a step keeps for
later ops: tensors autograd saved for the backward (through saved-tensor hooks), the executor's
kept stage inputs/outputs and hand-overs, and the W stores' deferred entries.  Parameters are not
activations and are left out.  It reads the total after every op (it is the Pipeline's recorder)
and keeps the peak.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from zerobubble.runtime.launch import init_distributed

WIDTH, ROWS, BLOCKS = 16, 4, 8


class _Held:
    """What a saved-tensor hook stores instead of the tensor: lets the meter see it while alive."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class ActivationMeter:
    """Recorder + saved-tensor hooks measuring the live activation bytes of one Pipeline."""

    def __init__(self, pipe, batch: tuple[torch.Tensor, ...]):
        self.pipe = pipe
        # parameters and the caller's batch are not activations of the step
        self.params = {t.untyped_storage().data_ptr() for t in [*pipe.parameters(), *batch]}
        self.held: weakref.WeakSet = weakref.WeakSet()
        self.peak = 0

    def hooks(self):
        """Context manager to wrap ``pipe.step`` in."""

        def pack(tensor):
            if tensor.untyped_storage().data_ptr() in self.params:
                return tensor
            held = _Held(tensor)
            self.held.add(held)
            return held

        def unpack(value):
            return value.tensor if isinstance(value, _Held) else value

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def live_bytes(self) -> int:
        executor = self.pipe._executor
        tensors = [held.tensor for held in list(self.held)]
        for state in executor.stages.values():
            for inputs, outputs in state.saved.values():
                tensors += [*inputs, *outputs]
            for entries in state.store._pending.values():
                for entry in entries:
                    tensors += [t for t in entry if isinstance(t, torch.Tensor)]
        for message in executor._handoff.values():
            tensors += list(message)
        storages = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self.params:
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def op(self, op, start, end) -> None:
        self.peak = max(self.peak, self.live_bytes())

    def wait(self, key, start, end) -> None:
        pass


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
    from zerobubble import Pipeline

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
