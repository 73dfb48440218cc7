"""Pictures and traces of a lowered program, communication in lanes of its own.

Per rank a compute lane (the ops, as the plain pictures draw them) and one lane per communication
group it uses (``pp``: sends; ``dp``: gathers and reductions; ``vocab``: the output layer's
collectives).  :func:`render_comm_text` draws them as text, :func:`render_comm_svg` as an SVG
(written directly, no matplotlib) and :func:`to_comm_chrome_trace` as Chrome trace events: one
thread per lane, each rank's comm lanes sorted under its compute lane.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...errors import ScheduleError
from .actions import Comm, CommKind, Compute
from .spans import CommTimeline

LANES = ("pp", "dp", "vocab", "ep")

#: One letter per communication kind in the text picture.
COMM_LETTER = {
    CommKind.SEND: ">",
    CommKind.RECV: "<",
    CommKind.UNSHARD: "g",
    CommKind.REDUCE_SCATTER: "r",
    CommKind.ALL_REDUCE: "a",
    CommKind.VOCAB_BROADCAST: "h",
    CommKind.VOCAB_REDUCE: "v",
    CommKind.ALL_TO_ALL: "e",
}

_COLOUR = {
    "F": "#4e79a7",
    "B": "#59a14f",
    "W": "#edc948",
    "BW": "#76b7b2",
    "S": "#b07aa1",
    "T": "#ff9da7",
    "pp": "#9c755f",
    "dp": "#e15759",
    "vocab": "#af7aa1",
    "ep": "#f28e2b",
}


def lanes(timeline: CommTimeline) -> Iterator[tuple[int, str, list[tuple[str, str, float, float]]]]:
    """Every lane to draw, rank by rank: ``(rank, lane, [(label, colour key, start, end), ...])``,
    the compute lane (``"compute"``) first, then the communication lanes that hold anything."""
    for rank, program in enumerate(timeline.lowered.programs):
        compute = [
            (str(action), action.op.kind.value, start, end)
            for action, start, end in zip(program, timeline.start[rank], timeline.end[rank])
            if isinstance(action, Compute) and end > start
        ]
        yield rank, "compute", compute
        for lane in LANES:
            spans = [
                _comm_entry(comm, start, end)
                for comm, group, start, end in timeline.comm_spans[rank]
                if group == lane
            ]
            if spans:
                yield rank, lane, spans


def _comm_entry(comm: Comm, start: float, end: float) -> tuple[str, str, float, float]:
    return str(comm), comm.group, start, end


def render_comm_text(timeline: CommTimeline, width: int = 100) -> str:
    """Text lanes over ``width`` columns: ops by their kind's letter, communication by
    :data:`COMM_LETTER` (``g`` gather, ``r`` reduce-scatter, ``a`` all-reduce, ``>`` send, ``h``/``v``
    the output layer's broadcast and reduction, ``e`` an expert all-to-all); ``.`` is idle."""
    if width < 10:
        raise ScheduleError(f"width must be at least 10 columns, got {width}")
    t0 = min(timeline.span_start)
    extent = max(timeline.makespan, 1e-12)
    rows = []
    for rank, lane, spans in lanes(timeline):
        cells = ["."] * width
        for label, _, start, end in spans:
            letter = _letter(label, lane)
            first = min(int((start - t0) / extent * width), width - 1)
            last = max(first + 1, min(int((end - t0) / extent * width), width))
            for column in range(first, last):
                cells[column] = letter
        name = f"rank {rank}" if lane == "compute" else f"  {lane}"
        rows.append(f"{name:>8} |{''.join(cells)}|")
    legend = "g gather  r reduce-scatter  a all-reduce  > send  h/v vocab broadcast/reduce"
    return "\n".join([*rows, f"{'':>8}  {legend}"])


def _letter(label: str, lane: str) -> str:
    if lane == "compute":
        return label[1] if label.startswith("BW") else label[0]
    kind = label.split("(")[0]
    return COMM_LETTER.get(CommKind(kind), "?")


def render_comm_svg(timeline: CommTimeline, path: str | Path | None = None, *, width: int = 1000) -> str:
    """The lanes as an SVG picture (returned, and written to ``path`` when given)."""
    rows = list(lanes(timeline))
    t0, extent = min(timeline.span_start), max(timeline.makespan, 1e-12)
    left, row_height, scale = 90, 18, (width - 100) / extent
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{row_height * len(rows) + 10}" '
        'font-family="monospace" font-size="10">'
    ]
    for row, (rank, lane, spans) in enumerate(rows):
        y = 5 + row * row_height
        name = f"rank {rank}" if lane == "compute" else lane
        parts.append(f'<text x="{left - 6}" y="{y + 12}" text-anchor="end">{name}</text>')
        for label, key, start, end in spans:
            x, w = left + (start - t0) * scale, max((end - start) * scale, 0.5)
            height = row_height - 3 if lane == "compute" else row_height - 8
            fill = _COLOUR.get(key, "#888")
            parts.append(
                f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{height}" fill="{fill}">'
                f"<title>{label}: {start - t0:.4g}..{end - t0:.4g}</title></rect>"
            )
    parts.append("</svg>")
    text = "\n".join(parts)
    if path is not None:
        Path(path).write_text(text)
    return text


def to_comm_chrome_trace(timeline: CommTimeline, time_unit_us: float = 1.0) -> str:
    """Chrome trace JSON: a thread per lane (``rank r``, ``rank r dp``, …), a complete event per
    compute part or communication op; times start at 0."""
    if not time_unit_us > 0:
        raise ScheduleError(f"time_unit_us must be positive, got {time_unit_us!r}")
    t0 = min(timeline.span_start)
    events: list[dict[str, Any]] = []
    for index, (rank, lane, spans) in enumerate(lanes(timeline)):
        tid = rank * (len(LANES) + 1) + (0 if lane == "compute" else 1 + LANES.index(lane))
        name = f"rank {rank}" if lane == "compute" else f"rank {rank} {lane}"
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}})
        events.append(
            {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": tid, "args": {"sort_index": index}}
        )
        for label, key, start, end in spans:
            events.append(
                {
                    "name": label,
                    "cat": key,
                    "ph": "X",
                    "ts": round((start - t0) * time_unit_us, 6),
                    "dur": round((end - start) * time_unit_us, 6),
                    "pid": 0,
                    "tid": tid,
                }
            )
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "otherData": timeline.summary()})
