"""``simulate``, ``show`` and ``export`` with ``--dp``: the schedule lowered first (its communication
reported, drawn in lanes of its own, traced), the same numbers as the library's, and every bad
value or combination one line with exit status 2."""

from __future__ import annotations

import json

import pytest

from zerobubble.cli import main
from zerobubble.schedule import REGISTRY, CostModel, build_schedule
from zerobubble.schedule.grid import Grid, Link
from zerobubble.schedule.lowering import (
    CollectiveCosts,
    StageBytes,
    choose_options,
    lower,
    simulate_lowered,
)
from zerobubble.schedule.sharding import FSDPOptions

SETUP = ("-s", "zb-v", "-p", "4", "-m", "8")
FSDP = ("--dp", "4", "--sharding", "fsdp")


def run_json(capsys, *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def one_line_error(capfd, *argv: str) -> str:
    code = main(list(argv))
    err = capfd.readouterr().err
    assert code == 2, err
    assert err.startswith("zerobubble: error: ") and err.count("\n") == 1, err
    return err


def library_timeline(name: str, options: dict, *, dp: int, sharding: str | None, link: Link):
    """What the library gives for the default sizes the CLI assumes (4 layers of 1 per stage)."""
    costs = CostModel(f=1, b=1, w=1, comm=0, mem_b=1, mem_w=0)
    schedule = build_schedule(name, 4, 8, costs)
    grid = Grid(dp=dp, sharding=sharding, dp_link=link, pp=4)
    model = StageBytes.uniform(schedule.num_stages, 4, 1.0)
    lowered = lower(schedule, FSDPOptions(**options), grid=grid, model=model)
    stage_costs = REGISTRY[name].resolve_costs(costs, 4)
    return simulate_lowered(lowered, stage_costs, CollectiveCosts.from_grid(grid))


def test_simulate_reports_the_lowered_step_as_the_library_times_it(capsys):
    report = run_json(capsys, "simulate", *SETUP, *FSDP, "--units", "layer", "--reshard", "both")
    expected = library_timeline(
        "zb-v",
        {"units": "layer", "reshard_after_forward": True, "reshard_after_backward": True},
        dp=4,
        sharding="fsdp",
        link=Link(0.0, 4.0),
    )
    assert report["lowering"] == "FSDP per-layer units, reshard after forward and backward, prefetch 1"
    assert report["iteration_time"] == pytest.approx(expected.iteration_time)
    assert report["exposed_dp"] == pytest.approx([e["dp"] for e in expected.exposed])
    assert report["peak_memory"] == pytest.approx(list(expected.peak_memory))
    # the sum's peak: at most the two peaks added (gradient buffers and activations peak apart)
    for total, a, p in zip(report["peak_memory"], report["peak_activations"], report["peak_parameters"]):
        assert max(a, p) <= total <= a + p + 1e-9
    # communication can only add to the compute-only step
    assert report["iteration_time"] > report["compute_only_time"] and max(report["exposed_dp"]) > 0


def test_each_option_reaches_the_lowering(capsys):
    cases = [
        (
            ("--units", "2", "--prefetch", "0"),
            "FSDP 2-layer units, kept whole until the last gradient op, prefetch 0",
        ),
        (("--units", "chunk", "--reshard", "after-forward"), "FSDP per-chunk units, reshard after forward"),
        (("--reshard", "after-backward", "--prefetch", "2"), "reshard after backward, prefetch 2"),
    ]
    for flags, lowering in cases:
        assert lowering in run_json(capsys, "simulate", *SETUP, *FSDP, *flags)["lowering"]
    replicated = run_json(capsys, "simulate", *SETUP, "--dp", "2", "--bucket", "2")
    assert replicated["lowering"] == "replicated, all-reduce in 2-byte buckets"
    assert replicated["setup"].startswith("dp 2 (replicated)")
    hsdp = run_json(capsys, "simulate", *SETUP, "--dp", "4", "--sharding", "hsdp", "--dp-shard", "2")
    assert hsdp["setup"].startswith("dp 4 (HSDP, shards of 2)")


def test_sizes_and_link_are_read_with_units(capsys):
    flags = ("--layers-per-stage", "2", "--layer-bytes", "1MiB", "--dp-link", "0.5,1MiB/s")
    report = run_json(capsys, "simulate", *SETUP, *FSDP, *flags, "--memory", "1048576,0")
    assert report["setup"] == (
        "dp 4 (FSDP); 8 virtual stages × 2 layers of 1.04858e+06; dp link 0.5 + size / 1.04858e+06"
    )
    # a rank's two stages of 2 MiB, per-chunk units kept whole until their last gradient op: both at
    # once, and both gradient buffers
    assert report["peak_parameters"] == pytest.approx([8 * 2**20] * 4)
    assert report["peak_activations"] == pytest.approx([4 * 2**20] * 4)


def test_without_data_parallelism_nor_hop_costs_the_lowered_step_is_the_schedules(capsys):
    report = run_json(capsys, "simulate", *SETUP, "--dp", "1")
    assert report["setup"] == "no data parallelism; 8 virtual stages × 4 layers of 1"
    assert report["lowering"] == "no data parallelism"
    assert report["iteration_time"] == pytest.approx(report["compute_only_time"])
    assert report["exposed_dp"] == [0, 0, 0, 0]


def test_simulate_text_names_the_numbers(capsys):
    assert main(["simulate", *SETUP, *FSDP, "--units", "layer"]) == 0
    out = capsys.readouterr().out
    for key in ("iteration_time", "compute_only_time", "exposed_dp", "peak_parameters", "peak_memory"):
        assert f"{key}: " in out


def test_choose_picks_the_library_choice_and_lists_the_candidates(capsys):
    report = run_json(capsys, "simulate", *SETUP, *FSDP, "--choose", "--memory-cap", "14")
    costs = CostModel(f=1, b=1, w=1, comm=0, mem_b=1, mem_w=0)
    schedule = build_schedule("zb-v", 4, 8, costs)
    grid = Grid(dp=4, sharding="fsdp", dp_link=Link(0.0, 4.0), pp=4)
    choice = choose_options(
        schedule,
        REGISTRY["zb-v"].resolve_costs(costs, 4),
        grid,
        StageBytes.uniform(8, 4, 1.0),
        memory_cap=14,
    )
    assert report["choice"] == choice.reason and report["lowering"] == choice.options.describe()
    assert report["fits_memory_cap"] is True and max(report["peak_memory"]) <= 14
    assert len(report["candidates"]) == len(choice.tried) == 18
    assert {"lowering", "iteration_time", "peak_memory"} == set(report["candidates"][0])
    tight = run_json(capsys, "simulate", *SETUP, *FSDP, "--choose", "--memory-cap", "1")
    assert tight["fits_memory_cap"] is False and "no candidate fits the cap 1" in tight["choice"]


def test_show_draws_communication_lanes_as_text_and_svg(capsys, tmp_path):
    assert main(["show", *SETUP, *FSDP, "--units", "layer", "--width", "60"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [row.split("|")[0].strip() for row in rows[:3]] == ["rank 0", "pp", "dp"]
    assert all(len(row.split("|")[1]) == 60 for row in rows[:-1])
    assert "g" in rows[2].split("|")[1] and "r" in rows[2].split("|")[1]  # gathers and reduce-scatters
    picture = tmp_path / "zbv.svg"
    assert main(["show", *SETUP, *FSDP, "-o", str(picture)]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {picture}: zb-v lowered (FSDP per-chunk units")
    assert picture.read_text().startswith("<svg") and ">dp</text>" in picture.read_text()


def test_export_chrome_trace_has_a_thread_per_lane(capsys):
    assert main(["export", *SETUP, "--dp", "2", "--format", "chrome-trace"]) == 0
    trace = json.loads(capsys.readouterr().out)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"rank 0", "rank 0 pp", "rank 0 dp", "rank 3 dp"} <= names
    assert any(e.get("cat") == "dp" and e["name"].startswith("all_reduce") for e in trace["traceEvents"])


ERRORS = [
    (["simulate", "--units", "layer"], "--units goes with --dp N"),
    (["simulate", "--choose"], "--choose goes with --dp N"),
    (["simulate", "--dp", "0"], "argument --dp: must be a positive integer, got '0'"),
    (["simulate", "--dp", "2", "--units", "layer"], "--units applies to --sharding fsdp or hsdp"),
    (
        ["simulate", "--dp", "2", "--sharding", "fsdp", "--bucket", "4"],
        "--bucket applies to --sharding replicate",
    ),
    (["simulate", "--dp", "4", "--dp-shard", "2"], "--dp-shard applies to --sharding hsdp"),
    (["simulate", "--dp", "1", "--dp-link", "0,1"], "--dp-link applies to data parallelism (--dp ≥ 2)"),
    (
        ["simulate", "--dp", "1", "--sharding", "fsdp"],
        "fsdp shards over the data-parallel ranks: give dp ≥ 2",
    ),
    (["simulate", "--dp", "4", "--sharding", "hsdp"], "hsdp needs dp_shard ≥ 2"),
    (["simulate", "--dp", "2", "--sharding", "zero"], "argument --sharding: invalid choice: 'zero'"),
    (
        ["simulate", "--dp", "2", "--sharding", "fsdp", "--units", "0"],
        "--units: must be chunk, layer or a positive",
    ),
    (["simulate", "--dp", "2", "--sharding", "fsdp", "--reshard", "never"], "--reshard: invalid choice"),
    (["simulate", "--dp", "2", "--sharding", "fsdp", "--prefetch=-1"], "--prefetch: must be a non-negative"),
    (["simulate", "--dp", "2", "--dp-link", "1"], "--dp-link: must be LATENCY,BANDWIDTH"),
    (["simulate", "--dp", "2", "--dp-link", "0,0"], "--dp-link: must be a positive amount, got '0'"),
    (["simulate", "--dp", "2", "--dp-link", "0,25Gb/s"], "--dp-link: must be an amount"),
    (["simulate", "--dp", "2", "--layer-bytes", "2XB"], "--layer-bytes: must be an amount"),
    (["simulate", "--dp", "2", "--layer-bytes", "1e999"], "--layer-bytes: must be an amount"),
    (["simulate", "--dp", "2", "--bucket", "-1"], "--bucket: must be an amount"),
    (["simulate", "--dp", "2", "--layers-per-stage", "0"], "--layers-per-stage: must be a positive integer"),
    (["simulate", "--dp", "2", "--memory-cap", "3"], "--memory-cap goes with --choose"),
    (["simulate", "--dp", "2", "--choose", "--memory-cap", "0"], "--memory-cap: must be a positive amount"),
    (
        ["simulate", "--dp", "2", "--sharding", "fsdp", "--choose", "--units", "layer"],
        "--choose picks --units",
    ),
    (
        ["show", "--dp", "2", "-o", "x.png"],
        "show --dp draws its communication lanes as SVG: give -o FILE.svg",
    ),
    (["show", "--dp", "2", "--width", "5"], "width must be at least 10 columns"),
    (["export", "--dp", "2"], "export --dp writes the lowered timeline as --format chrome-trace"),
]


@pytest.mark.parametrize("argv, message", ERRORS)
def test_a_bad_lowering_option_is_one_line(capfd, argv, message):
    assert message in one_line_error(capfd, *argv)
