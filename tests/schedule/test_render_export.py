"""Pictures (text, SVG, PNG) and exports (JSON, torch CSV, Chrome trace) of schedules and timelines."""

from __future__ import annotations

import json
import re
import time
from types import SimpleNamespace
from xml.etree import ElementTree

import pytest

from zerobubble.schedule import (
    B,
    CostModel,
    F,
    Kind,
    Placement,
    Schedule,
    ScheduleError,
    W,
    build_schedule,
    simulate,
    validate_schedule,
)
from zerobubble.schedule.export import FORMATS, export, to_chrome_trace, to_json, to_torch_csv
from zerobubble.schedule.render import render_comparison, render_image, render_text, timeline_figures

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def split_backward(schedule: Schedule, name: str = "split") -> Schedule:
    """``schedule`` with every fused BW replaced by B then W (a valid split schedule)."""
    programs = []
    for program in schedule.programs:
        ops = []
        for op in program:
            ops += [B(op.stage, op.microbatch), W(op.stage, op.microbatch)] if op.kind is Kind.BW else [op]
        programs.append(ops)
    return Schedule(name, schedule.placement, schedule.microbatches, programs)


def vshape_split_schedule(ranks: int, microbatches: int) -> Schedule:
    """A V-placed schedule with split backwards: one global topological order projected on ranks."""
    placement = Placement.vshape(ranks)
    stages = placement.num_stages
    order = [F(s, j) for s in range(stages) for j in range(microbatches)]
    order += [B(s, j) for s in reversed(range(stages)) for j in range(microbatches)]
    order += [W(s, j) for s in range(stages) for j in range(microbatches)]
    programs = [[op for op in order if placement.rank_of(op.stage) == rank] for rank in range(ranks)]
    schedule = Schedule("v-split", placement, microbatches, programs)
    validate_schedule(schedule, CostModel())
    return schedule


def letters_of(schedule: Schedule) -> list[list[str]]:
    """What the numbered text rows must show: kind letter (X for BW, lower case after chunk 0) and mb."""
    letter = {Kind.F: "F", Kind.B: "B", Kind.W: "W", Kind.BW: "X"}
    rows = []
    for program in schedule.programs:
        row = []
        for op in program:
            text = letter[op.kind]
            if schedule.placement.chunk_index(op.stage) > 0:
                text = text.lower()
            row.append(f"{text}{op.microbatch}")
        rows.append(row)
    return rows


def rank_rows(text: str) -> list[str]:
    return [line.split("|")[1] for line in text.splitlines() if line.startswith("rank ")]


# ---------------------------------------------------------------------------------------------- text


def test_text_has_one_row_per_rank_and_the_closed_form_numbers():
    p, m = 4, 8
    timeline = simulate(build_schedule("1f1b", p, m))
    text = render_text(timeline)
    assert len(rank_rows(text)) == p
    iteration = 3 * (m + p - 1)  # unit costs: 1F1B's period is (m + p - 1)(T_F + T_B + T_W)
    bubble = (p - 1) * 3 / iteration
    caption = text.splitlines()[-1]
    assert f"iteration time {iteration}" in caption
    assert f"bubble rate {bubble:.2%}" in caption
    assert f"peak memory {p} M_B" in caption


def test_text_numbered_rows_list_each_rank_program_in_order():
    for schedule in (
        build_schedule("1f1b", 4, 8),
        build_schedule("interleaved-1f1b", 2, 4, chunks=2),
        split_backward(build_schedule("1f1b", 3, 6)),
    ):
        rows = rank_rows(render_text(simulate(schedule), width=160))
        assert [re.findall(r"[FBWXfbwx]\d+", row) for row in rows] == letters_of(schedule)


def test_text_shows_idle_time_where_1f1b_waits():
    rows = rank_rows(render_text(simulate(build_schedule("1f1b", 4, 8))))
    # Rank 0 idles between its last warm-up forward and its first backward; rank 3 starts late.
    assert re.search(r"F3 *\.+X0", rows[0])
    assert rows[3].startswith("...")
    assert not rows[3].startswith("F")


@pytest.mark.parametrize("width", [20, 100, 237])
def test_text_rows_keep_their_width_even_for_big_pipelines(width):
    schedule = build_schedule("1f1b", 32, 256)
    text = render_text(simulate(schedule), width=width)
    rows = rank_rows(text)
    assert len(rows) == 32
    assert all(len(row) == width for row in rows)
    assert set("".join(rows)) <= {"F", "X", "."}


def test_text_uses_letters_for_split_backward_and_lower_case_for_later_chunks():
    split = rank_rows(render_text(simulate(split_backward(build_schedule("1f1b", 4, 32))), width=60))
    assert {"B", "W", "F"} <= set("".join(split)) and "X" not in "".join(split)
    interleaved = rank_rows(
        render_text(simulate(build_schedule("interleaved-1f1b", 4, 32, chunks=2)), width=60)
    )
    assert {"f", "x", "F", "X"} <= set("".join(interleaved))


def test_text_rejects_a_tiny_width():
    with pytest.raises(ScheduleError, match="width"):
        render_text(simulate(build_schedule("1f1b", 2, 2)), width=3)


def test_timeline_like_objects_get_their_numbers_from_start_and_end():
    timeline = simulate(build_schedule("1f1b", 4, 8), CostModel(f=1, b=2, w=1.5, comm=0.25))
    recorded = SimpleNamespace(schedule=timeline.schedule, start=timeline.start, end=timeline.end)
    derived, own = timeline_figures(recorded), timeline_figures(timeline)
    assert derived.iteration_time == pytest.approx(own.iteration_time)
    assert derived.makespan == pytest.approx(own.makespan)
    assert derived.bubble_rate == pytest.approx(own.bubble_rate)
    assert derived.bubble_rate_makespan == pytest.approx(own.bubble_rate_makespan)
    assert derived.peak_memory_mb is None and own.peak_memory_mb == 4
    assert "peak memory" not in render_text(recorded).splitlines()[-1]


# --------------------------------------------------------------------------------------------- image


def svg_root(path):
    root = ElementTree.parse(path).getroot()
    assert root.tag.endswith("svg")
    return root


def svg_texts(root) -> list[str]:
    return ["".join(node.itertext()) for node in root.iter() if node.tag.endswith("text")]


@pytest.mark.parametrize("name,chunks", [("1f1b", None), ("interleaved-1f1b", 2)])
def test_small_images_are_valid_files_with_labels_and_caption(tmp_path, name, chunks):
    timeline = simulate(build_schedule(name, 4, 8, chunks=chunks))
    render_image(timeline, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == PNG_MAGIC
    render_image(timeline, tmp_path / "t.svg", title="my title")
    texts = svg_texts(svg_root(tmp_path / "t.svg"))
    assert "my title" in texts
    assert any(f"bubble rate {timeline.bubble_rate:.2%}" in text for text in texts)
    labels = [text for text in texts if text.isdigit() and int(text) < 8]
    assert len(labels) >= timeline.schedule.num_ops  # every cell carries its microbatch (plus tick labels)


def test_big_image_is_fast_and_drops_cell_labels(tmp_path):
    timeline = simulate(build_schedule("1f1b", 32, 256))
    assert timeline.schedule.num_ops == 32 * 256 * 2
    began = time.perf_counter()
    render_image(timeline, tmp_path / "big.png")
    render_image(timeline, tmp_path / "big.svg")
    assert time.perf_counter() - began < 20
    assert (tmp_path / "big.png").read_bytes()[:8] == PNG_MAGIC
    texts = svg_texts(svg_root(tmp_path / "big.svg"))
    assert len(texts) < 200  # title, caption, legend, ticks: no per-cell labels


def test_image_rejects_other_suffixes(tmp_path):
    timeline = simulate(build_schedule("1f1b", 2, 2))
    for name in ("t.pdf", "t", "t.jpeg"):
        with pytest.raises(ScheduleError, match=r"\.svg or \.png"):
            render_image(timeline, tmp_path / name)
    assert list(tmp_path.iterdir()) == []


def test_comparison_draws_both_panels(tmp_path):
    schedule = split_backward(build_schedule("1f1b", 4, 8))
    predicted = simulate(schedule)
    slow = simulate(schedule, CostModel(f=1.2, b=1.1, w=0.9, comm=0.1))
    measured = SimpleNamespace(schedule=schedule, start=slow.start, end=slow.end)
    render_comparison(measured, predicted, tmp_path / "c.svg")
    texts = svg_texts(svg_root(tmp_path / "c.svg"))
    assert any(text.startswith("measured: ") for text in texts)
    assert any(text.startswith("predicted (simulator): ") for text in texts)
    render_comparison(measured, predicted, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ScheduleError, match="rank"):
        render_comparison(simulate(build_schedule("1f1b", 2, 8)), predicted, tmp_path / "d.png")


def _layout_boxes(figure) -> dict:
    """Pixel boxes of what a picture shows: the title, the legend, each panel with its title, ticks and
    labels, each caption."""
    renderer = figure.canvas.get_renderer()
    boxes = {"title": figure._suptitle.get_window_extent(renderer)}
    boxes |= {f"legend {i}": legend.get_window_extent(renderer) for i, legend in enumerate(figure.legends)}
    boxes |= {f"panel {i}": axes.get_tightbbox(renderer) for i, axes in enumerate(figure.axes)}
    captions = [text for text in figure.texts if text is not figure._suptitle]
    boxes |= {f"caption {i}": text.get_window_extent(renderer) for i, text in enumerate(captions)}
    return boxes


def _overlaps(boxes: dict) -> list[str]:
    names = sorted(boxes)
    found = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            common = boxes[a].intersection(boxes[a], boxes[b])
            if common is not None and common.width > 0.5 and common.height > 0.5:
                found.append(f"{a} and {b}")
    return found


@pytest.mark.parametrize(
    ("name", "costs", "title"),
    [
        ("1f1b", CostModel(), None),
        ("zb-v", CostModel(), None),  # two chunks: a legend of two rows
        ("zb-v", CostModel(vocab_s=0.5, vocab_t=0.25, vocab_comm=0.05, vocab_mem=0.2), None),  # 11 entries
        ("interleaved-1f1b", CostModel(), "a title as long as a user may give one: " + "long " * 14),
    ],
)
def test_title_legend_panels_and_captions_never_overlap(name, costs, title):
    from zerobubble.schedule.render import _comparison_figure, _image_figure

    schedule = build_schedule(name, 4, 8, costs, chunks=4 if name == "interleaved-1f1b" else None,
                              vocab_parallel=costs.vocab_s > 0)  # fmt: skip
    timeline = simulate(schedule, costs)
    measured = SimpleNamespace(schedule=schedule, start=timeline.start, end=timeline.end)
    for figure in (_image_figure(timeline, title), _comparison_figure(measured, timeline, title)):
        boxes = _layout_boxes(figure)
        assert not _overlaps(boxes), f"{name}: {_overlaps(boxes)} overlap"
        width, height = figure.get_size_inches() * figure.dpi
        for what, box in boxes.items():  # nothing is cut off at the figure's edges
            assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= width and box.y1 <= height, what


# ------------------------------------------------------------------------------------------- exports


TORCH_TYPE = {Kind.F: "F", Kind.B: "I", Kind.W: "W", Kind.BW: "B"}


def torch_schedules():
    return [
        build_schedule("1f1b", 4, 8),
        build_schedule("interleaved-1f1b", 4, 8, chunks=2),
        split_backward(build_schedule("1f1b", 4, 8)),
        vshape_split_schedule(3, 4),
    ]


@pytest.mark.parametrize("schedule", torch_schedules(), ids=lambda s: f"{s.name}-{s.placement.style}")
def test_torch_csv_cells_parse_as_torch_actions(schedule):
    pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")
    rows = to_torch_csv(schedule).splitlines()
    assert len(rows) == schedule.num_ranks
    for row, program in zip(rows, schedule.programs):
        actions = [pipelining._Action.from_str(cell) for cell in row.split(",")]
        assert [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in actions] == [
            (op.stage, TORCH_TYPE[op.kind], op.microbatch) for op in program
        ]


def load_in_torch_runtime(schedule: Schedule, path) -> None:
    """Load ``schedule``'s CSV the way torch's own tests drive ``_PipelineScheduleRuntime`` and check it."""
    pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")
    stage_module = pytest.importorskip("torch.distributed.pipelining.stage")

    class StubStage(stage_module._PipelineStageBase):
        """Just the attributes the schedule runtime reads, as in torch's schedule tests."""

        def __init__(self, num_stages, group_size, group_rank):
            self.submod = None
            self.num_stages, self.group_size, self.group_rank = num_stages, group_size, group_rank
            self.group = None
            self.stage_index_to_group_rank = None

        def _create_grad_recv_info(self, *args, **kwargs):
            return None

        def _prepare_forward_infra(self, n_microbatches):
            pass

        def _prepare_backward_infra(self, n_microbatches):
            pass

    text = to_torch_csv(schedule)
    path.write_text(text)
    stage = StubStage(schedule.num_stages, schedule.num_ranks, 0)
    runtime = pipelining._PipelineScheduleRuntime([stage], schedule.microbatches)
    runtime._load_csv(str(path), format="compute_only")
    expected = {s: schedule.placement.rank_of(s) for s in range(schedule.num_stages)}
    assert runtime.stage_index_to_group_rank == expected
    assert [str(a) for a in runtime.pipeline_order[1]] == text.splitlines()[1].split(",")
    assert len(runtime.pipeline_order_with_comms) == schedule.num_ranks


@pytest.mark.parametrize("schedule", torch_schedules(), ids=lambda s: f"{s.name}-{s.placement.style}")
def test_torch_csv_loads_in_torch_runtime(schedule, tmp_path):
    load_in_torch_runtime(schedule, tmp_path / "schedule.csv")


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "zb-v"])
def test_torch_csv_of_registered_zero_bubble_schedules_loads(name, tmp_path):
    load_in_torch_runtime(build_schedule(name, 4, 8), tmp_path / "schedule.csv")


def test_torch_csv_writes_fused_and_split_backwards_as_torch_letters():
    assert to_torch_csv(build_schedule("1f1b", 2, 2)) == "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"
    split = to_torch_csv(split_backward(build_schedule("1f1b", 2, 2)))
    assert split == "0F0,0F1,0I0,0W0,0I1,0W1\n1F0,1I0,1W0,1F1,1I1,1W1\n"


def test_chrome_trace_has_one_complete_event_per_op():
    costs = CostModel(f=1, b=1.5, w=0.5, comm=0.1, mem_w=0.25)
    timeline = simulate(split_backward(build_schedule("1f1b", 4, 8)), costs)
    trace = json.loads(to_chrome_trace(timeline, time_unit_us=1000.0))
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == timeline.schedule.num_ops
    for event in complete:
        assert {"ph", "ts", "dur", "pid", "tid", "name", "cat", "args"} <= set(event)
    t0 = min(s[0] for s in timeline.start)
    expected = {
        (rank, str(op)): ((start - t0) * 1000, (end - start) * 1000)
        for rank, op, start, end in timeline.events()
    }
    got = {(e["tid"], e["name"]): (e["ts"], e["dur"]) for e in complete}
    # names and ranks exactly (one event per op), times to the microsecond rounding of the exporter
    assert got.keys() == expected.keys()
    for key, (start_us, duration_us) in expected.items():
        assert got[key][0] == pytest.approx(start_us, abs=1e-5), key
        assert got[key][1] == pytest.approx(duration_us, abs=1e-5), key
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {r: f"rank {r}" for r in range(4)}
    for rank in range(4):
        levels = [e["args"]["M_B"] for e in events if e["ph"] == "C" and e["name"] == f"memory rank {rank}"]
        assert max(levels) == pytest.approx(timeline.peak_memory_mb[rank])
        assert levels[-1] == pytest.approx(0.0)


def test_export_dispatches_and_rejects_unknown_formats():
    schedule = build_schedule("interleaved-1f1b", 2, 4, chunks=2)
    timeline = simulate(schedule)
    assert Schedule.from_json(export(schedule, "json")) == schedule
    assert export(timeline, "json") == to_json(schedule)
    assert export(timeline, "torch-csv") == to_torch_csv(schedule)
    assert export(schedule, "chrome-trace") == to_chrome_trace(timeline)
    assert set(FORMATS) == {"json", "torch-csv", "chrome-trace"}
    with pytest.raises(ScheduleError, match="unknown export format"):
        export(schedule, "yaml")
    with pytest.raises(ScheduleError, match="Schedule or a Timeline"):
        export("F0.0", "json")


def test_render_and_export_do_not_import_heavy_modules():
    import subprocess
    import sys

    code = (
        "import sys, zerobubble.schedule.render, zerobubble.schedule.export; "
        "print('torch' in sys.modules, 'matplotlib' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
