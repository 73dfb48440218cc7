"""Plan from measurement: schedule, chunk count and partition from per-layer costs and a byte budget.

A :class:`ModelProfile` holds what :mod:`zerobubble.runtime.profile` measures per layer at the
microbatch size — ``T_F``, ``T_B``, ``T_W`` (seconds), the activation bytes a forward keeps for its
B and a B keeps for its W, parameter + gradient + optimizer-state bytes and the bytes of the output
that crosses a cut after the layer — plus the transfer model ``T_comm = latency + bytes/bandwidth``.

:func:`plan` tries every registry schedule that applies (and chunk counts for the interleaved one):
for each it takes the partition minimising the busiest rank's compute (the exact
:func:`~.partition.optimal_partition`), maps the layers onto per-stage costs in seconds and bytes,
builds the schedule under the memory left after each rank's static bytes, simulates it and refines the
cut points by the simulator (moves of one cut by one layer while the predicted period drops).  When
the fastest partition does not fit the budget, a memory-capped partition is tried (each stage's
activations weighted by the microbatches it held at once in the simulation).  The result names the
winner and keeps every alternative with its predicted time, bubble and peak bytes; when nothing fits,
a :class:`~.ir.ScheduleError` names the rank, the bytes it needs and the budget.

Pure Python; no torch.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .builders import REGISTRY, build_schedule, get_spec
from .compare import OPTIMIZER_MODES, SLOW_SCHEDULES, iteration_period
from .costs import CostModel
from .ir import Kind, Schedule, ScheduleError
from .partition import MemoryCap, even_partition, optimal_partition
from .simulate import Timeline, simulate
from .validate import validate_schedule

if TYPE_CHECKING:
    from .calibration import Calibration

# -- bytes ------------------------------------------------------------------------------------------

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BYTES = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str | float | None, device_memory: float | None = None) -> float | None:
    """A byte budget: ``"24GiB"``, ``"500MB"``, ``1.5e9``, or ``"80%"`` of ``device_memory``.

    ``None`` means no budget.  Raises :class:`ScheduleError` for anything else.
    """
    if text is None:
        return None
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        value = _parse_text(str(text), device_memory)
    if not math.isfinite(value) or value <= 0:
        raise ScheduleError(f"a memory budget must be positive, got {text!r}")
    return value


def _parse_text(text: str, device_memory: float | None) -> float:
    stripped = text.strip()
    if stripped.endswith("%"):
        if device_memory is None:
            raise ScheduleError(
                f"memory budget {text!r} is a fraction of the device's memory, which is only known on a "
                "GPU; give an amount such as 24GiB"
            )
        try:
            return float(stripped[:-1]) / 100 * device_memory
        except ValueError:
            pass
    match = _BYTES.match(stripped)
    if match and match.group(2).lower() in _UNITS:
        return float(match.group(1)) * _UNITS[match.group(2).lower()]
    raise ScheduleError(
        f"cannot read memory budget {text!r}: give bytes with a unit (24GiB, 512MiB, 2GB), a number of "
        "bytes, or a percentage of the device's memory (80%)"
    )


def format_bytes(value: float) -> str:
    """``value`` bytes in binary units, e.g. ``"1.50 GiB"``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


# -- the profile ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerProfile:
    """Measured costs of one layer for one microbatch (seconds and bytes).

    ``activation_bytes`` is what F keeps alive until B (saved tensors); ``weight_input_bytes`` what B
    keeps until W (0 for a layer without deferred weight gradients); ``output_bytes`` what crosses a
    cut placed right after this layer.  ``backward_fused`` is the time of the fused backward (BW) that
    1F1B, GPipe and interleaved 1F1B run, 0 when not measured (then ``T_B + T_W`` stands for it).
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

    @property
    def fused(self) -> float:
        """The fused backward's time: measured, or ``T_B + T_W``."""
        return self.backward_fused if self.backward_fused > 0 else self.backward_input + self.backward_weight

    @property
    def work(self) -> float:
        """``T_F + T_B + T_W``: one microbatch's compute."""
        return self.forward + self.backward_input + self.backward_weight

    @property
    def static_bytes(self) -> float:
        """Parameters, gradients and optimizer state: held whatever the schedule does."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class ModelProfile:
    """Per-layer costs of a model at one microbatch size, and the measured transfer model.

    A message of ``x`` bytes between ranks takes ``comm_latency + x / comm_bandwidth`` seconds
    (``comm_bandwidth = 0``: no size term).
    """

    layers: tuple[LayerProfile, ...]
    comm_latency: float = 0.0
    comm_bandwidth: float = 0.0
    microbatch_size: int | None = None
    source: str = ""
    meta: Mapping[str, Any] = field(default_factory=dict)

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
    stage ``s`` carries the output of its last layer.  ``memory_limit`` is per rank, in bytes of
    activations.  With ``fused`` (a schedule of BW ops) B is the measured fused backward and W is 0.
    """
    bounds = [0, *cuts, len(profile.layers)]
    groups = [profile.layers[bounds[s] : bounds[s + 1]] for s in range(stages)]

    def total(name: str) -> list[float]:
        return [math.fsum(getattr(layer, name) for layer in group) for group in groups]

    comm = [profile.transfer_time(group[-1].output_bytes) for group in groups[:-1]] + [0.0]
    return CostModel(
        f=total("forward"),
        b=total("fused") if fused else total("backward_input"),
        w=[0.0] * stages if fused else total("backward_weight"),
        comm=comm,
        mem_b=total("activation_bytes"),
        mem_w=[min(w, b) for w, b in zip(total("weight_input_bytes"), total("activation_bytes"))],
        memory_limit=list(memory_limit) if memory_limit is not None else None,
    )


# -- the plan ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """One schedule and chunk count with its best partition, or why it was left out.

    ``period`` is what the plan minimises (the iteration time with optimizer post-validation, the
    makespan with a synchronous step); ``peak_bytes[r]`` is rank ``r``'s static bytes plus its peak
    activation bytes in the simulation; ``note`` says why a candidate does not fit or was not built.
    """

    schedule: str
    chunks: int
    partition: tuple[int, ...] = ()
    period: float | None = None
    iteration_time: float | None = None
    makespan: float | None = None
    bubble_rate: float | None = None
    peak_bytes: tuple[float, ...] = ()
    fits: bool = False
    note: str = ""
    built: Schedule | None = field(default=None, compare=False, repr=False)
    costs: CostModel | None = field(default=None, compare=False, repr=False)
    timeline: Timeline | None = field(default=None, compare=False, repr=False)

    def row(self) -> dict[str, Any]:
        """JSON-ready numbers (no schedule object)."""
        return {
            "schedule": self.schedule,
            "chunks": self.chunks,
            "partition": list(self.partition),
            "period": self.period,
            "iteration_time": self.iteration_time,
            "makespan": self.makespan,
            "bubble_rate": self.bubble_rate,
            "peak_bytes": list(self.peak_bytes),
            "fits": self.fits,
            "note": self.note,
        }


@dataclass(frozen=True)
class Plan:
    """The chosen schedule, chunk count and partition, with every alternative considered.

    ``schedule`` is the built (validated) schedule to run, ``costs`` its per-stage costs in seconds
    and bytes, ``reason`` one sentence saying why it won.  ``cores`` is the number of processors
    the ranks were predicted to share (None: one each).  ``calibration`` is set once a run has
    measured its own first steps (:func:`.calibration.calibrate`): the prediction from those
    measurements and the plan they would choose.
    """

    winner: Candidate
    candidates: tuple[Candidate, ...]
    ranks: int
    microbatches: int
    memory_budget: float | None
    optimizer: str
    reason: str
    calibration: Calibration | None = None
    cores: int | None = None

    @property
    def schedule(self) -> Schedule:
        """The winner's schedule object."""
        assert self.winner.built is not None
        return self.winner.built

    @property
    def costs(self) -> CostModel:
        """The winner's per-stage costs (seconds, bytes)."""
        assert self.winner.costs is not None
        return self.winner.costs

    @property
    def partition(self) -> tuple[int, ...]:
        """Layer indices where chunks ``1..S−1`` start."""
        return self.winner.partition

    @property
    def predicted_iteration_time(self) -> float:
        """The winner's predicted period in seconds (see :class:`Candidate`)."""
        assert self.winner.period is not None
        return self.winner.period

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary: the winner's fields at the top, every alternative under ``alternatives``."""
        winner = self.winner
        return {
            "schedule": winner.schedule,
            "chunks": winner.chunks,
            "partition": list(winner.partition),
            "predicted_iteration_time": winner.period,
            "predicted_makespan": winner.makespan,
            "bubble_rate": winner.bubble_rate,
            "peak_bytes": list(winner.peak_bytes),
            "memory_budget": self.memory_budget,
            "ranks": self.ranks,
            "microbatches": self.microbatches,
            "optimizer": self.optimizer,
            "cores": self.cores,
            "reason": self.reason,
            "calibration": self.calibration.to_dict() if self.calibration is not None else None,
            "alternatives": [candidate.row() for candidate in self.candidates],
        }

    def table(self) -> str:
        """The alternatives as a text table, best first, the winner marked with ``*``."""
        reference = _one_f_one_b_period(self.candidates)
        header = (
            f"{'':2}{'schedule':<18}{'v':>2}  {'predicted (ms)':>14}{'bubble':>8}{'peak (max rank)':>17}"
            f"{'vs 1f1b':>9}  partition"
        )
        lines = [header]
        for candidate in self.candidates:
            mark = "* " if candidate is self.winner else "  "
            if candidate.period is None:
                lines.append(f"{mark}{candidate.schedule:<18}{candidate.chunks:>2}  n/a: {candidate.note}")
                continue
            peak = format_bytes(max(candidate.peak_bytes)) + ("" if candidate.fits else " !")
            speedup = f"{reference / candidate.period:.3f}x" if reference else "-"
            bubble = candidate.bubble_rate or 0.0
            lines.append(
                f"{mark}{candidate.schedule:<18}{candidate.chunks:>2}  {candidate.period * 1e3:>14.3f}"
                f"{bubble:>8.1%}{peak:>17}{speedup:>9}  {list(candidate.partition)}"
            )
        budget = format_bytes(self.memory_budget) if self.memory_budget else "none"
        lines.append(
            f"p={self.ranks} m={self.microbatches}; predicted = simulated {self._period_name()} from the "
            f"profile; peak = static + activation bytes; budget {budget} (! = above it)"
        )
        return "\n".join(lines)

    def _period_name(self) -> str:
        return "iteration time" if self.optimizer == "post-validation" else "makespan"

    def render(self, path: str | Path) -> None:
        """Draw the winner's simulated timeline (SVG or PNG by the suffix)."""
        from .render import render_image

        assert self.winner.timeline is not None
        title = f"auto plan: {self.winner.schedule}, partition {list(self.partition)}"
        render_image(self.winner.timeline, path, title=title)


def plan(
    profile: ModelProfile,
    ranks: int,
    microbatches: int,
    memory_limit: str | float | None = None,
    schedules: Iterable[str] | None = None,
    interleaved_chunks: Sequence[int] = (2,),
    optimizer: str = "post-validation",
    device_memory: float | None = None,
    refine: int = 12,
    tie_margin: float = 0.05,
    cores: int | None = None,
) -> Plan:
    """Choose schedule, chunk count and partition for ``profile`` on ``ranks`` ranks (module docstring).

    ``memory_limit`` is a byte budget per rank (``"24GiB"``, a number, ``"80%"`` of
    ``device_memory``); ``schedules`` defaults to every registry schedule but the slow ILP;
    ``interleaved_chunks`` are the chunk counts tried for interleaved 1F1B; ``optimizer`` selects the
    period minimised (``"post-validation"``: iteration time, ``"sync"``: makespan); ``refine`` bounds
    the simulator-guided moves of cut points of each candidate within 10 % of the best; a candidate
    with fewer chunks whose prediction is within ``tie_margin`` of the fastest wins the tie.
    ``cores`` fewer than ``ranks`` predicts ranks sharing that many processors (CPU ranks on one
    machine; the profile then holds each rank's times on a core of its own).  Raises
    :class:`ScheduleError` when no candidate fits the budget, naming the rank, the bytes it needs and
    the budget.
    """
    if optimizer not in OPTIMIZER_MODES:
        raise ScheduleError(
            f"unknown optimizer mode {optimizer!r}; choose one of {', '.join(OPTIMIZER_MODES)}"
        )
    if ranks < 1 or microbatches < 1:
        raise ScheduleError(f"ranks and microbatches must be at least 1, got {ranks} and {microbatches}")
    budget = parse_bytes(memory_limit, device_memory)
    names = list(schedules) if schedules is not None else [n for n in REGISTRY if n not in SLOW_SCHEDULES]
    search = _Search(profile, ranks, microbatches, budget, optimizer, refine, cores)
    candidates: list[Candidate] = []
    for name in names:
        spec = get_spec(name)
        for chunks in [spec.chunks] if spec.chunks is not None else list(interleaved_chunks):
            candidates.append(search.candidate(name, chunks))
    # refining costs simulations: only for candidates that may still win (within 10 % of the best)
    periods = [c.period for c in candidates if c.fits and c.period is not None]
    threshold = min(periods) * 1.1 if periods else math.inf
    candidates = [
        search.refined(c) if c.period is not None and (c.period <= threshold or not periods) else c
        for c in candidates
    ]
    ordered = tuple(
        sorted(
            candidates,
            key=lambda c: (not c.fits, c.period is None, c.period or 0.0, max(c.peak_bytes or (0,))),
        )
    )
    fitting = [c for c in ordered if c.fits]
    if not fitting:
        raise ScheduleError(_nothing_fits(ordered, budget, ranks))
    winner = _choose(fitting, tie_margin)
    reason = _reason(winner, ordered, budget)
    if cores is not None and cores < ranks:
        reason += f"; {ranks} ranks predicted on {cores} shared cores"
    return Plan(winner, ordered, ranks, microbatches, budget, optimizer, reason, cores=cores)


def _choose(fitting: Sequence[Candidate], tie_margin: float) -> Candidate:
    """The fastest prediction, unless one with fewer chunks is within ``tie_margin`` of it.

    A schedule with ``v`` chunks runs ``v`` times the ops and about ``v`` times the transfers, and
    its balance rests on finer per-layer costs; the runtime's cost per op and per transfer is not in
    the model, so a prediction this close is a tie, and the simpler schedule wins it.  (Measured on
    the MLP of ``bench plan``: V schedules predicted 2.3–2.9 % ahead of single-chunk ones ran 0.5–6.5 %
    behind them; ``docs/auto-planning.md``.)
    """
    fastest = fitting[0]
    assert fastest.period is not None
    close = [c for c in fitting if c.period is not None and c.period <= fastest.period * (1 + tie_margin)]
    return min(close, key=lambda c: (c.chunks, c.period, max(c.peak_bytes)))


class _Search:
    """Builds and scores candidates for one profile, rank count and budget."""

    def __init__(
        self,
        profile: ModelProfile,
        ranks: int,
        microbatches: int,
        budget: float | None,
        optimizer: str,
        refine: int,
        cores: int | None = None,
    ):
        self.profile, self.ranks, self.microbatches = profile, ranks, microbatches
        self.budget, self.optimizer, self.refine, self.cores = budget, optimizer, refine, cores
        self.work = [layer.work for layer in profile.layers]

    def candidate(self, name: str, chunks: int) -> Candidate:
        """The better of the bottleneck-optimal and the even partition of ``name`` (or why there is none).

        When neither fits the budget, the partition optimal under the memory cap is tried as well.
        """
        stages = self.ranks * chunks
        if len(self.work) < stages:
            return Candidate(
                name, chunks, note=f"needs at least {stages} layers, the model has {len(self.work)}"
            )
        try:
            placement = build_schedule(
                name, self.ranks, self.microbatches, chunks=chunks, validate=False
            ).placement
        except ScheduleError as error:
            return Candidate(name, chunks, note=str(error))
        stage_ranks = placement.stage_ranks
        fastest = optimal_partition(self.work, stage_ranks)
        assert fastest is not None  # without a memory cap every partition is allowed
        even = tuple(even_partition(len(self.work), stages))
        options = [
            self._built(name, chunks, cuts, stage_ranks) for cuts in dict.fromkeys([fastest.cuts, even])
        ]
        best = min(options, key=_rank_key)
        if not best.fits and best.timeline is not None and self.budget is not None:
            capped = optimal_partition(self.work, stage_ranks, self._memory_cap(best))
            if capped is not None and capped.cuts not in (fastest.cuts, even):
                best = min([best, self._built(name, chunks, capped.cuts, stage_ranks)], key=_rank_key)
        return best

    def refined(self, candidate: Candidate) -> Candidate:
        """Move one cut by one layer while that shortens the simulated period (at most ``refine`` moves).

        The moves keep the candidate's op order and only re-simulate it (milliseconds); the final
        partition is then built afresh and the better of the two kept.
        """
        order = candidate.built
        if order is None or candidate.period is None:
            return candidate
        count, stage_ranks = len(self.work), order.placement.stage_ranks
        best, seen = candidate, {candidate.partition}
        for _ in range(self.refine):
            neighbours = []
            for index, cut in enumerate(best.partition):
                for step in (-1, 1):
                    cuts = list(best.partition)
                    cuts[index] = cut + step
                    if (
                        all(a < b for a, b in itertools.pairwise([0, *cuts, count]))
                        and tuple(cuts) not in seen
                    ):
                        neighbours.append(tuple(cuts))
            seen.update(neighbours)
            improved = min([best, *(self._simulated(order, cuts) for cuts in neighbours)], key=_rank_key)
            if improved is best:
                break
            best = improved
        if best is candidate:
            return candidate
        rebuilt = self._built(candidate.schedule, candidate.chunks, best.partition, stage_ranks)
        return min([best, rebuilt], key=_rank_key)

    def _built(self, name: str, chunks: int, cuts: tuple[int, ...], stage_ranks: Sequence[int]) -> Candidate:
        """Build ``name`` for the cut points ``cuts`` under the budget left after static bytes; score it."""
        static = self._static_bytes(cuts, stage_ranks)
        limits = None
        if self.budget is not None:
            limits = [self.budget - s for s in static]
            worst = max(range(self.ranks), key=lambda r: static[r])
            if limits[worst] <= 0:
                note = (
                    f"rank {worst} holds {format_bytes(static[worst])} of parameters, gradients and "
                    "optimizer state alone"
                )
                return Candidate(name, chunks, cuts, peak_bytes=tuple(static), note=note)
        try:
            costs = stage_costs(self.profile, cuts, len(stage_ranks), limits)
            schedule = build_schedule(
                name, self.ranks, self.microbatches, costs, chunks=chunks, validate=False
            )
            # the budget is checked on static + activation bytes: validate without the limit
            validate_schedule(schedule, costs.with_memory_limit(None))
        except ScheduleError as error:
            return Candidate(name, chunks, cuts, peak_bytes=tuple(static), note=str(error))
        return self._simulated(schedule, cuts)

    def _simulated(self, schedule: Schedule, cuts: tuple[int, ...]) -> Candidate:
        """Score a valid ``schedule`` with the layers cut at ``cuts``."""
        stage_ranks = schedule.placement.stage_ranks
        static = self._static_bytes(cuts, stage_ranks)
        # a schedule of BW ops is predicted with the measured fused backward
        costs = stage_costs(self.profile, cuts, len(stage_ranks), fused=not schedule.splits_backward)
        timeline = simulate(schedule, costs, cores=self.cores)
        peaks = tuple(s + a for s, a in zip(static, timeline.peak_memory))
        fits = self.budget is None or all(peak <= self.budget * (1 + 1e-9) for peak in peaks)
        over = max(range(self.ranks), key=lambda r: peaks[r])
        sync = self.optimizer == "sync"
        return Candidate(
            schedule.name,
            schedule.chunks,
            cuts,
            period=iteration_period(timeline, self.optimizer),
            iteration_time=timeline.iteration_time,
            makespan=timeline.makespan,
            bubble_rate=timeline.bubble_rate_makespan if sync else timeline.bubble_rate,
            peak_bytes=peaks,
            fits=fits,
            note="" if fits else f"rank {over} needs {format_bytes(peaks[over])}",
            built=schedule,
            costs=costs,
            timeline=timeline,
        )

    def _static_bytes(self, cuts: Sequence[int], stage_ranks: Sequence[int]) -> list[float]:
        bounds = [0, *cuts, len(self.work)]
        static = [0.0] * self.ranks
        for stage, rank in enumerate(stage_ranks):
            layers = self.profile.layers[bounds[stage] : bounds[stage + 1]]
            static[rank] += math.fsum(layer.static_bytes for layer in layers)
        return static

    def _memory_cap(self, candidate: Candidate) -> MemoryCap:
        """The budget as a partition constraint: each stage's activations times its peak in-flight count."""
        assert candidate.timeline is not None and self.budget is not None
        return MemoryCap(
            fixed=[layer.static_bytes for layer in self.profile.layers],
            scaled=[layer.activation_bytes for layer in self.profile.layers],
            inflight=_peak_inflight(candidate.timeline),
            capacity=[self.budget] * self.ranks,
        )


def _rank_key(candidate: Candidate) -> tuple[bool, float, float]:
    return (
        not candidate.fits,
        candidate.period if candidate.period is not None else math.inf,
        max(candidate.peak_bytes or (0.0,)),
    )


def _peak_inflight(timeline: Timeline) -> list[float]:
    """Per stage, the most microbatches whose forward ran and whose activations are not yet freed."""
    schedule = timeline.schedule
    peaks = [0.0] * schedule.num_stages
    for program in schedule.programs:
        held = [0] * schedule.num_stages
        for op in program:
            if op.kind is Kind.F:
                held[op.stage] += 1
                peaks[op.stage] = max(peaks[op.stage], held[op.stage])
            elif op.kind in (Kind.B, Kind.BW):
                held[op.stage] -= 1
    return peaks


def _one_f_one_b_period(candidates: Sequence[Candidate]) -> float | None:
    return next((c.period for c in candidates if c.schedule == "1f1b" and c.period), None)


def _reason(winner: Candidate, candidates: Sequence[Candidate], budget: float | None) -> str:
    reference = _one_f_one_b_period(candidates)
    fastest = next(c for c in candidates if c.fits)
    runner_up = next((c for c in candidates if c.fits and c is not winner), None)
    assert winner.period is not None and fastest.period is not None
    if fastest is winner:
        parts = [
            f"{winner.schedule} (v={winner.chunks}) with partition {list(winner.partition)} has the shortest "
            f"predicted period among the schedules that fit, {winner.period * 1e3:.3f} ms"
        ]
        if runner_up is not None and runner_up.period:
            parts.append(f"{runner_up.period / winner.period - 1:.1%} ahead of {runner_up.schedule}")
    else:
        parts = [
            f"{winner.schedule} (v={winner.chunks}) with partition {list(winner.partition)}, predicted "
            f"{winner.period * 1e3:.3f} ms, is within {winner.period / fastest.period - 1:.1%} of the "
            f"fastest prediction ({fastest.schedule}, v={fastest.chunks}) with fewer chunks: fewer ops and "
            "transfers, whose overhead the model leaves out"
        ]
    if reference:
        parts.append(f"{reference / winner.period:.3f}x 1f1b")
    peak = max(winner.peak_bytes)
    parts.append(
        f"peak {format_bytes(peak)} per rank"
        + (f" within the budget {format_bytes(budget)}" if budget else "")
    )
    return "; ".join(parts)


def _nothing_fits(candidates: Sequence[Candidate], budget: float | None, ranks: int) -> str:
    measured = [c for c in candidates if c.peak_bytes]
    if not measured or budget is None:
        notes = "; ".join(f"{c.schedule}: {c.note}" for c in candidates)
        return f"no schedule can run on {ranks} ranks: {notes}"
    smallest = min(measured, key=lambda c: max(c.peak_bytes))
    rank = max(range(len(smallest.peak_bytes)), key=lambda r: smallest.peak_bytes[r])
    need = smallest.peak_bytes[rank]
    return (
        f"no schedule fits the memory budget of {format_bytes(budget)} per rank: the smallest need is "
        f"{smallest.schedule} (v={smallest.chunks}, partition {list(smallest.partition)}), whose rank {rank} "
        f"needs {format_bytes(need)} ({need:.0f} bytes) against the budget of {budget:.0f} bytes; raise the "
        "budget, use more ranks or smaller microbatches"
    )
