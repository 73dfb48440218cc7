"""Our exported torch CSV runs a real step in torch's ``_PipelineScheduleRuntime``.

Two gloo ranks (one spawn) build their ``PipelineStage`` objects from the exported placement, load
the CSV of zb-h1, zb-2p and zb-v with ``_load_csv`` and run one step of a float64 MLP: the
gradients equal a single-process backward's.  ``export --format torch-csv`` writes and prints that
placement.
"""

from __future__ import annotations

import json

import pytest
from _dist import run_ranks
from _torch_runtime import torch_runtime_cases

from zerobubble.cli import main
from zerobubble.schedule import Placement, Schedule, build_schedule
from zerobubble.schedule.export import describe_torch_placement, torch_placement

CASES = [("zb-h1", 4), ("zb-2p", 4), ("zb-v", 4)]
STYLES = {"zb-h1": "loop", "zb-2p": "loop", "zb-v": "v"}
STAGES = {"zb-h1": [[0], [1]], "zb-2p": [[0], [1]], "zb-v": [[0, 3], [1, 2]]}


def test_torch_placement_names_the_style_and_each_ranks_stages():
    placement = torch_placement(build_schedule("zb-v", 4, 8))
    assert placement["style"] == "v" and placement["stages"] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert placement["num_stages"] == 8 and placement["num_ranks"] == 4 and placement["microbatches"] == 8
    looped = torch_placement(build_schedule("interleaved-1f1b", 2, 4, chunks=2))
    assert looped["style"] == "loop" and looped["stages"] == [[0, 2], [1, 3]]
    assert torch_placement(build_schedule("zb-h1", 2, 4))["style"] == "loop"
    odd = build_schedule("1f1b", 2, 2)
    odd = Schedule("odd", Placement.explicit([1, 0]), 2, odd.programs[::-1])
    assert torch_placement(odd)["style"] == "explicit"
    text = describe_torch_placement(build_schedule("zb-v", 2, 4))
    assert text == "style v: rank 0 holds stages 0,3; rank 1 holds stages 1,2"


def test_export_torch_csv_writes_the_placement_beside_the_csv(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert (
        main(["export", "--schedule", "zb-v", "-p", "2", "-m", "4", "--format", "torch-csv", "-o", "v.csv"])
        == 0
    )
    err = capsys.readouterr().err
    assert "style v: rank 0 holds stages 0,3; rank 1 holds stages 1,2" in err and "v.placement.json" in err
    assert json.loads((tmp_path / "v.placement.json").read_text())["stages"] == [[0, 3], [1, 2]]
    assert len((tmp_path / "v.csv").read_text().splitlines()) == 2
    argv = ["export", "--schedule", "zb-h1", "-p", "2", "-m", "4", "--format", "torch-csv"]
    assert main([*argv, "--placement", "h1.json"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 2, "stdout is the CSV alone"
    assert json.loads((tmp_path / "h1.json").read_text())["style"] == "loop"
    assert main(argv) == 0 and "style loop" in capsys.readouterr().err
    assert main(["export", "--schedule", "zb-h1", "--placement", "x.json"]) == 2
    assert "--placement goes with --format torch-csv" in capsys.readouterr().err


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    pytest.importorskip("torch.distributed.pipelining.schedules")
    return run_ranks(torch_runtime_cases, 2, CASES, timeout=120)


@pytest.mark.multiprocess
@pytest.mark.parametrize("index", range(len(CASES)), ids=[name for name, _ in CASES])
def test_exported_csv_runs_in_torch_runtime_with_reference_gradients(index, two_ranks):
    name = CASES[index][0]
    seen = []
    for rank, result in enumerate(two_ranks):
        case = result[index]
        assert case["style"] == STYLES[name]
        assert case["stages"] == STAGES[name][rank]
        assert case["actions"] > 0
        seen += case["errors"]
        worst = max(case["errors"].values())
        assert worst <= 1e-10, f"rank {rank}: gradient relative error {worst:.2e}"
    assert len(seen) == 8 and len(set(seen)) == 8, "every parameter of the 4 blocks on exactly one rank"
