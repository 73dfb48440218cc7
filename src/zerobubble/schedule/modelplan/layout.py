"""What the ranks inside a pipeline stage do to a layer's costs: data parallelism and tensor parallelism.

A :class:`MeshLayout` turns a profile measured for the whole layer on one device into what one rank
of a ``pp × dp × tp`` mesh computes, holds and sends (``docs/auto-planning.md``, "Planning on a
mesh"):

* **tensor parallelism** divides each layer's compute and parameters by ``tp`` and the share
  :data:`TP_ACTIVATION_SHARE` of its activations (the rest, the residual stream and the norms'
  inputs, stays whole on every rank), and adds :attr:`MeshLayout.tp_collectives` all-reduces of the
  layer's output to its F and to its B (Megatron's two per block);
* **replicated data parallelism** keeps every byte and all-reduces the gradients once per step;
* **FSDP2** (``"fsdp"``; ``"hsdp"`` with ``dp_shard`` of the ``dp`` replicas per row) as the
  runtime drives it: every chunk of a rank is all-gathered once before its first forward and stays
  whole for the step, so a rank holds in the step its whole parameters (over ``tp``) *and* their
  shards, its whole gradients until the reduce-scatter after the chunk's last gradient op, and its
  optimizer state sharded; between steps it holds ``1/(shard·tp)`` of everything.

The step's data-parallel collectives are counted as exposed in full (the runtime's all-gather and
reduce-scatter block, and the replicated all-reduce starts after the rank's last gradient op).

Pure Python; no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..ir import ScheduleError
from .amounts import format_bytes
from .profile import LayerProfile, ModelProfile

TP_ACTIVATION_SHARE = 24 / 34
"""The share of a transformer block's activations that tensor parallelism divides: 24 of the
``34·s·b·h`` bytes per block that Korthikanti et al. (2022, "Reducing Activation Recomputation in
Large Transformer Models", eq. 2) count without the attention scores."""

SHARDINGS = (None, "fsdp", "hsdp")
"""How data-parallel replicas hold the parameters: None (replicated, gradients all-reduced),
``"fsdp"`` (FSDP2: sharded over every replica) or ``"hsdp"`` (FSDP2 on a 2-D data-parallel mesh:
sharded along ``dp_shard``, replicated along ``dp_replicate``)."""

DATA_PARALLEL_MODES = ("replicate", "fsdp", "hsdp")
"""The same, as the Pipeline's ``data_parallel=`` on a mesh and the command line name them."""


@dataclass(frozen=True)
class Link:
    """A collective's link: ``latency + bytes / bandwidth`` seconds per message (bandwidth 0: no
    size term)."""

    latency: float = 0.0
    bandwidth: float = 0.0

    def time(self, volume: float) -> float:
        """Seconds for ``volume`` bytes on the link (0 for none)."""
        if volume <= 0:
            return 0.0
        return self.latency + (volume / self.bandwidth if self.bandwidth > 0 else 0.0)


@dataclass(frozen=True)
class MeshLayout:
    """How the ``dp × tp`` ranks of one pipeline stage hold and compute its layers.

    ``dp`` counts every data-parallel replica (HSDP: rows × ``dp_shard``); ``sharding`` is None
    (replicated), ``"fsdp"`` (sharded over all ``dp``) or ``"hsdp"`` (sharded over ``dp_shard``,
    replicated across the rows); ``tp_link`` and ``dp_link`` time the collectives.
    """

    dp: int = 1
    tp: int = 1
    sharding: str | None = None
    dp_shard: int | None = None
    tp_link: Link = Link()
    dp_link: Link = Link()
    tp_collectives: int = 2
    tp_activation_share: float = TP_ACTIVATION_SHARE

    def __post_init__(self) -> None:
        if self.dp < 1 or self.tp < 1:
            raise ScheduleError(f"dp and tp must be at least 1, got dp={self.dp}, tp={self.tp}")
        if self.sharding not in SHARDINGS:
            raise ScheduleError(f"sharding {self.sharding!r}: choose replicate, fsdp or hsdp")
        if self.sharding is not None and self.dp < 2:
            raise ScheduleError(f"{self.sharding} shards over the data-parallel ranks: give dp ≥ 2")
        if self.sharding == "hsdp" and (
            self.dp_shard is None or self.dp_shard < 2 or self.dp % self.dp_shard or self.dp_shard == self.dp
        ):
            raise ScheduleError(
                f"hsdp needs dp_shard ≥ 2, a proper divisor of dp={self.dp} (got {self.dp_shard}): "
                "dp = dp_replicate × dp_shard"
            )

    @property
    def shard(self) -> int:
        """Ranks a parameter is cut over (1: replicated)."""
        if self.sharding == "hsdp":
            assert self.dp_shard is not None
            return self.dp_shard
        return self.dp if self.sharding == "fsdp" else 1

    @property
    def trivial(self) -> bool:
        """One rank per stage: nothing to change."""
        return self.dp == 1 and self.tp == 1

    def describe(self) -> str:
        """``dp 4 (HSDP, 2 rows × 2 shards) × tp 2``."""
        mode = {None: "replicated", "fsdp": "FSDP2"}.get(self.sharding)
        if mode is None:
            mode = f"HSDP, {self.dp // self.shard} rows × {self.shard} shards"
        return f"dp {self.dp} ({mode}) × tp {self.tp}"

    # -- one rank's share of a layer -------------------------------------------------------------

    def per_rank(self, profile: ModelProfile) -> ModelProfile:
        """``profile`` as one rank computes it: tensor-parallel times and activations (the bytes a
        rank holds whatever the schedule does are :meth:`static_bytes`)."""
        if self.tp == 1:
            return profile
        return replace(profile, layers=tuple(self._tensor_parallel(layer) for layer in profile.layers))

    def _tensor_parallel(self, layer: LayerProfile) -> LayerProfile:
        t = self.tp
        reduce = self.tp_collectives * self.all_reduce(layer.output_bytes, t, self.tp_link)
        kept = 1 - self.tp_activation_share + self.tp_activation_share / t
        return replace(
            layer,
            forward=layer.forward / t + reduce,
            backward_input=layer.backward_input / t + reduce,
            backward_weight=layer.backward_weight / t,
            backward_fused=layer.backward_fused / t + reduce if layer.backward_fused > 0 else 0.0,
            activation_bytes=layer.activation_bytes * kept,
            weight_input_bytes=layer.weight_input_bytes * kept,
        )

    def static_bytes(self, layer: LayerProfile) -> float:
        """The most parameter, gradient and optimizer-state bytes of ``layer`` one rank holds in a step."""
        p, g, o = (
            value / self.tp for value in (layer.parameter_bytes, layer.gradient_bytes, layer.optimizer_bytes)
        )
        s = self.shard
        if s == 1:
            return p + g + o
        return p * (1 + 1 / s) + g + o / s

    def resident_bytes(self, layer: LayerProfile) -> float:
        """The bytes of ``layer`` one rank keeps between steps (sharded)."""
        return layer.static_bytes / (self.tp * self.shard)

    def step_seconds(self, layers: Sequence[LayerProfile], chunks: int = 1) -> float:
        """The data-parallel collectives of one step for a rank holding ``layers`` in ``chunks``
        chunks: FSDP's all-gather and reduce-scatter (HSDP: and the rows' all-reduce), or the
        replicated all-reduce; one message per chunk."""
        if self.dp == 1:
            return 0.0
        params = math.fsum(layer.parameter_bytes for layer in layers) / self.tp
        grads = math.fsum(layer.gradient_bytes for layer in layers) / self.tp
        link, s = self.dp_link, self.shard
        if s == 1:
            return chunks * self.all_reduce(grads / chunks, self.dp, link)
        rows = self.dp // s
        gather = link.time((s - 1) / s * params / chunks)
        scatter = link.time((s - 1) / s * grads / chunks)
        return chunks * (gather + scatter + self.all_reduce(grads / s / chunks, rows, link))

    @staticmethod
    def all_reduce(size: float, ranks: int, link: Link) -> float:
        """A ring all-reduce of ``size`` bytes over ``ranks`` ranks: ``2(n−1)/n`` of it crosses each link."""
        return link.time(2 * (ranks - 1) / ranks * size) if ranks > 1 else 0.0

    def memory_text(self, layers: Sequence[LayerProfile], peak: float) -> str:
        """What a rank holding ``layers`` keeps, for a plan's reason."""
        static = math.fsum(self.static_bytes(layer) for layer in layers)
        resident = math.fsum(self.resident_bytes(layer) for layer in layers)
        return (
            f"on {self.describe()} the busiest rank holds {format_bytes(peak)} at its peak: "
            f"{format_bytes(static)} of parameters, gradients and optimizer state in the step "
            f"({format_bytes(resident)} between steps) and {format_bytes(peak - static)} of activations"
        )


def parse_mesh(text: str) -> dict[str, int]:
    """``"pp=2,dp=2,tp=2"`` (also ``dp_replicate=``, ``dp_shard=``) as a dict; unnamed sizes are 1."""
    sizes = {"pp": 1, "dp": 1, "tp": 1, "dp_replicate": 1, "dp_shard": 1}
    for part in filter(None, (piece.strip() for piece in text.split(","))):
        name, _, value = part.partition("=")
        if name not in sizes or not value.strip().isdigit() or int(value) < 1:
            raise ScheduleError(
                f"mesh {text!r}: each part is NAME=SIZE with NAME one of {', '.join(sizes)} and SIZE ≥ 1 "
                "(e.g. pp=2,dp=2,tp=2)"
            )
        sizes[name] = int(value)
    if sizes["dp"] > 1 and sizes["dp_replicate"] * sizes["dp_shard"] > 1:
        raise ScheduleError(f"mesh {text!r}: give dp=, or dp_replicate= and dp_shard= (HSDP), not both")
    return sizes


def mesh_layout(sizes: dict[str, int], data_parallel: str = "replicate", link: Link = Link()) -> MeshLayout:
    """The :class:`MeshLayout` of :func:`parse_mesh`'s sizes with ``data_parallel`` ``"replicate"``,
    ``"fsdp"`` or ``"hsdp"`` (over ``dp_shard``), every collective on ``link``."""
    if data_parallel not in DATA_PARALLEL_MODES:
        raise ScheduleError(f"data parallelism {data_parallel!r}: choose replicate, fsdp or hsdp")
    hsdp = sizes["dp_replicate"] * sizes["dp_shard"] > 1
    if (data_parallel == "hsdp") != hsdp and not (data_parallel == "replicate" and hsdp):
        raise ScheduleError(
            "hsdp runs on dp_replicate= and dp_shard= (e.g. pp=2,dp_replicate=2,dp_shard=2); fsdp on dp="
        )
    dp = sizes["dp"] * sizes["dp_replicate"] * sizes["dp_shard"]
    sharding = None if data_parallel == "replicate" or dp == 1 else data_parallel
    shard = sizes["dp_shard"] if sharding == "hsdp" else None
    return MeshLayout(dp=dp, tp=sizes["tp"], sharding=sharding, dp_shard=shard, tp_link=link, dp_link=link)
