"""What the model-level planner plans from: per-layer costs of a model and its transfer model.

A :class:`ModelProfile` holds what :mod:`zerobubble.runtime.construct.profile` measures per layer at the
microbatch size — ``T_F``, ``T_B``, ``T_W`` (seconds), the activation bytes a forward keeps for its
B and a B keeps for its W, parameter + gradient + optimizer-state bytes and the bytes of the output
that crosses a cut after the layer — plus the transfer model ``T_comm = latency + bytes/bandwidth``.
:func:`stage_costs` maps a partition of its layers onto per-stage costs for the builders.

Pure Python; no torch.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..costs import CostModel
from ..ir import ScheduleError


@dataclass(frozen=True)
class LayerProfile:
    """Measured costs of one layer for one microbatch (seconds and bytes).

    ``activation_bytes`` is what F keeps alive until B (saved tensors); ``weight_input_bytes`` what B
    keeps until W (0 for a layer without deferred weight gradients); ``output_bytes`` what crosses a
    cut placed right after this layer.  ``backward_fused`` is the time of the fused backward (BW) that
    1F1B, GPipe and interleaved 1F1B run, 0 when not measured (then ``T_B + T_W`` stands for it).
    ``all_to_all`` is a mixture-of-experts layer's expert all-to-all of one F, and as much again of
    one B, outside ``T_F`` and ``T_B`` (:mod:`.moe`; ``CostModel.a2a``).
    """

    name: str
    forward: float
    backward_input: float
    backward_weight: float
    activation_bytes: float = 0.0
    weight_input_bytes: float = 0.0
    parameter_bytes: float = 0.0
    gradient_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    output_bytes: float = 0.0
    backward_fused: float = 0.0
    all_to_all: float = 0.0

    @property
    def fused(self) -> float:
        """The fused backward's time: measured, or ``T_B + T_W``."""
        return self.backward_fused if self.backward_fused > 0 else self.backward_input + self.backward_weight

    @property
    def work(self) -> float:
        """``T_F + T_B + T_W``: one microbatch's compute, and its all-to-all where not hidden."""
        return self.forward + self.backward_input + self.backward_weight + 2 * self.all_to_all

    @property
    def static_bytes(self) -> float:
        """Parameters, gradients and optimizer state: held whatever the schedule does."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class ModelProfile:
    """Per-layer costs of a model at one microbatch size, and the measured transfer model.

    A message of ``x`` bytes between ranks takes ``comm_latency + x / comm_bandwidth`` seconds
    (``comm_bandwidth = 0``: no size term).  ``bytes_known`` is False for a profile of times only (a
    trace recorded without a layer profile): its layers' byte fields are then placeholders, one unit
    of activations a layer kept until its W (the memory model a Pipeline without ``costs`` plans
    with), so that schedules whose memory limit is relative (zb-1p's ``p·M_B``) can still be
    built; the planner reports no bytes for it and refuses a byte budget.
    """

    layers: tuple[LayerProfile, ...]
    comm_latency: float = 0.0
    comm_bandwidth: float = 0.0
    microbatch_size: int | None = None
    source: str = ""
    meta: Mapping[str, Any] = field(default_factory=dict)
    bytes_known: bool = True

    def __post_init__(self) -> None:
        if not self.layers:
            raise ScheduleError("a profile needs at least one layer")
        object.__setattr__(self, "layers", tuple(self.layers))

    def transfer_time(self, size: float) -> float:
        """Seconds one message of ``size`` bytes takes between neighbouring ranks."""
        return self.comm_latency + (size / self.comm_bandwidth if self.comm_bandwidth > 0 else 0.0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (:meth:`from_dict` reads it back)."""
        data = asdict(self)
        data["meta"] = dict(self.meta)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelProfile:
        """Inverse of :meth:`to_dict`; a clear error for a file that is not a profile."""
        try:
            layers = tuple(LayerProfile(**layer) for layer in data["layers"])
            rest = {key: value for key, value in data.items() if key != "layers"}
            return cls(layers=layers, **rest)
        except (KeyError, TypeError) as error:
            raise ScheduleError(
                f"not a layer profile ({error}); write one with 'zerobubble profile -o FILE'"
            ) from None

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> ModelProfile:
        """Read a profile written by :meth:`save`."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ScheduleError(f"cannot read profile {str(path)!r}: {error}") from None
        return cls.from_dict(data)


def median_profile(profiles: Sequence[ModelProfile]) -> ModelProfile:
    """Several measurements of one model (e.g. one per rank) as one: the median of each layer's times.

    Bytes and the transfer model come from the first profile (bytes do not depend on who measured).
    """
    if not profiles:
        raise ScheduleError("no profile to combine")
    first = profiles[0]
    if any(len(p.layers) != len(first.layers) for p in profiles):
        raise ScheduleError("the profiles to combine have different numbers of layers")

    median = statistics.median

    def combined(index: int) -> LayerProfile:
        samples = [p.layers[index] for p in profiles]
        return replace(
            first.layers[index],
            forward=median([s.forward for s in samples]),
            backward_input=median([s.backward_input for s in samples]),
            backward_weight=median([s.backward_weight for s in samples]),
            backward_fused=median([s.backward_fused for s in samples]),
        )

    layers = tuple(combined(index) for index in range(len(first.layers)))
    source = f"{first.source}; median over {len(profiles)} profiles" if len(profiles) > 1 else first.source
    return replace(first, layers=layers, source=source)


def stage_costs(
    profile: ModelProfile,
    cuts: Sequence[int],
    stages: int,
    memory_limit: Sequence[float] | None = None,
    fused: bool = False,
) -> CostModel:
    """Per-virtual-stage costs (seconds, bytes) of the partition ``cuts`` into ``stages`` chunks.

    Each stage's F, B, W and activation bytes are the sums over its layers; the transfer after
    stage ``s`` carries the output of its last layer, its ``a2a`` the layers' all-to-all.
    ``memory_limit`` is per rank, in bytes of activations.  With ``fused`` (a schedule of BW ops) B
    is the measured fused backward and W is 0.
    """
    bounds = [0, *cuts, len(profile.layers)]
    groups = [profile.layers[bounds[s] : bounds[s + 1]] for s in range(stages)]

    def total(name: str) -> list[float]:
        return [math.fsum(getattr(layer, name) for layer in group) for group in groups]

    comm = [profile.transfer_time(group[-1].output_bytes) for group in groups[:-1]] + [0.0]
    a2a = total("all_to_all")
    return CostModel(
        f=total("forward"),
        b=total("fused") if fused else total("backward_input"),
        w=[0.0] * stages if fused else total("backward_weight"),
        comm=comm,
        mem_b=total("activation_bytes"),
        mem_w=[min(w, b) for w, b in zip(total("weight_input_bytes"), total("activation_bytes"))],
        memory_limit=list(memory_limit) if memory_limit is not None else None,
        a2a=a2a if any(a2a) else 0.0,
    )
