"""How data-parallel communication is laid out, as one torch-free record: :class:`FSDPOptions`.

The data-parallel *mode* (none, replicated, FSDP, HSDP) is the :class:`~.grid.Grid`'s
(``grid.dp``, ``grid.sharding``); this record says how that mode runs: FSDP's unit size, when a
unit's gathered parameters are freed, how many units are gathered ahead, and the replicated
all-reduce's bucket size.  Every consumer reads this one record (``docs/architecture.md``):

* the runtime: ``Pipeline(..., data_parallel="fsdp", fsdp=FSDPOptions(...))`` makes FSDP2 units,
  ``Pipeline(..., data_parallel=2, fsdp=FSDPOptions(bucket_bytes=...))`` all-reduces in buckets;
* the lowering: ``lower(schedule, options, grid=grid, ...)`` places unshard, reshard,
  reduce-scatter and all-reduce per unit or bucket; its chooser simulates candidate records;
* the planner: ``Grid.comm`` holds the record its closed form scores (``plan --cluster``).

:data:`ONCE_PER_STEP` is everyone's default: one unit per chunk, gathered once a step and kept.
Pure Python; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import OptionsError

UNIT_WORDS = ("chunk", "layer")
"""The unit sizes :class:`FSDPOptions` takes by name (or else a positive layer count)."""


@dataclass(frozen=True)
class FSDPOptions:
    """How the data-parallel replicas communicate: ``Pipeline(..., fsdp=FSDPOptions())``.

    ``units``: ``"layer"`` (one FSDP unit per layer, ZeRO-3's layout), a positive int N (runs of N
    layers of a chunk), or ``"chunk"``.  ``reshard_after_forward``: free a unit's gathered parameters
    after each forward, gathering it again when next read; ``reshard_after_backward`` (None: the
    same as ``reshard_after_forward``) the same after each gradient op, else a unit stays whole to
    its reduce-scatter.  ``prefetch``: units gathered ahead (0: none).  ``bucket_bytes``: the
    replicated all-reduce's buckets (0: one per chunk; the lowering, the planner and the runtime's
    replicas read it).  ``reduce_after_step``: every gradient reduction issued after the step's last
    compute, not when its unit's or bucket's last gradient is ready (Megatron-LM 2021's DDP
    all-reduced after the whole pipeline; the lowering and planner read it, the runtime refuses it).
    :data:`ONCE_PER_STEP` (``fsdp=None``) is one unit per chunk, gathered once a step and kept.
    Bad values raise :class:`~zerobubble.errors.OptionsError`.
    """

    units: str | int = "layer"
    reshard_after_forward: bool = True
    reshard_after_backward: bool | None = None
    prefetch: int = 1
    bucket_bytes: float = 0.0
    reduce_after_step: bool = False

    def __post_init__(self) -> None:
        units = self.units
        if isinstance(units, bool) or not (units in UNIT_WORDS or (isinstance(units, int) and units >= 1)):
            raise OptionsError(
                f'FSDPOptions(units={units!r}): "layer" (one FSDP2 unit per layer), "chunk" (one per '
                "chunk) or a positive number of layers per unit"
            )
        if self.reshard_after_backward is None:
            object.__setattr__(self, "reshard_after_backward", self.reshard_after_forward)
        for name in ("reshard_after_forward", "reshard_after_backward"):
            if not isinstance(getattr(self, name), bool):
                raise OptionsError(f"FSDPOptions({name}={getattr(self, name)!r}): True or False")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise OptionsError(
                f"FSDPOptions(prefetch={self.prefetch!r}): the number of units gathered ahead, 0 or more"
            )
        bucket = self.bucket_bytes
        if isinstance(bucket, bool) or not isinstance(bucket, (int, float)) or not bucket >= 0:
            raise OptionsError(f"FSDPOptions(bucket_bytes={bucket!r}): a byte count, 0 or more")
        if not isinstance(self.reduce_after_step, bool):
            raise OptionsError(f"FSDPOptions(reduce_after_step={self.reduce_after_step!r}): True or False")

    @property
    def once_per_step(self) -> bool:
        """Whether this is the default layout: one unit per chunk, gathered once a step and kept."""
        return self.units == "chunk" and not self.resharded

    @property
    def resharded(self) -> bool:
        """Whether a unit is ever freed inside the step (after a forward or a gradient op)."""
        return bool(self.reshard_after_forward or self.reshard_after_backward)

    def unit_size(self, layers: int) -> int:
        """Layers per unit in a chunk of ``layers`` layers."""
        if self.units == "layer":
            return 1
        return max(layers, 1) if self.units == "chunk" else int(self.units)

    def describe(self, mode: str = "fsdp") -> str:
        """The record in words under the data-parallel ``mode`` (``"none"``, ``"replicate"``,
        ``"fsdp"``), for a plan's or a lowering's reason."""
        if mode == "replicate":
            size = "one bucket per chunk" if self.bucket_bytes <= 0 else f"{self.bucket_bytes:g}-byte buckets"
            return f"replicated, all-reduce in {size}" + self._reduced_text()
        if mode != "fsdp":
            return "no data parallelism"
        unit = {"chunk": "per-chunk", "layer": "per-layer"}.get(str(self.units), f"{self.units}-layer")
        policy = (("forward", self.reshard_after_forward), ("backward", self.reshard_after_backward))
        after = [name for name, on in policy if on]
        keep = f"reshard after {' and '.join(after)}" if after else "kept whole until the last gradient op"
        return f"FSDP {unit} units, {keep}, prefetch {self.prefetch}" + self._reduced_text()

    def _reduced_text(self) -> str:
        return ", reduced after the step" if self.reduce_after_step else ""


ONCE_PER_STEP = FSDPOptions(units="chunk", reshard_after_forward=False, prefetch=1)
"""The default of every consumer (``fsdp=None``): each chunk one unit, gathered once a step, kept
whole until its reduce-scatter; replicated gradients all-reduced once per chunk."""
