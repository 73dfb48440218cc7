"""Pictures of a :class:`~zerobubble.schedule.simulate.Timeline`: text for a terminal, SVG/PNG figures.

Both draw one row per rank (rank 0 on top) with time running left to right, as in the paper's
figures.  They read only a small *timeline interface*, so a timeline the runtime recorded can be
drawn like a simulated one:

* required: ``schedule`` (a :class:`~zerobubble.schedule.ir.Schedule`), ``start`` and ``end``
  (``start[r][i]`` / ``end[r][i]`` belong to ``schedule.programs[r][i]``);
* optional: ``iteration_time``, ``makespan``, ``bubble_rate``, ``bubble_rate_makespan`` and
  ``peak_memory_mb``.  Without them the numbers come from ``start``/``end`` as
  :class:`~zerobubble.schedule.simulate.RecordedSpans` defines them (the busiest rank's compute
  time is the ideal); peak memory is then left out of the caption.

matplotlib is imported only inside the image functions, so importing the schedule layer stays fast,
and figures are drawn on a private Agg canvas without touching pyplot's global state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from .ir import Kind, Op, Schedule, ScheduleError
from .simulate import RecordedSpans, time_bounds

if TYPE_CHECKING:  # matplotlib and numpy load only when a picture is drawn
    import numpy as np
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

#: Text letters per kind; chunks after a rank's first are written in lower case.
_LETTERS = MappingProxyType({Kind.F: "F", Kind.B: "B", Kind.W: "W", Kind.BW: "X", Kind.S: "S", Kind.T: "T"})
_KIND_NAMES = MappingProxyType(
    {
        Kind.F: "forward",
        Kind.B: "input grad",
        Kind.W: "weight grad",
        Kind.BW: "fused B+W",
        Kind.S: "vocab shard: logits, loss part",
        Kind.T: "vocab shard: weight grad",
    }
)
_COLOURS = MappingProxyType(
    {
        Kind.F: "#2f6fb5",
        Kind.B: "#1f9e89",
        Kind.W: "#e39b2d",
        Kind.BW: "#7b5ea7",
        Kind.S: "#c2437a",
        Kind.T: "#8c8c3a",
    }
)
_IDLE_COLOUR = "#e9e9ec"
_IMAGE_SUFFIXES = MappingProxyType({".svg": "svg", ".png": "png"})
_MAX_LABELS = 4000
_LABELLED_SHARE = 0.9
_FIGURE_WIDTH_IN = 13.0
_DPI = 150
_ROW_FILL = 0.8  # fraction of a row's pitch that its cells cover
# Layout, in inches: fixed margins around one or two panels whose height grows with the rank count.
# From the top: the title's band, the legend (as many rows as it needs, measured), a gap or the
# first panel's own title line, the panels; nothing is placed beside anything else.
_ROW_IN = 0.26
_TITLE_IN = 0.42
_LEGEND_GAP_IN = 0.12
_PANEL_TITLE_IN = 0.34
_BOTTOM_IN = 0.75
_GAP_IN = 0.75
_LEFT_IN = 0.85
_RIGHT_IN = 0.25
_LEGEND_COLUMNS = 6
_LEGEND_STYLE: Mapping[str, Any] = MappingProxyType(
    {"fontsize": 7.5, "frameon": False, "handlelength": 1.2, "columnspacing": 1.2, "borderaxespad": 0.0}
)


class Figures(NamedTuple):
    """The headline numbers a picture's caption shows (``peak_memory_mb`` may be ``None``)."""

    iteration_time: float
    makespan: float
    bubble_rate: float
    bubble_rate_makespan: float
    peak_memory_mb: float | None


def timeline_figures(timeline: Any) -> Figures:
    """Caption numbers of ``timeline``; an object with only ``schedule``/``start``/``end`` is read
    as a :class:`~zerobubble.schedule.simulate.RecordedSpans` (see the module docstring)."""
    spans = timeline if hasattr(timeline, "iteration_time") else as_recorded(timeline)
    peaks = getattr(timeline, "peak_memory_mb", None)
    return Figures(
        spans.iteration_time,
        spans.makespan,
        spans.bubble_rate,
        spans.bubble_rate_makespan,
        max(peaks) if peaks else None,
    )


def as_recorded(timeline: Any) -> RecordedSpans:
    """``timeline``'s op times with the figures a recorded run derives from them."""
    return RecordedSpans(
        timeline.schedule, tuple(map(tuple, timeline.start)), tuple(map(tuple, timeline.end))
    )


def caption(timeline: Any) -> str:
    """One line with the schedule's shape and its headline numbers."""
    schedule: Schedule = timeline.schedule
    numbers = timeline_figures(timeline)
    shape = f"p={schedule.num_ranks} m={schedule.microbatches}"
    if schedule.chunks > 1:
        shape += f" v={schedule.chunks}"
    parts = [
        f"{schedule.name} ({shape})",
        f"iteration time {numbers.iteration_time:.4g}",
        f"bubble rate {numbers.bubble_rate:.2%}",
        f"bubble rate (makespan) {numbers.bubble_rate_makespan:.2%}",
    ]
    if numbers.peak_memory_mb is not None:
        parts.append(f"peak memory {numbers.peak_memory_mb:.3g} M_B")
    return " | ".join(parts)


# --------------------------------------------------------------------------------------------- text


def render_text(timeline: Any, width: int | None = None) -> str:
    """A text picture of ``timeline``: one row per rank, ``width`` columns of time (default 100).

    Each op is drawn with its kind's letter (``F``, ``B``, ``W``, ``X`` for a fused BW), lower case
    for a rank's later chunks; idle time is ``.``.  When every op is wide enough its microbatch
    number follows the letter.  Ops narrower than a column drop out, so any size stays ``width``
    wide.  The last lines are a legend and a caption with the headline numbers.
    """
    columns = 100 if width is None else width
    if isinstance(columns, bool) or not isinstance(columns, int) or columns < 10:
        raise ScheduleError(f"text width must be an integer of at least 10 columns, got {width!r}")
    schedule: Schedule = timeline.schedule
    t0, t1 = time_bounds(timeline)
    scale = columns / (t1 - t0) if t1 > t0 else 0.0
    spans = [_column_spans(starts, ends, t0, scale) for starts, ends in zip(timeline.start, timeline.end)]
    numbered = _numbers_fit(schedule, timeline, spans)
    label_width = len(str(schedule.num_ranks - 1))
    lines = []
    for rank, program in enumerate(schedule.programs):
        row = _text_row(schedule, program, spans[rank], columns, numbered)
        row = _text_pairs(row, schedule, rank, spans[rank], numbered)
        lines.append(f"rank {rank:>{label_width}} |{row}|")
    indent = " " * (len("rank ") + label_width + 2)
    end_label = f"{t1 - t0:.4g}"
    lines.append(indent + "0" + end_label.rjust(columns - 1))
    lines.append(_text_legend(schedule))
    lines.append(caption(timeline))
    return "\n".join(lines)


def _column_spans(
    starts: Sequence[float], ends: Sequence[float], t0: float, scale: float
) -> list[tuple[int, int]]:
    return [(round((s - t0) * scale), round((e - t0) * scale)) for s, e in zip(starts, ends)]


def _numbers_fit(schedule: Schedule, timeline: Any, spans: list[list[tuple[int, int]]]) -> bool:
    """True when every op that takes time has room for its letter, microbatch number and a gap."""
    digits = len(str(schedule.microbatches - 1))
    return all(
        c1 - c0 >= digits + 2
        for rank, rank_spans in enumerate(spans)
        for (c0, c1), start, end in zip(rank_spans, timeline.start[rank], timeline.end[rank])
        if end > start
    )


def _text_row(
    schedule: Schedule,
    program: Sequence[Op],
    spans: Sequence[tuple[int, int]],
    columns: int,
    numbered: bool,
) -> str:
    cells = ["."] * columns
    placement = schedule.placement
    for op, (c0, c1) in zip(program, spans):
        if c1 <= c0:
            continue
        letter = _LETTERS[op.kind]
        if not op.is_vocab and placement.chunk_index(op.stage) > 0:
            letter = letter.lower()
        text = f"{letter}{op.microbatch}".ljust(c1 - c0) if numbered else letter * (c1 - c0)
        cells[c0:c1] = text[: columns - c0]
    return "".join(cells[:columns])


def _text_pairs(
    row: str, schedule: Schedule, rank: int, spans: Sequence[tuple[int, int]], numbered: bool
) -> str:
    """``row`` with each overlapped F&B pair of ``rank`` (one span for both ops) redrawn as its two
    letters joined by ``&``, the forward's first (``F3&x1``, or ``FF&xx`` without numbers)."""
    if not schedule.overlapped:
        return row
    cells = list(row)
    program, placement = schedule.programs[rank], schedule.placement
    for i in schedule.pair_starts()[rank]:
        c0, c1 = spans[i]
        if c1 - c0 < 3:
            continue
        words = []
        for op in program[i : i + 2]:
            letter = _LETTERS[op.kind]
            words.append(letter.lower() if placement.chunk_index(op.stage) > 0 else letter)
        if numbered:
            text = f"{words[0]}{program[i].microbatch}&{words[1]}{program[i + 1].microbatch}"
        else:
            half = (c1 - c0 - 1) // 2
            text = words[0] * half + "&" + words[1] * (c1 - c0 - 1 - half)
        cells[c0:c1] = text[: c1 - c0].ljust(c1 - c0)[: len(cells) - c0]
    return "".join(cells)


def _text_legend(schedule: Schedule) -> str:
    kinds = _kinds_present(schedule)
    parts = [f"{_LETTERS[kind]} {_KIND_NAMES[kind]}" for kind in kinds]
    if schedule.overlapped:
        parts.append("F&X an overlapped F&B pair")
    if schedule.chunks > 1:
        parts.append("lower case: a rank's later chunks")
    parts.append(". idle")
    return "legend: " + ", ".join(parts)


def _kinds_present(schedule: Schedule) -> list[Kind]:
    present = {op.kind for _, op in schedule.ops()}
    return [kind for kind in (Kind.F, Kind.B, Kind.W, Kind.BW, Kind.S, Kind.T) if kind in present]


# -------------------------------------------------------------------------------------------- image


def render_image(timeline: Any, path: str | Path, title: str | None = None) -> None:
    """Draw ``timeline`` like the paper's figures and save it as SVG or PNG (by the suffix of ``path``).

    One row per rank (rank 0 on top) on a grey idle background, F/B/W/BW in distinct colours, later
    chunks of a rank in lighter shades, microbatch numbers inside the cells that are wide enough,
    and a caption with iteration time, bubble rates and peak memory.  All cells of a figure are one
    polygon collection, so p = 32, m = 256 (about 25k ops) takes a few seconds.
    """
    fmt = _image_format(path)
    _save(_image_figure(timeline, title), path, fmt)


def _image_figure(timeline: Any, title: str | None = None) -> Figure:
    """The figure :func:`render_image` saves: title, legend below it, the timeline, the caption."""
    ranks = timeline.schedule.num_ranks
    figure, top_in = _new_figure(timeline.schedule, ranks, panels=1, panel_titles=False)
    axes = figure.add_axes(_axes_box(figure, ranks, 0, top_in))
    t0, t1 = time_bounds(timeline)
    _draw_timeline(axes, timeline, t0, t1 - t0)
    axes.set_xlabel("time")
    name = title or _default_title(timeline.schedule)
    figure.suptitle(name, x=0.02, ha="left", fontsize=11, y=_title_y(figure))
    figure.text(0.02, _caption_y(figure), caption(timeline), fontsize=8.5, ha="left", va="bottom")
    return figure


def render_comparison(measured: Any, predicted: Any, path: str | Path, title: str | None = None) -> None:
    """Draw a measured timeline above the simulator's prediction of the same schedule.

    Both share one time axis, each measured from its own first op; so give both in the same unit
    (e.g. seconds, with the simulator fed profiled costs).  Each panel gets its own caption.
    """
    fmt = _image_format(path)
    _save(_comparison_figure(measured, predicted, title), path, fmt)


def _comparison_figure(measured: Any, predicted: Any, title: str | None = None) -> Figure:
    """The figure :func:`render_comparison` saves: title, legend, then each panel under its caption."""
    ranks = measured.schedule.num_ranks
    if predicted.schedule.num_ranks != ranks:
        raise ScheduleError(
            f"cannot compare a {ranks}-rank timeline with a {predicted.schedule.num_ranks}-rank one; "
            "pass two timelines of the same schedule"
        )
    figure, top_in = _new_figure(measured.schedule, ranks, panels=2, panel_titles=True)
    panels = (("measured", measured), ("predicted (simulator)", predicted))
    extent = max(time_bounds(t)[1] - time_bounds(t)[0] for _, t in panels)
    top = None
    for index, (label, timeline) in enumerate(panels):
        axes = figure.add_axes(_axes_box(figure, ranks, index, top_in), sharex=top)
        top = top or axes
        _draw_timeline(axes, timeline, time_bounds(timeline)[0], extent)
        axes.set_title(f"{label}: {caption(timeline)}", fontsize=8.5, loc="left")
    axes.set_xlabel("time")
    name = title or f"{_default_title(measured.schedule)}: measured vs predicted"
    figure.suptitle(name, x=0.02, ha="left", fontsize=11, y=_title_y(figure))
    return figure


def _image_format(path: str | Path) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in _IMAGE_SUFFIXES:
        raise ScheduleError(
            f"cannot draw to {str(path)!r}: the file name must end in .svg or .png "
            f"(got {suffix or 'no suffix'})"
        )
    return _IMAGE_SUFFIXES[suffix]


def _default_title(schedule: Schedule) -> str:
    shape = f"p = {schedule.num_ranks}, m = {schedule.microbatches}"
    if schedule.chunks > 1:
        shape += f", v = {schedule.chunks}"
    return f"{schedule.name} ({shape})"


def _panel_height(ranks: int) -> float:
    return max(1.2, _ROW_IN * ranks + 0.2)


def _new_figure(schedule: Schedule, ranks: int, panels: int, panel_titles: bool) -> tuple[Figure, float]:
    """A figure on its own Agg canvas (no pyplot, no global figure registry) with the legend placed
    below the title's band, and the top margin in inches that leaves the panels below both."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(_FIGURE_WIDTH_IN, 4.0), dpi=_DPI)
    FigureCanvasAgg(figure)
    handles = _legend_handles(schedule)
    columns, legend_in = _legend_fit(figure, handles)
    top_in = _TITLE_IN + legend_in + (_PANEL_TITLE_IN if panel_titles else _LEGEND_GAP_IN)
    height = top_in + _BOTTOM_IN + panels * _panel_height(ranks) + (panels - 1) * _GAP_IN
    figure.set_size_inches(_FIGURE_WIDTH_IN, height)
    _place_legend(figure, handles, columns)
    return figure, top_in


def _axes_box(figure: Figure, ranks: int, index: int, top_in: float) -> tuple[float, float, float, float]:
    """[left, bottom, width, height] in figure fractions of panel ``index`` (0 = top), the first
    panel's top ``top_in`` inches below the figure's."""
    width_in, height_in = figure.get_size_inches()
    panel = _panel_height(ranks)
    panel_top_in = height_in - top_in - index * (panel + _GAP_IN)
    return (
        _LEFT_IN / width_in,
        (panel_top_in - panel) / height_in,
        1 - (_LEFT_IN + _RIGHT_IN) / width_in,
        panel / height_in,
    )


def _title_y(figure: Figure) -> float:
    return 1 - 0.12 / figure.get_size_inches()[1]


def _caption_y(figure: Figure) -> float:
    return 0.08 / figure.get_size_inches()[1]


def _save(figure: Figure, path: str | Path, fmt: str) -> None:
    from matplotlib import rc_context

    # Text stays text in SVG (small, searchable files) instead of one path per glyph.
    with rc_context({"svg.fonttype": "none", "svg.hashsalt": "zerobubble"}):
        figure.savefig(path, format=fmt, dpi=_DPI, metadata=_metadata(fmt))
    figure.clear()


def _metadata(fmt: str) -> dict[str, Any]:
    # No creation date, so re-rendering the same timeline gives the same file.
    return {"Date": None} if fmt == "svg" else {"Software": "zerobubble"}


def _shade(colour: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """``colour`` for a rank's first chunk, mixed towards white for its later ones."""
    from matplotlib.colors import to_rgb

    red, green, blue = to_rgb(colour)
    mix = 0.0 if chunks <= 1 else 0.55 * chunk / (chunks - 1)
    return (red + (1 - red) * mix, green + (1 - green) * mix, blue + (1 - blue) * mix)


def _text_colour(fill: tuple[float, float, float]) -> str:
    luminance = 0.299 * fill[0] + 0.587 * fill[1] + 0.114 * fill[2]
    return "black" if luminance > 0.6 else "white"


def _draw_timeline(axes: Axes, timeline: Any, t0: float, extent: float) -> None:
    """Draw one timeline's rows on ``axes``, times shifted by ``-t0``, x axis ``[0, extent]``."""
    import numpy as np
    from matplotlib.collections import PolyCollection

    schedule: Schedule = timeline.schedule
    ranks, chunks = schedule.num_ranks, schedule.chunks
    extent = extent if extent > 0 else 1.0
    boxes, fills, cells = [], [], []
    palette = {
        (kind, c): _shade(colour, c, chunks) for kind, colour in _COLOURS.items() for c in range(chunks)
    }
    chunk_of = [schedule.placement.chunk_index(s) for s in range(schedule.num_stages)]
    half = _ROW_FILL / 2
    heights = []  # each box's half height: an overlapped pair's two ops share the row, F on top
    for rank, (program, paired) in enumerate(zip(schedule.programs, _paired_positions(schedule))):
        for i, (op, start, end) in enumerate(zip(program, timeline.start[rank], timeline.end[rank])):
            fill = palette[(op.kind, 0 if op.is_vocab else chunk_of[op.stage])]
            shift = -half / 2 if i in paired else half / 2 if i - 1 in paired else None
            boxes.append((start - t0, end - t0, rank + (shift or 0.0)))
            heights.append(half if shift is None else half / 2)
            fills.append(fill)
            cells.append((op.microbatch, fill))
    own_end = time_bounds(timeline)[1] - t0
    background = [
        [(0, r - half), (own_end, r - half), (own_end, r + half), (0, r + half)] for r in range(ranks)
    ]
    axes.add_collection(PolyCollection(background, facecolors=_IDLE_COLOUR, edgecolors="none", zorder=1))
    if boxes:
        spans = np.asarray(boxes, dtype=float)
        x0, x1, y = spans[:, 0], spans[:, 1], spans[:, 2]
        h = np.asarray(heights, dtype=float)
        verts = np.stack(
            [np.column_stack(corner) for corner in ((x0, y - h), (x1, y - h), (x1, y + h), (x0, y + h))],
            axis=1,
        )
        pixels_per_unit = _axes_width_px(axes) / extent
        median_px = float(np.median(x1 - x0)) * pixels_per_unit
        edge_width = 0.6 if median_px >= 6 else 0.0
        # verts is an (N, 4, 2) array of corners, which matplotlib takes; its stubs admit only sequences
        boxes_collection = PolyCollection(
            verts,  # type: ignore[arg-type]
            facecolors=fills,
            edgecolors="white",
            linewidths=edge_width,
            zorder=2,
        )
        axes.add_collection(boxes_collection)
        _draw_labels(axes, spans, cells, pixels_per_unit, ranks)
    axes.set_xlim(0, extent)
    axes.set_ylim(ranks - 0.5, -0.5)
    _style_axes(axes, ranks)


def _paired_positions(schedule: Schedule) -> list[frozenset[int]]:
    """Per rank, the program positions that start an overlapped F&B pair."""
    return [frozenset(starts) for starts in schedule.pair_starts()]


def _figure_of(axes: Axes) -> Figure:
    # our axes always sit on a top-level Figure (never a SubFigure), see _new_figure
    return cast("Figure", axes.figure)


def _axes_width_px(axes: Axes) -> float:
    return axes.get_position().width * _figure_of(axes).get_size_inches()[0] * _DPI


def _draw_labels(
    axes: Axes,
    spans: np.ndarray,
    cells: Sequence[tuple[int, tuple[float, float, float]]],
    pixels_per_unit: float,
    ranks: int,
) -> None:
    """Microbatch numbers inside the cells wide enough for them.

    All or nothing, roughly: when most cells are too narrow a few scattered numbers only add noise,
    and beyond ``_MAX_LABELS`` texts the figure gets slow and unreadable, so none are drawn.
    """
    row_px = axes.get_position().height * _figure_of(axes).get_size_inches()[1] * _DPI / ranks
    font_pt = min(7.5, row_px * _ROW_FILL * 72 / _DPI * 0.75)
    if font_pt < 4:
        return
    char_px = font_pt * _DPI / 72 * 0.62
    widths = (spans[:, 1] - spans[:, 0]) * pixels_per_unit
    fits = [
        index
        for index, (microbatch, _) in enumerate(cells)
        if widths[index] >= char_px * len(str(microbatch)) + 3
    ]
    visible = int((widths > 0).sum())
    if not fits or len(fits) < _LABELLED_SHARE * visible or len(fits) > _MAX_LABELS:
        return
    for index in fits:
        microbatch, fill = cells[index]
        x0, x1, y = spans[index]
        axes.text(
            (x0 + x1) / 2,
            y,
            str(microbatch),
            ha="center",
            va="center_baseline",
            fontsize=font_pt,
            color=_text_colour(fill),
            zorder=3,
            clip_on=True,
        )


def _style_axes(axes: Axes, ranks: int) -> None:
    from matplotlib.ticker import FixedLocator, MaxNLocator

    step = max(1, math.ceil(ranks / 32))
    ticks = list(range(0, ranks, step))
    axes.yaxis.set_major_locator(FixedLocator(ticks))
    axes.set_yticklabels([f"rank {r}" for r in ticks], fontsize=8 if ranks <= 16 else 6.5)
    axes.xaxis.set_major_locator(MaxNLocator(nbins=12))
    axes.tick_params(axis="x", labelsize=8)
    axes.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        axes.spines[side].set_visible(False)
    axes.set_facecolor("white")


def _legend_handles(schedule: Schedule) -> list[Any]:
    """One patch per kind present (per chunk for up to 4 chunks), then idle."""
    from matplotlib.patches import Patch

    chunks = schedule.chunks
    handles = []
    for kind in _kinds_present(schedule):
        for chunk in range(chunks if chunks <= 4 else 1):
            label = _KIND_NAMES[kind] + (f" (chunk {chunk})" if chunks > 1 and chunks <= 4 else "")
            label = f"{kind.value}: {label}"
            handles.append(
                Patch(facecolor=_shade(_COLOURS[kind], chunk, chunks), edgecolor="none", label=label)
            )
    handles.append(Patch(facecolor=_IDLE_COLOUR, edgecolor="none", label="idle"))
    return handles


def _legend_fit(figure: Figure, handles: Sequence[Any]) -> tuple[int, float]:
    """The most columns (up to :data:`_LEGEND_COLUMNS`) whose legend fits between the side margins,
    and that legend's height in inches (measured: it is drawn, then removed)."""
    available = (_FIGURE_WIDTH_IN - _LEFT_IN - _RIGHT_IN) * _DPI
    renderer = cast(Any, figure.canvas).get_renderer()
    for columns in range(min(_LEGEND_COLUMNS, len(handles)), 0, -1):
        legend = figure.legend(handles=handles, ncol=columns, **_LEGEND_STYLE)
        box = legend.get_window_extent(renderer)
        legend.remove()
        if box.width <= available or columns == 1:
            return columns, box.height / _DPI
    raise AssertionError("unreachable: one column always returns")


def _place_legend(figure: Figure, handles: Sequence[Any], columns: int) -> None:
    """The legend in ``columns`` columns, its top-left corner at the panels' left edge under the title."""
    width_in, height_in = figure.get_size_inches()
    figure.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(_LEFT_IN / width_in, 1 - _TITLE_IN / height_in),
        ncol=columns,
        **_LEGEND_STYLE,
    )
