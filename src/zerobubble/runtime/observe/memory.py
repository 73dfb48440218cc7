"""Measuring the activation memory a Pipeline keeps, op by op, on any device.

:class:`ActivationMeter` counts the bytes of every distinct tensor storage that a step keeps for
later ops: tensors autograd saved for the backward (seen through saved-tensor hooks), the
executor's kept stage inputs/outputs and hand-overs, and the W stores' deferred tensors.
Parameters and the caller's batch are not activations and are left out.  It reads the total after
every op (it is the Pipeline's recorder) and keeps the peak.

The benchmark that measures every schedule with it is :mod:`zerobubble_bench.memory`.
:func:`parameter_peak` (from :mod:`..parallel.fsdp`) measures the parameter bytes FSDP2 units hold
at their peak (``benchmarks/fsdp_units.py``).
"""

from __future__ import annotations

import weakref

import torch

from ..parallel.fsdp import ParameterPeak, parameter_peak
from ..tensors import storage_bytes, tensors_in

__all__ = [
    "ActivationMeter",
    "ParameterPeak",
    "parameter_peak",
    "storage_bytes",
    "tensors_in",
]


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
            tensors += tensors_in(state.saved)
            tensors += state.store.held_tensors()  # whatever the W store keeps for W
        tensors += tensors_in(executor._handoff)
        tensors += executor.ends.held_tensors()  # e.g. the vocabulary shard's logits and partials
        return storage_bytes(tensors, self.excluded)

    def op(self, op, start, end) -> None:
        """Recorder hook: called after every op; updates the peak."""
        self.peak = max(self.peak, self.live_bytes())

    def wait(self, key, start, end) -> None:
        """Recorder hook for transfer waits (nothing to measure)."""
