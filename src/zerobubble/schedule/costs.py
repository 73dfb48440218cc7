"""Cost model: how long each op takes and how much activation memory it holds.

Costs are given **per rank-stage** (everything one rank holds in a non-chunked split, docs/concepts.md):
``f, b, w`` are the times of F, B and W, ``comm`` the transfer time between neighbouring stages,
``mem_b`` the activation memory a forward allocates and ``mem_w`` the part of it that B keeps alive
until W.  A chunked schedule gives each of its ``v`` chunks ``1/v`` of the times and memory; the
transfer time is per hop and is not divided.

A vocabulary-parallel output layer (S and T ops, one vocabulary shard per rank) has its own costs,
per shard: ``vocab_s`` and ``vocab_t`` the times of S and T, ``vocab_mem`` the memory S keeps until
T, ``vocab_comm`` the latency of its collectives (the hidden states' broadcast, the reduction).

A mixture-of-experts stage adds ``a2a``: the expert all-to-all time (dispatch plus combine) of one
F and, as much again, of one B.  It is exposed: F takes ``f + a2a`` and B ``b + a2a``, except in an
overlapped F&B pair, where each half's all-to-all hides behind the other's compute (docs/schedulers.md,
"DualPipeV"); the *ideal* counts compute only.

Every number may be a scalar or a per-stage list: a list of length ``p`` is per rank-stage (divided
among that rank's chunks), a list of length ``S = p*v`` is per virtual stage and used as it is.
:meth:`CostModel.resolve` turns a model into per-virtual-stage tuples for a given placement.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from .ir import Kind, Op, Placement, ScheduleError

PerStage = float | Sequence[float]


def _as_values(name: str, value: PerStage) -> tuple[float, ...] | float:
    items: tuple[float, ...]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        values: tuple[float, ...] | float = float(value)
        items = (float(value),)
    else:
        try:
            items = tuple(float(v) for v in value)  # type: ignore[union-attr]  # a bool lands in the except
        except (TypeError, ValueError):
            raise ScheduleError(
                f"cost {name!r} must be a number or a list of numbers, got {value!r}"
            ) from None
        if not items:
            raise ScheduleError(f"cost {name!r} is an empty list")
        values = items
    for item in items:
        if not math.isfinite(item) or item < 0:
            raise ScheduleError(f"cost {name!r} must be finite and non-negative, got {item}")
    return values


@dataclass(frozen=True)
class CostModel:
    """Per rank-stage times and memory of a pipeline, plus an optional per-rank memory limit.

    The defaults (``f = b = w = 1``, no transfer time, ``mem_b = 1``, ``mem_w = 0``) are the unit
    costs the paper's closed forms use.  ``memory_limit`` is an absolute amount per rank (scalar or
    one value per rank), in the unit of ``mem_b``; ``None`` means unlimited.
    """

    f: PerStage = 1.0
    b: PerStage = 1.0
    w: PerStage = 1.0
    comm: PerStage = 0.0
    mem_b: PerStage = 1.0
    mem_w: PerStage = 0.0
    memory_limit: PerStage | None = None
    vocab_s: PerStage = 0.0
    vocab_t: PerStage = 0.0
    vocab_comm: PerStage = 0.0
    vocab_mem: PerStage = 0.0
    a2a: PerStage = 0.0

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if value is None:
                continue
            object.__setattr__(self, item.name, _as_values(item.name, value))
        if self.memory_limit is not None:
            limits = self.memory_limit if isinstance(self.memory_limit, tuple) else (self.memory_limit,)
            if any(limit <= 0 for limit in limits):
                raise ScheduleError(f"memory limit must be positive, got {self.memory_limit}")

    def replace(self, **changes: Any) -> CostModel:
        """A copy with some fields changed."""
        data = {item.name: getattr(self, item.name) for item in fields(self)}
        data.update(changes)
        return CostModel(**data)

    def with_memory_limit(self, limit: PerStage | None) -> CostModel:
        """A copy with another memory limit."""
        return self.replace(memory_limit=limit)

    def apply_memory_limit(self, spec: str | float | None, num_ranks: int) -> CostModel:
        """A copy limited per rank to ``spec``: an amount, or ``"Np"`` = N·p·M_B
        (:func:`parse_memory_limit`); ``None`` keeps these costs as they are."""
        if spec is None:
            return self
        return self.with_memory_limit(parse_memory_limit(spec, num_ranks, self.mem_b))

    def resolve(self, placement: Placement) -> StageCosts:
        """Per-virtual-stage costs for ``placement`` (see the module docstring for list lengths)."""
        p, S, v = placement.num_ranks, placement.num_stages, placement.chunks

        def per_stage(name: str, divide: bool) -> tuple[float, ...]:
            value = getattr(self, name)
            scale = 1.0 / v if divide else 1.0
            if isinstance(value, float):
                return (value * scale,) * S
            if len(value) == S:
                return tuple(value)
            if len(value) == p:
                return tuple(value[placement.rank_of(s)] * scale for s in range(S))
            raise ScheduleError(
                f"cost {name!r} has {len(value)} values; give one number, {p} (one per rank) "
                f"or {S} (one per virtual stage)"
            )

        limit = self.memory_limit
        if limit is None:
            limits = (math.inf,) * p
        elif isinstance(limit, float):
            limits = (limit,) * p
        elif len(limit) == p:
            limits = tuple(limit)
        else:
            raise ScheduleError(
                f"memory limit has {len(limit)} values; give one number or {p} (one per rank)"
            )
        a2a = per_stage("a2a", True)
        return StageCosts(
            placement=placement,
            # the all-to-all is part of an op's time unless hidden (StageCosts.pair_duration)
            f=tuple(f + a for f, a in zip(per_stage("f", True), a2a)),
            b=tuple(b + a for b, a in zip(per_stage("b", True), a2a)),
            w=per_stage("w", True),
            comm=per_stage("comm", False),
            mem_b=per_stage("mem_b", True),
            mem_w=per_stage("mem_w", True),
            memory_limit=limits,
            vocab_s=self._per_shard("vocab_s", p),
            vocab_t=self._per_shard("vocab_t", p),
            vocab_comm=self._per_shard("vocab_comm", p),
            vocab_mem=self._per_shard("vocab_mem", p),
            a2a=a2a,
        )

    def _per_shard(self, name: str, p: int) -> tuple[float, ...]:
        value = getattr(self, name)
        if isinstance(value, float):
            return (value,) * p
        if len(value) == p:
            return tuple(value)
        raise ScheduleError(f"cost {name!r} has {len(value)} values; give one number or {p} (one per shard)")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``a2a`` only when set, so files of dense models read as before)."""
        return {
            item.name: (list(value) if isinstance(value, tuple) else value)
            for item in fields(self)
            for value in [getattr(self, item.name)]
            if item.name != "a2a" or value != 0.0
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostModel:
        """Inverse of :meth:`to_dict`."""
        known = {item.name for item in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ScheduleError(f"unknown cost fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**dict(data))


@dataclass(frozen=True)
class StageCosts:
    """A :class:`CostModel` resolved to per-virtual-stage tuples for one placement.

    ``f`` and ``b`` are the times F and B take alone, their expert all-to-all ``a2a`` included.
    """

    placement: Placement
    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    comm: tuple[float, ...]
    mem_b: tuple[float, ...]
    mem_w: tuple[float, ...]
    memory_limit: tuple[float, ...]
    vocab_s: tuple[float, ...] = ()
    vocab_t: tuple[float, ...] = ()
    vocab_comm: tuple[float, ...] = ()
    vocab_mem: tuple[float, ...] = ()
    a2a: tuple[float, ...] = ()
    _durations: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        p = self.placement.num_ranks
        for name in VOCAB_COST_FIELDS:
            if not getattr(self, name):
                object.__setattr__(self, name, (0.0,) * p)
        if not self.a2a:
            object.__setattr__(self, "a2a", (0.0,) * self.placement.num_stages)
        durations = {
            Kind.F: self.f,
            Kind.B: self.b,
            Kind.W: self.w,
            Kind.BW: tuple(b + w for b, w in zip(self.b, self.w)),
            Kind.S: self.vocab_s,
            Kind.T: self.vocab_t,
        }
        object.__setattr__(self, "_durations", durations)

    def duration(self, op: Op) -> float:
        """How long ``op`` computes."""
        return self._durations[op.kind][op.stage]

    def pair_duration(self, forward: Op, backward: Op) -> float:
        """How long an overlapped F&B pair computes: its two halves' compute runs one after the
        other on the device, their all-to-alls one after the other on the expert link, each half's
        all-to-all during the other's compute; so the pair takes the longer of the two sums
        (docs/schedulers.md, "DualPipeV").  Without all-to-all time it is the halves' sum."""
        a2a = self.a2a[forward.stage] + self.a2a[backward.stage]
        compute = self.duration(forward) + self.duration(backward) - a2a
        return compute if a2a == 0.0 else max(compute, a2a)

    def memory_delta(self, op: Op) -> float:
        """Change of a rank's activation memory when ``op`` runs (F allocates, B/W/BW release)."""
        s = op.stage
        if op.kind is Kind.F:
            return self.mem_b[s]
        if op.kind is Kind.S:
            return self.vocab_mem[s]
        if op.kind is Kind.T:
            return -self.vocab_mem[s]
        if op.kind is Kind.B:
            return -(self.mem_b[s] - self.mem_w[s])
        if op.kind is Kind.W:
            return -self.mem_w[s]
        return -self.mem_b[s]

    def rank_work(self, rank: int, microbatches: int, *, vocab: bool = False) -> float:
        """Compute time one rank needs for ``microbatches`` microbatches (no idling); ``vocab`` adds
        its vocabulary shard's S and T."""
        stages = self.placement.stages_of(rank)
        work = sum(self.f[s] + self.b[s] + self.w[s] for s in stages)
        if vocab:
            work += self.vocab_s[rank] + self.vocab_t[rank]
        return microbatches * work

    def rank_compute(self, rank: int, microbatches: int, *, vocab: bool = False) -> float:
        """:meth:`rank_work` without the all-to-all time: what no schedule, however much it hides,
        can undercut (the simulator's ideal)."""
        work = self.rank_work(rank, microbatches, vocab=vocab)
        exposed = sum(self.a2a[s] for s in self.placement.stages_of(rank))
        return work if exposed == 0.0 else work - 2 * microbatches * exposed

    @property
    def memory_unit(self) -> float:
        """``M_B`` of one rank-stage (the mean over ranks), the unit peak memory is reported in."""
        p = self.placement.num_ranks
        total = sum(self.mem_b)
        return total / p if total > 0 else 1.0


#: The :class:`CostModel` fields of a vocabulary-parallel output layer (per shard).
VOCAB_COST_FIELDS = ("vocab_s", "vocab_t", "vocab_comm", "vocab_mem")

#: Relative and absolute slack of every memory-limit comparison (floating-point sums of M_B, M_W).
MEMORY_TOLERANCE = 1e-9


def memory_cap(limit: float) -> float:
    """The largest activation memory that respects ``limit``: ``limit·(1 + ε) + ε`` with
    ``ε = MEMORY_TOLERANCE`` (the one rule every builder, the validator and the bounds use)."""
    return limit * (1 + MEMORY_TOLERANCE) + MEMORY_TOLERANCE


def within_limit(level: float, limit: float) -> bool:
    """Whether an activation-memory ``level`` respects ``limit`` (see :func:`memory_cap`)."""
    return level <= memory_cap(limit)


_LIMIT_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*p\s*$")


def parse_memory_limit(text: str | float | None, num_ranks: int, mem_b: PerStage = 1.0) -> float | None:
    """Read a memory limit: an absolute amount, or ``"Np"`` meaning ``N * p * M_B``.

    ``mem_b`` is the per rank-stage activation memory (a per-rank or per-virtual-stage list gives its
    per-rank mean), so ``"1p"`` is
    the memory 1F1B needs and ``"2p"`` twice that.
    """
    if text is None:
        return None
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        match = _LIMIT_PATTERN.match(text)
        if match:
            # a list is per rank (length p) or per virtual stage (length p·v): either way one
            # rank-stage holds sum / p on average
            unit = mem_b if isinstance(mem_b, (int, float)) else sum(mem_b) / num_ranks
            value = float(match.group(1)) * num_ranks * float(unit)
        else:
            try:
                value = float(text)
            except ValueError:
                raise ScheduleError(
                    f"cannot read memory limit {text!r}: give an amount (e.g. 12) or a multiple of "
                    "p*M_B (e.g. 1p, 2p, 1.5p)"
                ) from None
    if not math.isfinite(value) or value <= 0:
        raise ScheduleError(f"memory limit must be positive, got {text!r}")
    return value


def transformer_costs(
    hidden: int,
    heads: int,
    seq_len: int,
    micro_batch: int = 1,
    layers_per_stage: float = 1.0,
    flops_per_time_unit: float = 1.0,
    comm: float = 0.0,
) -> CostModel:
    """Costs of a stage of ``layers_per_stage`` transformer layers, from the paper's Table 1.

    Per layer, with microbatch ``b``, sequence ``s``, hidden ``h`` and ``a`` heads: F = sbh(24h+4s),
    B = sbh(24h+8s), W = sbh·24h FLOPs; activation memory M_B = sb(34h+5as) and M_W = 32sbh (bytes
    in 16-bit precision).  Times are FLOPs divided by ``flops_per_time_unit``.
    """
    for name, value in (
        ("hidden", hidden),
        ("heads", heads),
        ("seq_len", seq_len),
        ("micro_batch", micro_batch),
    ):
        if value < 1:
            raise ScheduleError(f"{name} must be ≥ 1, got {value}")
    if layers_per_stage <= 0 or flops_per_time_unit <= 0:
        raise ScheduleError("layers_per_stage and flops_per_time_unit must be positive")
    s, b, h, a = seq_len, micro_batch, hidden, heads
    scale = layers_per_stage / flops_per_time_unit
    return CostModel(
        f=s * b * h * (24 * h + 4 * s) * scale,
        b=s * b * h * (24 * h + 8 * s) * scale,
        w=s * b * h * 24 * h * scale,
        comm=comm,
        mem_b=s * b * (34 * h + 5 * a * s) * layers_per_stage,
        mem_w=32 * s * b * h * layers_per_stage,
    )
