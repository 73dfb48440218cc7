"""``zerobubble train --profile DIR`` writes one torch profiler Chrome trace per rank, with our ranges."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerobubble.cli import main
from zerobubble_demo.profiling import profile_path, profile_window


def test_profile_window_skips_the_first_step_and_fits_short_runs():
    assert profile_window(50) == (1, 1, 3)
    assert profile_window(4) == (1, 1, 2)
    assert profile_window(3) == (1, 1, 1)
    assert profile_window(2) == (0, 1, 1)
    assert profile_window(1) == (0, 0, 1)
    for steps in range(1, 8):
        assert sum(profile_window(steps)) <= steps


@pytest.mark.multiprocess
def test_train_profile_writes_a_trace_per_rank_with_the_schedule(tmp_path, capsys):
    folder = tmp_path / "profile"
    argv = ["train", "--schedule", "zb-h1", "--ranks", "2", "--steps", "4", "--microbatches", "2"]
    argv += ["--batch-size", "4", "--seq-len", "8", "--vocab", "16", "--dim", "16", "--heads", "2"]
    argv += ["--layers", "2", "--no-progress", "--timeout", "60", "--profile", str(folder)]
    assert main(argv) == 0
    out = capsys.readouterr().out.replace("\n", "")  # rich wraps long lines
    assert "torch profiler traces of steps 3-4" in out and "rank*.pt.trace.json" in out
    for rank in (0, 1):
        events = json.loads(Path(profile_path(str(folder), rank)).read_text())["traceEvents"]
        names = [event.get("name", "") for event in events]
        ops = [name for name in names if name.startswith("zerobubble/")]
        # two profiled steps, each the rank's 3·m zb-h1 ops, its sends/receives and hooks
        assert sum(name.startswith(f"zerobubble/F s{rank} ") for name in ops) == 2 * 2
        assert sum(name.startswith(f"zerobubble/W s{rank} ") for name in ops) == 2 * 2
        assert ops.count("zerobubble/hook optimizer settle") == 2
        assert sum(name.startswith("zerobubble/send ") for name in ops) == 2 * 2
        assert sum(name.startswith("zerobubble/recv ") for name in ops) == 2 * 2
        assert sum(name.startswith("ProfilerStep#") for name in names) == 2
