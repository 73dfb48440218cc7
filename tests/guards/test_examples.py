"""The examples run end to end (slow: each spawns ranks and imports transformers)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.long
@pytest.mark.parametrize("model", ["gpt2", "llama", "gemma2", "mixtral"])
def test_transformers_pipeline_example_trains(model, tmp_path):
    pytest.importorskip("transformers")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    command = [sys.executable, str(ROOT / "examples" / "transformers_pipeline.py"), "--model", model]
    command += ["--steps", "6", "--depth", "2", "--trace", str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    losses = [float(line.split()[3]) for line in done.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 2 and losses[-1] < losses[0], done.stdout
    assert "W share of each stage's backward" in done.stdout
    assert (tmp_path / "trace.json").exists()
