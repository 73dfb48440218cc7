"""``zerobubble bench schedulers`` through the command line: build times, and the cost grid's rows."""

from __future__ import annotations

from zerobubble.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_bench_schedulers_prints_build_times(capsys):
    code, out, _ = run(
        capsys,
        "bench",
        "schedulers",
        "--stages",
        "4",
        "--microbatches",
        "8",
        "--rounds",
        "1",
        "--schedules",
        "zb-1p",
        "zb-v",
    )
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith("| zb-")]
    assert [row.split("|")[1].strip() for row in rows] == ["zb-1p", "zb-v"]
    for row in rows:
        build_seconds = float(row.split("|")[2])
        assert build_seconds >= 0


def test_bench_schedulers_grid_prints_one_row_per_schedule(capsys):
    code, out, _ = run(
        capsys,
        "bench",
        "schedulers",
        "--grid",
        "--stages",
        "4",
        "--microbatches",
        "8",
        "--grid-settings",
        "2",
        "--rounds",
        "1",
        "--schedules",
        "zb-2p",
        "v-min",
    )
    assert code == 0 and "Build time on the cost grid, p = 4, m = 8, 2 settings" in out
    rows = [line.split("|") for line in out.splitlines() if line.startswith(("| zb-", "| v-"))]
    assert [row[1].strip() for row in rows] == ["zb-2p", "v-min"]
    for row in rows:
        assert float(row[5]) <= float(row[6])  # the median setting is no slower than the worst
        cpu_median, cpu_worst = map(float, row[8].split(","))
        assert 0 <= cpu_median <= cpu_worst
