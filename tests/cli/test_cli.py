"""The command line: outputs, JSON fields and one-line errors."""

import json
import subprocess
import sys

import pytest

from zerobubble.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_schedules_lists_the_registry(capsys):
    code, out, _ = run(capsys, "schedules")
    assert code == 0
    names = [line.split()[0] for line in out.splitlines()]
    assert {"gpipe", "1f1b", "interleaved-1f1b"} <= set(names)


def test_simulate_json_fields(capsys):
    code, out, _ = run(
        capsys,
        "simulate",
        "--schedule",
        "1f1b",
        "--stages",
        "4",
        "--microbatches",
        "8",
        "--cost",
        "1,2,1",
        "--memory",
        "2,1",
        "--json",
    )
    assert code == 0
    report = json.loads(out)
    for key in (
        "schedule",
        "stages",
        "microbatches",
        "chunks",
        "makespan",
        "iteration_time",
        "ideal",
        "bubble_rate",
        "bubble_rate_makespan",
        "peak_memory",
    ):
        assert key in report
    assert report["ideal"] == pytest.approx(8 * 4)
    assert report["makespan"] == pytest.approx(32 + 3 * 4)
    assert report["peak_memory"] == pytest.approx([4, 3, 2, 1])


def test_memory_limit_in_units_of_p(capsys):
    code, _, err = run(
        capsys, "simulate", "--schedule", "gpipe", "-p", "2", "-m", "6", "--memory-limit", "1p"
    )
    assert code == 2
    assert err.count("\n") == 1 and "above the limit 2" in err


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["simulate", "--schedule", "nope"], "unknown schedule"),
        (["simulate", "--stages", "0"], "--stages/-p: must be a positive integer, got '0'"),
        (["simulate", "--microbatches", "0"], "--microbatches/-m: must be a positive integer"),
        (["simulate", "--cost", "1,-1,1"], "non-negative"),
        (["simulate", "--schedule", "1f1b", "--chunks", "2"], "cannot take chunks=2"),
        (["simulate", "--memory-limit", "lots"], "cannot read memory limit"),
        (["simulate", "--cost", "1,1"], "--cost takes 3..4"),
        (["export", "--format", "pdf"], "invalid choice"),
    ],
)
def test_errors_are_one_line(capsys, argv, fragment):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert err.startswith("zerobubble: error:") and err.count("\n") == 1
    assert fragment in err


def test_module_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "zerobubble", "schedules"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0 and "1f1b" in result.stdout


def test_compare_reports_every_schedule(capsys):
    code, out, _ = run(capsys, "compare", "-p", "4", "-m", "8", "--json")
    assert code == 0
    rows = json.loads(out)["rows"]
    by_name = {row["schedule"]: row for row in rows}
    assert by_name["1f1b"]["speedup_vs_1f1b"] == pytest.approx(1.0)
    periods = [row["period"] for row in rows if row["error"] is None]
    assert periods == sorted(periods)


def test_compare_paper_model(capsys):
    code, out, _ = run(
        capsys,
        "compare",
        "--paper-model",
        "1.5B",
        "--microbatches",
        "24",
        "--schedules",
        "1f1b,interleaved-1f1b",
        "--optimizer",
        "sync",
        "--json",
    )
    assert code == 0
    rows = {row["schedule"]: row for row in json.loads(out)["rows"]}
    assert rows["1f1b"]["bubble_rate_makespan"] == pytest.approx(0.2431, abs=0.0015)
    assert rows["interleaved-1f1b"]["chunks"] == 3


def test_schedule_file_round_trip(capsys, tmp_path):
    code, out, _ = run(capsys, "export", "--schedule", "1f1b", "-p", "3", "-m", "4", "--format", "json")
    path = tmp_path / "s.json"
    path.write_text(out)
    code, out, _ = run(capsys, "simulate", "--schedule-file", str(path), "--json")
    assert code == 0 and json.loads(out)["makespan"] == pytest.approx(18)


def test_simulate_optimizer_modes(capsys):
    argv = ["simulate", "--schedule", "zb-h2", "-p", "4", "-m", "8", "--step-time", "2", "--json"]
    _, out, _ = run(capsys, *argv, "--optimizer", "sync")
    sync = json.loads(out)
    _, out, _ = run(capsys, *argv, "--optimizer", "post-validation")
    post = json.loads(out)
    assert sync["period"] == pytest.approx(sync["makespan"] + 2)
    assert post["period"] == pytest.approx(post["iteration_time"] + 2)
    # zb-h2's ranks start staggered: overlapping iterations are strictly shorter than a synchronous step
    assert post["period"] < sync["period"]


def test_compare_shows_both_optimizer_modes(capsys):
    code, out, _ = run(capsys, "compare", "-p", "4", "-m", "8", "--schedules", "1f1b,zb-h2")
    assert code == 0
    assert "sync period" in out and "post-val period" in out


def test_compare_gap_to_lower_bound(capsys):
    code, out, _ = run(
        capsys,
        "compare",
        "--paper-model",
        "1.5B",
        "--microbatches",
        "24",
        "--schedules",
        "1f1b,zb-1p,zb-2p",
        "--json",
    )
    assert code == 0
    rows = {row["schedule"]: row for row in json.loads(out)["rows"]}
    # zb-1p and zb-2p meet the analytic bound for their memory on this setup; 1f1b does not
    assert rows["zb-1p"]["gap_to_bound"] == pytest.approx(0.0, abs=1e-6)
    assert rows["zb-2p"]["gap_to_bound"] == pytest.approx(0.0, abs=1e-6)
    assert rows["1f1b"]["gap_to_bound"] > 0.05
    for row in rows.values():
        assert row["lower_bound"] <= row["iteration_time"] * (1 + 1e-9)


def test_train_rejects_a_batch_that_does_not_split(capsys):
    code, _, err = run(capsys, "train", "--batch-size", "7", "--microbatches", "4")
    assert code == 2
    assert err.count("\n") == 1 and "does not split into" in err and "4 microbatches" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--ranks", "0"], "--ranks: must be a positive integer, got '0'"),
        (["--steps", "-1"], "--steps: must be a positive integer, got '-1'"),
        (["--steps", "0"], "--steps: must be a positive integer, got '0'"),
        (["--microbatches", "0"], "--microbatches: must be a positive integer, got '0'"),
        (["--schedule", "nope"], "unknown schedule 'nope'"),
        (["--ranks", "3", "--data-parallel", "2"], "does not divide ranks=3"),
        (["--schedule", "zb-v", "--layers", "1"], "needs 4 chunks but the model has 3 layers"),
        (["--timeout", "0"], "--timeout: must be a positive number, got '0'"),
        (["--partition", "balanced"], "partition must be even or profile, got 'balanced'"),
        (["--compile", "nope"], "compile backend 'nope' is not one of torch.compile's"),
    ],
)
def test_train_validates_its_flags_before_starting_ranks(capsys, monkeypatch, flags, message):
    from zerobubble.runtime import launch

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(launch, "launch", no_ranks)
    code, _, err = run(capsys, "train", *flags)
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_show_writes_a_picture_and_prints_text(capsys, tmp_path):
    path = tmp_path / "zbh1.svg"
    code, out, _ = run(capsys, "show", "--schedule", "zb-h1", "-p", "4", "-m", "8", "--output", str(path))
    assert code == 0 and path.read_text().lstrip().startswith("<?xml")
    code, out, _ = run(capsys, "show", "--schedule", "zb-h1", "-p", "4", "-m", "8")
    assert code == 0 and out.count("rank ") >= 4 and "bubble rate" in out


def test_an_internal_value_error_is_not_swallowed(capsys, monkeypatch):
    """Only the project's own error types become one line; a bug elsewhere keeps its traceback."""
    from zerobubble.cli import base

    def broken(*args, **kwargs):
        raise ValueError("an internal bug, not a user error")

    monkeypatch.setattr(base, "build_schedule", broken)
    with pytest.raises(ValueError, match="internal bug"):
        main(["simulate", "--schedule", "1f1b"])


def test_memory_limit_spec_is_applied_once_for_every_caller():
    from zerobubble.schedule import REGISTRY, CostModel

    costs = CostModel(mem_b=2.0)
    assert costs.apply_memory_limit(None, 4) is costs
    assert costs.apply_memory_limit("1.5p", 4).memory_limit == pytest.approx(12.0)
    assert costs.apply_memory_limit(7, 4).memory_limit == 7.0
    assert REGISTRY["zb-1p"].resolve_costs(costs, 4).memory_limit == pytest.approx(8.0)
    user_limited = costs.apply_memory_limit("3p", 4)
    assert REGISTRY["zb-v"].resolve_costs(user_limited, 4).memory_limit == pytest.approx(24.0)
