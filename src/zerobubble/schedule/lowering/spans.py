"""What a simulated lowered program reports: :class:`CommTimeline`.

Its ``start[r][k]`` and ``end[r][k]`` belong to action ``k`` of rank ``r``'s program (an issue and a
reshard take no time; a wait lasts while it blocks), its ``comm_spans`` to the communication on
the rank's links.  :meth:`CommTimeline.op_spans` gives the source schedule's op times, which the
existing pictures and exports read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..costs import StageCosts
from ..simulate import RecordedSpans
from .actions import Comm, Compute, LoweredSchedule
from .memory import ParameterMemory


@dataclass(frozen=True)
class CommTimeline:
    """The times of every action of a lowered program, its communication and its memory.

    ``span_start[r]`` is when rank ``r`` starts its step (its first compute part or the first
    communication it starts itself: a receive posted early does not count); ``exposed[r]`` the time
    its compute stream waited, per group (``pp`` includes the pipeline's own bubbles).
    """

    lowered: LoweredSchedule
    costs: StageCosts
    start: tuple[tuple[float, ...], ...]
    end: tuple[tuple[float, ...], ...]
    span_start: tuple[float, ...]
    comm_spans: tuple[tuple[tuple[Comm, str, float, float], ...], ...]
    exposed: tuple[dict[str, float], ...]
    memory: ParameterMemory

    @property
    def rank_spans(self) -> tuple[float, ...]:
        """Each rank's step: its optimizer step's end minus its start."""
        return tuple(ends[-1] - first for ends, first in zip(self.end, self.span_start))

    @property
    def iteration_time(self) -> float:
        """The longest rank step (the period with optimizer post-validation)."""
        return max(self.rank_spans)

    @property
    def makespan(self) -> float:
        """The first rank's start to the last rank's optimizer step."""
        return max(ends[-1] for ends in self.end) - min(self.span_start)

    @property
    def exposed_dp(self) -> float:
        """The most any rank's compute stream waited for data-parallel collectives."""
        return max(exposed["dp"] for exposed in self.exposed)

    @property
    def peak_memory(self) -> tuple[float, ...]:
        """Per rank, the peak of activations plus parameters (:mod:`.memory`)."""
        return self.memory.total

    def op_spans(self) -> RecordedSpans:
        """The source schedule's op times: each op from its first part's start to its last's end."""
        schedule = self.lowered.source
        starts: list[tuple[float, ...]] = []
        ends: list[tuple[float, ...]] = []
        for rank in range(schedule.num_ranks):
            rank_starts, rank_ends = [], []
            for action, start, end in zip(self.lowered.programs[rank], self.start[rank], self.end[rank]):
                if isinstance(action, Compute):
                    if action.first:
                        rank_starts.append(start)
                    if action.last:
                        rank_ends.append(end)
            starts.append(tuple(rank_starts))
            ends.append(tuple(rank_ends))
        return RecordedSpans(schedule, tuple(starts), tuple(ends))

    def summary(self) -> dict[str, Any]:
        """The headline numbers as a JSON-ready dict."""
        return {
            "schedule": self.lowered.source.name,
            "lowering": self.lowered.options.describe(self.lowered.data_parallel),
            "iteration_time": self.iteration_time,
            "makespan": self.makespan,
            "exposed": [dict(exposed) for exposed in self.exposed],
            "peak_activations": list(self.memory.activations),
            "peak_parameters": list(self.memory.parameters),
            "peak_memory": list(self.memory.total),
        }
