"""Write schedules and timelines in formats other tools read.

* ``json`` — the schedule's own round-trippable form (:meth:`Schedule.to_json`);
* ``torch-csv`` — ``torch.distributed.pipelining``'s compute-only action CSV, one row per rank,
  loadable with ``_PipelineScheduleRuntime._load_csv(path, format="compute_only")``; the CSV
  holds no placement, so :func:`torch_placement` says which stages each rank must build (the
  ``PipelineStage`` objects handed to the runtime) and whether that is torchtitan's ``"loop"`` or
  ``"v"`` style;
* ``chrome-trace`` — Chrome trace event JSON of a timeline, for Perfetto or ``chrome://tracing``.

:func:`export` dispatches on the format name; the CLI calls it.  Pure Python, no torch import.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from .costs import CostModel, StageCosts
from .ir import Kind, Op, Schedule, ScheduleError
from .simulate import simulate, time_bounds

#: The format names :func:`export` accepts.
FORMATS = ("json", "torch-csv", "chrome-trace")

#: Our kinds as torch's computation types: its I is our B, its B is our fused BW.
_TORCH_ACTION = MappingProxyType({Kind.F: "F", Kind.B: "I", Kind.W: "W", Kind.BW: "B"})


def to_json(schedule: Schedule) -> str:
    """The schedule as indented JSON, readable back with :meth:`Schedule.from_json`."""
    return schedule.to_json(indent=2)


def torch_action(op: Op) -> str:
    """``op`` as a torch pipelining action string: ``<stage><F|I|W|B><microbatch>``, e.g. ``0I3``.

    torch's stage index is our virtual stage index; its ``I`` (backward-input) is our B and its
    ``B`` (full backward) is our fused BW.  torch has no vocabulary-parallel ops: S and T are refused.
    """
    action = _TORCH_ACTION.get(op.kind)
    if action is None:
        raise ScheduleError(
            f"{op} is a vocabulary-parallel op, which torch's pipelining runtime has no action for; export "
            "the schedule without vocab_parallel"
        )
    return f"{op.stage}{action}{op.microbatch}"


def to_torch_csv(schedule: Schedule) -> str:
    """torch's compute-only schedule CSV: row ``r`` lists rank ``r``'s actions in program order."""
    return "".join(",".join(torch_action(op) for op in program) + "\n" for program in schedule.programs)


def torch_placement(schedule: Schedule) -> dict[str, Any]:
    """The stage placement the schedule's torch CSV needs, JSON-ready.

    ``stages[r]`` lists the stage indices rank ``r`` holds (one ``PipelineStage(module, index,
    num_stages, ...)`` each, in that order); ``style`` is ``"loop"`` when stage ``s`` sits on rank
    ``s % p`` (torchtitan's default for CSV schedules, ``stage_ids_this_rank(..., style="loop")``),
    ``"v"`` for the V (rank ``r`` holds stages ``r`` and ``2p-1-r``: ``style="v"``) and
    ``"explicit"`` for any other mapping.  torch's runtime infers the same mapping from the CSV
    (``stage_index_to_group_rank``); building other stages on a rank fails at its first action.
    """
    placement = schedule.placement
    p, count = placement.num_ranks, placement.num_stages
    vshape = tuple(s if s < p else 2 * p - 1 - s for s in range(count))
    if placement.stage_ranks == tuple(s % p for s in range(count)):
        style = "loop"
    elif count == 2 * p and placement.stage_ranks == vshape:
        style = "v"
    else:
        style = "explicit"
    return {
        "schedule": schedule.name,
        "num_ranks": p,
        "num_stages": count,
        "microbatches": schedule.microbatches,
        "style": style,
        "stages": [list(placement.stages_of(rank)) for rank in range(p)],
    }


def describe_torch_placement(schedule: Schedule) -> str:
    """One line: ``style v: rank 0 holds stages 0,3; rank 1 holds stages 1,2``."""
    placement = torch_placement(schedule)
    ranks = "; ".join(
        f"rank {rank} holds stage{'s' if len(stages) > 1 else ''} {','.join(map(str, stages))}"
        for rank, stages in enumerate(placement["stages"])
    )
    return f"style {placement['style']}: {ranks}"


def torch_placement_json(schedule: Schedule) -> str:
    """:func:`torch_placement` as indented JSON (what ``export --format torch-csv`` writes beside the CSV)."""
    return json.dumps(torch_placement(schedule)) + "\n"


def to_chrome_trace(timeline: Any, time_unit_us: float = 1.0, memory: bool = True) -> str:
    """Chrome trace event JSON of ``timeline``: one thread per rank, one complete event per op.

    A time unit of the timeline lasts ``time_unit_us`` microseconds in the trace (so a timeline in
    seconds wants ``1e6``); times start at 0.  With ``memory`` and a timeline that has a memory
    trace, each rank also gets a counter of its activation memory (in M_B when the timeline knows
    its costs).
    """
    if not time_unit_us > 0:
        raise ScheduleError(f"time_unit_us must be positive, got {time_unit_us!r}")
    schedule: Schedule = timeline.schedule
    t0 = time_bounds(timeline)[0]

    def stamp(t: float) -> float:
        return round((t - t0) * time_unit_us, 6)

    events = _trace_metadata(schedule)
    chunk_of = [schedule.placement.chunk_index(s) for s in range(schedule.num_stages)]
    for rank, program in enumerate(schedule.programs):
        for op, start, end in zip(program, timeline.start[rank], timeline.end[rank]):
            events.append(
                {
                    "name": str(op),
                    "cat": op.kind.value,
                    "ph": "X",
                    "ts": stamp(start),
                    "dur": round((end - start) * time_unit_us, 6),
                    "pid": 0,
                    "tid": rank,
                    "args": {
                        "stage": op.stage,
                        "chunk": chunk_of[op.stage],
                        "microbatch": op.microbatch,
                        "kind": op.kind.value,
                    },
                }
            )
    if memory and getattr(timeline, "memory", None) is not None:
        events += _memory_counters(timeline, stamp)
    trace = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": _trace_summary(timeline)}
    return json.dumps(trace)


def _trace_metadata(schedule: Schedule) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = [
        {
            "name": "process_name",
            "ph": "M",
            "pid": 0,
            "tid": 0,
            "args": {"name": f"pipeline: {schedule.name}"},
        }
    ]
    for rank in range(schedule.num_ranks):
        events.append(
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}}
        )
        events.append(
            {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": rank, "args": {"sort_index": rank}}
        )
    return events


def _memory_counters(timeline: Any, stamp: Callable[[float], float]) -> list[dict[str, Any]]:
    """Per rank, the memory level as a counter: a rise shows at the op's start, a fall at its end."""
    costs = getattr(timeline, "costs", None)
    unit = costs.memory_unit if isinstance(costs, StageCosts) else 1.0
    key = "M_B" if isinstance(costs, StageCosts) else "memory"
    events = []
    for rank, levels in enumerate(timeline.memory):
        name = f"memory rank {rank}"
        starts, ends = timeline.start[rank], timeline.end[rank]
        previous = 0.0
        for level, start, end in zip(levels, starts, ends):
            when = start if level > previous else end
            events.append({"name": name, "ph": "C", "pid": 0, "ts": stamp(when), "args": {key: level / unit}})
            previous = level
    return events


def _trace_summary(timeline: Any) -> dict[str, Any]:
    summary = getattr(timeline, "summary", None)
    if callable(summary):
        return summary()
    return {"schedule": timeline.schedule.name}


def export(
    schedule_or_timeline: Any,
    fmt: str,
    costs: CostModel | StageCosts | None = None,
    time_unit_us: float = 1.0,
) -> str:
    """``schedule_or_timeline`` in the format ``fmt`` (one of :data:`FORMATS`), as a string.

    ``json`` and ``torch-csv`` take a Schedule or a Timeline (its schedule is written).
    ``chrome-trace`` takes a Timeline; given a Schedule it simulates it under ``costs`` first
    (unit costs when ``costs`` is ``None``).
    """
    if fmt not in FORMATS:
        raise ScheduleError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    is_schedule = isinstance(schedule_or_timeline, Schedule)
    if not is_schedule and not isinstance(getattr(schedule_or_timeline, "schedule", None), Schedule):
        raise ScheduleError(
            f"export needs a Schedule or a Timeline, got {type(schedule_or_timeline).__name__}"
        )
    schedule = schedule_or_timeline if is_schedule else schedule_or_timeline.schedule
    if fmt == "json":
        return to_json(schedule)
    if fmt == "torch-csv":
        return to_torch_csv(schedule)
    if is_schedule:
        schedule_or_timeline = simulate(schedule, costs)
    return to_chrome_trace(schedule_or_timeline, time_unit_us=time_unit_us)
