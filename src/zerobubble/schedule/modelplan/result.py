"""What the model-level planner returns: each candidate, the chosen :class:`Plan` and its calibration.

:class:`PlanCandidate` is one schedule and chunk count with its best partition (or why it was left
out), :class:`Plan` the winner with every alternative, and :class:`Calibration` a running plan
checked against the run's own recorded steps (made by :func:`.calibration.calibrate`).  Types only:
the search is in :mod:`.search`.

Pure Python; no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..costs import CostModel
from ..ir import Schedule
from ..lowering import CommChoice
from ..simulate import Timeline
from .amounts import format_bytes
from .profile import ModelProfile


@dataclass(frozen=True)
class PlanCandidate:
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
    vocab_parallel: bool = False
    built: Schedule | None = field(default=None, compare=False, repr=False)
    costs: CostModel | None = field(default=None, compare=False, repr=False)
    timeline: Timeline | None = field(default=None, compare=False, repr=False)

    @property
    def label(self) -> str:
        """The schedule's name, ``+vocab`` when the output layer is vocabulary-parallel."""
        return self.schedule + ("+vocab" if self.vocab_parallel else "")

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
            "vocab_parallel": self.vocab_parallel,
        }


def comm_dict(comm: CommChoice | None) -> dict[str, Any] | None:
    """A chosen communication, JSON-ready: the record's fields, its words, its simulated step and
    peak, the reason, and every candidate tried."""
    if comm is None:
        return None
    mode = comm.timeline.lowered.grid.dp_mode
    return {
        "options": asdict(comm.options),
        "lowering": comm.options.describe(mode),
        "iteration_time": comm.timeline.iteration_time,
        "peak_bytes": list(comm.timeline.peak_memory),
        "reason": comm.reason,
        "candidates": [
            {"lowering": options.describe(mode), "iteration_time": time, "peak_bytes": peak}
            for options, time, peak in comm.tried
        ],
    }


@dataclass(frozen=True)
class Plan:
    """The chosen schedule, chunk count and partition, with every alternative considered.

    ``schedule`` is the built (validated) schedule to run, ``costs`` its per-stage costs in seconds
    and bytes, ``reason`` one sentence saying why it won.  ``cores`` is the number of processors
    the ranks were predicted to share (None: one each).  ``calibration`` is set once a run has
    measured its own first steps (:func:`.calibration.calibrate`): the prediction from those
    measurements and the plan they would choose.  ``bytes_known`` is False when the profile held
    times only (:attr:`.profile.ModelProfile.bytes_known`): the candidates' ``peak_bytes`` are then
    placeholder units, and neither :meth:`table` nor :meth:`to_dict` reports them as bytes.
    ``comm`` is the data-parallel communication chosen for the winner on a grid with replicas
    (:func:`.choices.choose_comm`: its ``options``, simulated ``timeline``, ``reason``).
    """

    winner: PlanCandidate
    candidates: tuple[PlanCandidate, ...]
    ranks: int
    microbatches: int
    memory_budget: float | None
    optimizer: str
    reason: str
    calibration: Calibration | None = None
    cores: int | None = None
    bytes_known: bool = True
    comm: CommChoice | None = field(default=None, compare=False, repr=False)

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
        """The winner's predicted period in seconds (see :class:`PlanCandidate`)."""
        assert self.winner.period is not None
        return self.winner.period

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary: the winner's fields at the top, every alternative under ``alternatives``."""
        winner = self.winner
        alternatives = [candidate.row() for candidate in self.candidates]
        if not self.bytes_known:  # placeholder units, not bytes
            alternatives = [{**row, "peak_bytes": None} for row in alternatives]
        return {
            "schedule": winner.schedule,
            "vocab_parallel": winner.vocab_parallel,
            "chunks": winner.chunks,
            "partition": list(winner.partition),
            "predicted_iteration_time": winner.period,
            "predicted_makespan": winner.makespan,
            "bubble_rate": winner.bubble_rate,
            "peak_bytes": list(winner.peak_bytes) if self.bytes_known else None,
            "bytes_known": self.bytes_known,
            "memory_budget": self.memory_budget,
            "ranks": self.ranks,
            "microbatches": self.microbatches,
            "optimizer": self.optimizer,
            "cores": self.cores,
            "reason": self.reason,
            "calibration": self.calibration.to_dict() if self.calibration is not None else None,
            "data_parallel": comm_dict(self.comm),
            "alternatives": alternatives,
        }

    def table(self) -> str:
        """The alternatives as a text table, best first, the winner marked with ``*``."""
        reference = one_f_one_b_period(self.candidates)
        header = (
            f"{'':2}{'schedule':<18}{'v':>2}  {'predicted (ms)':>14}{'bubble':>8}{'peak (max rank)':>17}"
            f"{'vs 1f1b':>9}  partition"
        )
        lines = [header]
        for candidate in self.candidates:
            mark = "* " if candidate is self.winner else "  "
            name = candidate.label
            if candidate.period is None:
                lines.append(f"{mark}{name:<18}{candidate.chunks:>2}  n/a: {candidate.note}")
                continue
            peak = format_bytes(max(candidate.peak_bytes)) if self.bytes_known else "not recorded"
            peak += "" if candidate.fits else " !"
            speedup = f"{reference / candidate.period:.3f}x" if reference else "-"
            bubble = candidate.bubble_rate or 0.0
            lines.append(
                f"{mark}{name:<18}{candidate.chunks:>2}  {candidate.period * 1e3:>14.3f}"
                f"{bubble:>8.1%}{peak:>17}{speedup:>9}  {list(candidate.partition)}"
            )
        budget = format_bytes(self.memory_budget) if self.memory_budget else "none"
        peak_note = (
            "peak = static + activation bytes"
            if self.bytes_known
            else "peak: not recorded (the profile holds times only)"
        )
        lines.append(
            f"p={self.ranks} m={self.microbatches}; predicted = simulated {self._period_name()} from the "
            f"profile; {peak_note}; budget {budget} (! = above it)"
        )
        return "\n".join(lines)

    def _period_name(self) -> str:
        return "iteration time" if self.optimizer == "post-validation" else "makespan"

    def render(self, path: str | Path, title: str | None = None) -> None:
        """Draw the winner's simulated timeline (SVG or PNG by the suffix), under ``title`` (default:
        the schedule and its partition)."""
        from ..render import render_image

        assert self.winner.timeline is not None
        title = title or f"auto plan: {self.winner.schedule}, partition {list(self.partition)}"
        render_image(self.winner.timeline, path, title=title)


@dataclass(frozen=True)
class Calibration:
    """A running plan checked against the run's own recorded steps, and planned again from them.

    ``measured_f``/``measured_b``/``measured_w`` are the mean op durations per chunk (seconds) over
    ``steps`` recorded steps (a fused BW counts as B), ``transfer_latency`` the run's median one-way
    transfer time; ``profile`` is the layer profile scaled to them (:func:`calibrated_profile`).
    ``predicted_iteration_time`` is the running schedule and partition simulated under that profile
    (what the plan's period is compared with once calibrated); ``replan`` is :func:`plan` run again
    on it.  ``keeps_plan`` is True when the re-plan chose the running schedule, chunks and
    partition, or predicts nothing faster than the running plan by more than the tie margin (the
    running plan is then the one to keep: switching costs a rebuild); otherwise ``replan.winner``
    is the better plan for this run.
    """

    steps: int
    measured_f: tuple[float, ...]
    measured_b: tuple[float, ...]
    measured_w: tuple[float, ...]
    transfer_latency: float
    profile: ModelProfile = field(repr=False)
    initial_iteration_time: float
    predicted_iteration_time: float
    replan: Plan = field(repr=False)
    keeps_plan: bool

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready numbers: the measurement, the calibrated prediction and the re-plan's winner."""
        winner = self.replan.winner
        return {
            "steps": self.steps,
            "measured_seconds": {
                "f": list(self.measured_f),
                "b": list(self.measured_b),
                "w": list(self.measured_w),
            },
            "transfer_latency": self.transfer_latency,
            "initial_iteration_time": self.initial_iteration_time,
            "predicted_iteration_time": self.predicted_iteration_time,
            "keeps_plan": self.keeps_plan,
            "replan": {
                "schedule": winner.schedule,
                "vocab_parallel": winner.vocab_parallel,
                "chunks": winner.chunks,
                "partition": list(winner.partition),
                "predicted_iteration_time": winner.period,
            },
        }

    def describe(self) -> str:
        """One sentence: the calibrated prediction and what the re-plan chose."""
        winner = self.replan.winner
        assert winner.period is not None
        text = (
            f"calibrated on {self.steps} recorded steps: predicted "
            f"{self.predicted_iteration_time * 1e3:.3f} ms (from the profile alone "
            f"{self.initial_iteration_time * 1e3:.3f} ms; measured transfer latency "
            f"{self.transfer_latency * 1e3:.3f} ms)"
        )
        if self.keeps_plan:
            return f"{text}; re-planning from the measured costs keeps this plan"
        return (
            f"{text}; re-planning from the measured costs prefers {winner.schedule} (v={winner.chunks}) "
            f"with partition {list(winner.partition)}, predicted {winner.period * 1e3:.3f} ms"
        )


def one_f_one_b_period(candidates: Sequence[PlanCandidate]) -> float | None:
    return next((c.period for c in candidates if c.schedule == "1f1b" and c.period), None)
