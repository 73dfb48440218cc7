"""Recorded timelines: the real start and end of every op and transfer wait on every rank.

A :class:`TraceRecorder` (``Pipeline(..., trace=True)``) keeps, for the last few steps, each op's
``(start, end)``, each transfer wait and each runtime event (optimizer settle, all-reduce start) —
two clock reads and an append per op (CUDA events on a GPU).  :func:`gather_timeline` (collective)
aligns the ranks' clocks by ping-pong and returns a :class:`MeasuredTimeline` with the simulator's
interface, so the renderer and exporters draw it like a prediction; :func:`measured_costs` turns it
into a :class:`CostModel` and :func:`write_trace` writes the measurement beside the simulator's
prediction for the same costs.

How an op's start is defined and how the clocks are aligned: ``docs/runtime.md``.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...schedule import CostModel, Kind, Schedule, simulate
from ...schedule.channels import MessageKey, sent_message
from ...schedule.export import to_chrome_trace
from ...schedule.ir import Op
from ...schedule.render import render_comparison
from ...schedule.simulate import RecordedSpans, time_bounds
from .. import PipelineError
from ..parallel.data_parallel import ParallelLayout
from .recorder import COMM_ACTION_PREFIXES, RecorderDefaults, StepRecorder

Interval = tuple[float, float]
Wait = tuple[MessageKey, float, float]
Event = tuple[str, float, float]
StepRecord = tuple[list[Interval], list[Wait], list[Event]]
"""One rank's step in seconds: op intervals (program order), transfer waits, runtime events."""
_PING_PONGS = 8


class TraceRecorder(RecorderDefaults):
    """Records the op, wait and runtime-event intervals of the last ``keep`` steps of one rank.

    The executor calls :meth:`begin_step` before a step, :meth:`clock` around every op, event and
    wait, :meth:`op` after every op, :meth:`event` after every hook and :meth:`wait` after every
    transfer wait (the :class:`~.recorder.Recorder` protocol).  ``device`` selects the clock: CUDA
    events on a CUDA device, else ``time.perf_counter``.
    """

    def __init__(self, device: torch.device | str = "cpu", keep: int = 8):
        self.cuda = torch.device(device).type == "cuda"
        self.steps: deque[tuple[list, list, list]] = deque(maxlen=keep)
        self._ops: list = []
        self._waits: list = []
        self._events: list = []
        self._anchor: tuple[Any, float] | None = None
        self.begun = 0
        self.clock = self._cuda_clock if self.cuda else time.perf_counter  # type: ignore[method-assign]
        """The current time (``perf_counter`` seconds; a recorded CUDA event on a GPU)."""

    def _cuda_clock(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin_step(self) -> None:
        """Start recording a new step (the oldest kept step is dropped)."""
        if self.cuda and self._anchor is None:
            anchor = self._cuda_clock()
            anchor.synchronize()
            self._anchor = (anchor, time.perf_counter())
        self._ops, self._waits, self._events = [], [], []
        self.steps.append((self._ops, self._waits, self._events))
        self.begun += 1

    @property
    def keeps_first_step(self) -> bool:
        """True while the oldest kept step is the pipeline's first (it also exchanges shape headers)."""
        return self.begun <= (self.steps.maxlen or self.begun)

    def op(self, op: Op, start: Any, end: Any) -> None:
        """One op ran from ``start`` to ``end``."""
        self._ops.append((start, end))

    def wait(self, key: MessageKey, start: Any, end: Any) -> None:
        """The rank waited for message ``key`` from ``start`` to ``end``."""
        self._waits.append((key, start, end))

    def event(self, name: str, start: Any, end: Any) -> None:
        """The runtime action ``name`` (a hook of the executor) ran from ``start`` to ``end``."""
        self._events.append((name, start, end))

    def seconds(self) -> list[StepRecord]:
        """The kept steps as ``perf_counter`` seconds: ``[(op intervals, waits, events)]``, oldest first."""
        if not self.cuda:
            return [(list(ops), list(waits), list(events)) for ops, waits, events in self.steps]
        torch.cuda.synchronize()
        anchor, host = self._anchor  # type: ignore[misc]

        def convert(event: Any) -> float:
            return host + anchor.elapsed_time(event) / 1e3

        return [
            (
                [(convert(a), convert(b)) for a, b in ops],
                [(key, convert(a), convert(b)) for key, a, b in waits],
                [(name, convert(a), convert(b)) for name, a, b in events],
            )
            for ops, waits, events in self.steps
        ]


@dataclass(frozen=True)
class MeasuredTimeline(RecordedSpans):
    """A recorded step in seconds on rank 0's clock, read like a simulated Timeline.

    ``start[r][i]``/``end[r][i]`` belong to ``schedule.programs[r][i]``; ``issued[r][i]`` is when the
    executor called the op (before any transfer wait inside it); ``waits[r]`` lists
    ``(message key, start, end)``, ``events[r]`` the runtime events ``(name, start, end)`` (optimizer
    settle, all-reduce start); ``clock_error[r]`` bounds rank ``r``'s alignment error (seconds).
    The makespan depends on the clock alignment; the iteration time (each rank's own span) does not.
    The ideal is the measured busy time of the busiest rank.
    """

    issued: tuple[tuple[float, ...], ...] = ()
    waits: tuple[tuple[Wait, ...], ...] = ()
    clock_error: tuple[float, ...] = ()
    events: tuple[tuple[Event, ...], ...] = ()

    def summary(self) -> dict[str, Any]:
        """The headline numbers as a JSON-ready dict (times in seconds)."""
        return {
            "schedule": self.schedule.name,
            "stages": self.schedule.num_ranks,
            "microbatches": self.schedule.microbatches,
            "chunks": self.schedule.chunks,
            "makespan": self.makespan,
            "iteration_time": self.iteration_time,
            "ideal": self.ideal,
            "bubble_rate": self.bubble_rate,
            "bubble_rate_makespan": self.bubble_rate_makespan,
            "clock_error": list(self.clock_error),
        }


def build_timeline(
    schedule: Schedule, per_rank: Sequence[Sequence[list]], clock_error: Sequence[float] = ()
) -> MeasuredTimeline:
    """A :class:`MeasuredTimeline` from each rank's ``(op intervals, waits[, events])`` on one clock."""
    starts, ends, issued, waits, events = [], [], [], [], []
    for rank, record in enumerate(per_rank):
        ops, rank_waits = record[0], record[1]
        if len(ops) != len(schedule.programs[rank]):
            raise PipelineError(
                f"rank {rank} recorded {len(ops)} ops but its program has {len(schedule.programs[rank])}; "
                "record a whole step"
            )
        starts.append(tuple(_ready_times(ops, rank_waits)))
        ends.append(tuple(b for _, b in ops))
        issued.append(tuple(a for a, _ in ops))
        waits.append(tuple(rank_waits))
        events.append(tuple(record[2]) if len(record) > 2 else ())
    return MeasuredTimeline(
        schedule,
        tuple(starts),
        tuple(ends),
        tuple(issued),
        tuple(waits),
        tuple(clock_error),
        tuple(events),
    )


def _ready_times(ops: list[Interval], waits: list[tuple[Any, float, float]]) -> list[float]:
    """Each op's start moved to the end of the last transfer wait that began inside it (a sweep)."""
    ready, position = [], 0
    for start, end in ops:
        moved = start
        while position < len(waits) and waits[position][1] < end:
            if waits[position][1] >= start:
                moved = min(max(moved, waits[position][2]), end)
            position += 1
        ready.append(moved)
    return ready


def shift_steps(steps: Sequence[Sequence[list]], offset: float) -> list[StepRecord]:
    """Steps of :meth:`TraceRecorder.seconds` moved by ``offset`` seconds (onto rank 0's clock)."""
    return [
        (
            [(a + offset, b + offset) for a, b in step[0]],
            [(key, a + offset, b + offset) for key, a, b in step[1]],
            [(name, a + offset, b + offset) for name, a, b in (step[2] if len(step) > 2 else ())],
        )
        for step in steps
    ]


def clock_offset(group: dist.ProcessGroup | None, device: torch.device) -> tuple[float, float]:
    """``(offset, error)`` of this rank's ``perf_counter`` to rank 0's of ``group`` (collective).

    Rank 0 answers each other rank in turn; offset and error come from the fastest of a few round
    trips (see the module docstring).  Rank 0 gets ``(0, 0)``.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    buffer = torch.zeros(1, dtype=torch.float64, device=device)
    if rank == 0:
        for other in range(1, world):
            for _ in range(_PING_PONGS):
                dist.recv(buffer, to_global(other), group=group)
                buffer.fill_(time.perf_counter())
                dist.send(buffer, to_global(other), group=group)
        return 0.0, 0.0
    best = (float("inf"), 0.0)
    for _ in range(_PING_PONGS):
        sent = time.perf_counter()
        dist.send(buffer, to_global(0), group=group)
        dist.recv(buffer, to_global(0), group=group)
        back = time.perf_counter()
        remote = float(buffer.item())
        best = min(best, (back - sent, remote - (sent + back) / 2))
    return best[1], best[0] / 2


def gather_timelines(
    recorder: StepRecorder, schedule: Schedule, group: dist.ProcessGroup | None, device: torch.device
) -> list[MeasuredTimeline] | None:
    """Every kept step as a :class:`MeasuredTimeline` on rank 0 (``None`` elsewhere). Collective."""
    offset, error = clock_offset(group, device)
    mine = (shift_steps(recorder.seconds(), offset), error)
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    gathered: list[Any] = [None] * world if rank == 0 else None  # type: ignore[assignment]
    root = 0 if group is None else dist.get_global_rank(group, 0)
    dist.gather_object(mine, gathered, dst=root, group=group)
    if rank != 0:
        return None
    counts = {len(steps) for steps, _ in gathered}
    errors = [err for _, err in gathered]
    return [
        build_timeline(schedule, [steps[index] for steps, _ in gathered], errors)
        for index in range(min(counts))
    ]


def median_timeline(timelines: Sequence[MeasuredTimeline]) -> MeasuredTimeline:
    """The step whose iteration time is the median (the lower one of an even count)."""
    ordered = sorted(timelines, key=lambda t: t.iteration_time)
    return ordered[(len(ordered) - 1) // 2]


def measured_costs(timelines: Sequence[MeasuredTimeline], comm: float = 0.0) -> CostModel:
    """Per-virtual-stage mean F, B and W durations (seconds) over ``timelines`` as a CostModel.

    A fused BW is counted as B with W = 0 (the simulator runs BW for ``b + w``); a stage with no op of
    a kind gets 0.  ``comm`` is the transfer time the prediction assumes (0: transfers are free).
    """
    schedule = timelines[0].schedule
    sums = {kind: [0.0] * schedule.num_stages for kind in (Kind.F, Kind.B, Kind.W)}
    counts = {kind: [0] * schedule.num_stages for kind in (Kind.F, Kind.B, Kind.W)}
    for timeline in timelines:
        for rank, program in enumerate(schedule.programs):
            for op, a, b in zip(program, timeline.start[rank], timeline.end[rank]):
                if op.is_vocab:  # a vocabulary shard's S and T are not a stage's work
                    continue
                kind = Kind.B if op.kind is Kind.BW else op.kind
                sums[kind][op.stage] += b - a
                counts[kind][op.stage] += 1
    means = {
        kind: [total / count if count else 0.0 for total, count in zip(sums[kind], counts[kind])]
        for kind in sums
    }
    return CostModel(f=means[Kind.F], b=means[Kind.B], w=means[Kind.W], comm=comm)


def transfer_latencies(timeline: MeasuredTimeline) -> list[float]:
    """Seconds from a producer op's end to the end of its consumer's wait, for every transfer waited on.

    Only messages the consumer was already waiting for when the producer finished count (otherwise
    the wait measures nothing about the transfer).  The producer's recorded end is just after it
    posted the send, so this is the one-way latency of a small message plus the wake-up.
    """
    schedule = timeline.schedule
    produced: dict[tuple[int, ...], float] = {}
    for rank, program in enumerate(schedule.programs):
        for op, end in zip(program, timeline.end[rank]):
            message = sent_message(op, schedule.num_stages)
            if message is not None:
                produced[message] = end
    latencies = []
    for waits in timeline.waits:
        for key, start, end in waits:
            sent = produced.get(tuple(key))
            if sent is not None and start <= sent <= end:
                latencies.append(end - sent)
    return latencies


@dataclass(frozen=True)
class TraceReport:
    """What :func:`write_trace` wrote and the headline comparison (times in seconds)."""

    measured_iteration_time: float
    predicted_iteration_time: float
    measured_bubble_rate: float
    predicted_bubble_rate: float
    steps: int
    files: tuple[str, ...]

    def lines(self) -> list[str]:
        """A short human-readable report."""
        return [
            f"measured iteration {self.measured_iteration_time * 1e3:.2f} ms, "
            f"bubble {self.measured_bubble_rate:.1%} "
            f"(median of {self.steps} recorded steps)",
            f"predicted iteration {self.predicted_iteration_time * 1e3:.2f} ms, "
            f"bubble {self.predicted_bubble_rate:.1%} (simulator, measured per-stage costs)",
            *(f"wrote {path}" for path in self.files),
        ]


def write_trace(
    timelines: Sequence[MeasuredTimeline],
    directory: str | Path,
    layout: ParallelLayout | None = None,
    image: str = "timeline.png",
    layer_bounds: Sequence[int] = (),
    layer_profile: Mapping[str, Any] | None = None,
) -> TraceReport:
    """Write recorded steps to ``directory``: the median one next to the simulator's prediction.

    ``timelines`` are the steps to summarise (:meth:`~..pipeline.Pipeline.write_trace` passes the
    gathered ones without the pipeline's first step).  Writes ``trace.json`` (Chrome trace of the
    median step, transfer waits and runtime events included), ``predicted.json`` (the simulator's
    prediction for the measured costs), ``summary.json`` and ``image`` (measured above predicted),
    and returns a :class:`TraceReport`.  With a data-parallel ``layout`` the files go into
    ``directory/replica<d>`` (every replica's rank 0 writes its own pipeline's trace).
    ``layer_bounds`` (the layer index where each chunk starts, then the layer count) and
    ``layer_profile`` go into ``summary.json`` for ``zerobubble plan --trace``.
    """
    if not timelines:
        raise PipelineError("no step was recorded: run pipe.step() with trace=True before write_trace")
    measured = median_timeline(timelines)
    costs = measured_costs(timelines)
    predicted = simulate(measured.schedule, costs)
    folder = Path(directory)
    if layout is not None and layout.grid.replicas > 1:
        folder = folder / f"replica{layout.grid.dp_index}"
    folder.mkdir(parents=True, exist_ok=True)
    files = {
        "trace.json": measured_chrome_trace(measured),
        "predicted.json": to_chrome_trace(predicted, time_unit_us=1e6),
        "summary.json": json.dumps(
            {
                "measured": measured.summary(),
                "predicted": predicted.summary(),
                "costs_seconds": costs.to_dict(),
                **_planning_inputs(timelines, layer_bounds, layer_profile),
            },
            indent=2,
        ),
    }
    for name, text in files.items():
        (folder / name).write_text(text)
    render_comparison(measured, predicted, folder / image)
    return TraceReport(
        measured.iteration_time,
        predicted.iteration_time,
        measured.bubble_rate,
        predicted.bubble_rate,
        len(timelines),
        tuple(str(folder / name) for name in (*files, image)),
    )


def _planning_inputs(
    timelines: Sequence[MeasuredTimeline],
    layer_bounds: Sequence[int],
    layer_profile: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """What ``zerobubble plan --trace`` re-plans from: layer bounds, transfer latency, the layer profile."""
    latencies = sorted(x for t in timelines for x in transfer_latencies(t))
    return {
        "layer_bounds": list(layer_bounds),
        "transfer_latency": latencies[len(latencies) // 2] if latencies else 0.0,
        "layer_profile": dict(layer_profile) if layer_profile is not None else None,
    }


def measured_chrome_trace(timeline: MeasuredTimeline) -> str:
    """Chrome trace JSON (µs) of a measured step: the ops, every transfer wait as a ``wait`` event,
    every runtime event (optimizer settle) as a ``runtime`` event, and the lowered program's
    communication actions (``issue …``, ``wait …``) as ``comm`` events in a row ``rank r comm`` of
    their own under each rank's row."""
    trace = json.loads(to_chrome_trace(timeline, time_unit_us=1e6))
    t0 = time_bounds(timeline)[0]
    events = trace["traceEvents"]
    for rank, waits in enumerate(timeline.waits):
        for key, a, b in waits:
            events.append(_span(f"wait {MessageKey(*key).describe()}", "wait", rank, a - t0, b - a))
            events[-1]["args"] = {"key": list(key)}
    ranks = timeline.schedule.num_ranks
    for rank, runtime_events in enumerate(timeline.events):
        for name, a, b in runtime_events:
            if name.startswith(COMM_ACTION_PREFIXES):  # in the rank's comm lane, as the lowering draws it
                events.append(_span(name, "comm", ranks + rank, a - t0, b - a))
            else:
                events.append(_span(name, "runtime", rank, a - t0, b - a))
    _add_comm_lanes(timeline, events)
    earliest = min((e["ts"] for e in trace["traceEvents"] if "ts" in e), default=0.0)
    if earliest < 0:  # a rank's first wait begins before the first op's inputs arrive
        for event in trace["traceEvents"]:
            if "ts" in event:
                event["ts"] = round(event["ts"] - earliest, 3)
    return json.dumps(trace)


def _add_comm_lanes(timeline: MeasuredTimeline, events: list[dict[str, Any]]) -> None:
    """Rows ``rank r comm`` (thread ``ranks + r``) for the ranks with communication events, each
    sorted right under its rank's row (the rows' sort keys become ``2r`` and ``2r + 1``)."""
    ranks = timeline.schedule.num_ranks
    lanes = [
        rank
        for rank, runtime_events in enumerate(timeline.events)
        if any(name.startswith(COMM_ACTION_PREFIXES) for name, _, _ in runtime_events)
    ]
    if not lanes:
        return
    for event in events:
        if event.get("name") == "thread_sort_index" and event["tid"] < ranks:
            event["args"] = {"sort_index": 2 * event["tid"]}
    for rank in lanes:
        tid, name = ranks + rank, f"rank {rank} comm"
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}})
        sort = {"sort_index": 2 * rank + 1}
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": tid, "args": sort})


def _span(name: str, category: str, rank: int, start: float, duration: float) -> dict[str, Any]:
    """A Chrome-trace complete event on rank ``rank``'s row (times in seconds from the origin)."""
    return {
        "name": name,
        "cat": category,
        "ph": "X",
        "ts": round(start * 1e6, 3),
        "dur": round(duration * 1e6, 3),
        "pid": 0,
        "tid": rank,
    }


def recorded_timelines(
    recorder: Any, schedule: Schedule, group: Any, device: Any
) -> list[MeasuredTimeline] | None:
    """The steps ``recorder`` (a :class:`~.recorder.StepRecorder`) recorded, gathered on rank 0
    (collective; None elsewhere)."""
    if not isinstance(recorder, StepRecorder):
        raise PipelineError("no timeline was recorded: build the Pipeline with trace=True")
    return gather_timelines(recorder, schedule, group, device)


def write_recorded_trace(
    timelines: list[MeasuredTimeline] | None,
    recorder: Any,
    directory: str | Path,
    layout: Any,
    *,
    layer_bounds: Any,
    profile: Any,
) -> TraceReport | None:
    """:func:`write_trace` of the gathered ``timelines`` (rank 0; None elsewhere), the pipeline's
    first step left out when later ones were recorded (it also sends shape headers and allocates)."""
    if timelines is None:
        return None
    if not timelines:
        raise PipelineError("no step was recorded: run pipe.step() with trace=True before write_trace")
    if len(timelines) > 1 and getattr(recorder, "keeps_first_step", False):
        timelines = timelines[1:]
    return write_trace(timelines, directory, layout, layer_bounds=layer_bounds, layer_profile=profile)


__all__ = [
    "MeasuredTimeline",
    "TraceRecorder",
    "TraceReport",
    "build_timeline",
    "clock_offset",
    "gather_timelines",
    "measured_chrome_trace",
    "measured_costs",
    "median_timeline",
    "recorded_timelines",
    "transfer_latencies",
    "write_recorded_trace",
    "write_trace",
]
