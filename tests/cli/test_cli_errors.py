"""Every user error of the command line is one line on stderr and exit status 2 (the README's promise):
a bad number, a bandwidth without its unit, an output that cannot be written, a plan that fits
nothing on the spawned ranks, a damaged checkpoint or one of another model, a mesh torchrun did not
start; and the API refuses the same values (``compare_schedules``, ``plan_cluster``, ``Pipeline``)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zerobubble.cli import main

CLUSTER = "nodes=2,gpus=8,intra=300GB/s,inter=25GB/s"
# the smallest demo run: two ranks, a 2-block GPT of width 16
TINY = "--ranks 2 --microbatches 2 --batch-size 8 --seq-len 8 --vocab 16 --dim 16 --heads 2 --layers 2"


def one_line_error(capfd, *argv: str) -> str:
    """Run the command; assert exit status 2 and one line on stderr (the spawned ranks' too); return it."""
    code = main(list(argv))
    err = capfd.readouterr().err
    assert code == 2, err
    assert err.startswith("zerobubble: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def model_config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("model") / "config.json"
    sizes = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8}
    sizes["num_attention_heads"] = 16
    path.write_text(json.dumps({"model_type": "llama", "vocab_size": 32000, **sizes}))
    return str(path)


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if a command starts ranks: these errors must come before."""
    from zerobubble.runtime import launch

    def refuse(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(launch, "launch", refuse)


NUMBERS = [
    (["compare", "-m", "-32"], "argument --microbatches/-m: must be a positive integer, got '-32'"),
    (["compare", "-p", "0"], "argument --stages/-p: must be a positive integer, got '0'"),
    (["compare", "--chunks", "0"], "argument --chunks: must be a positive integer, got '0'"),
    (["compare", "--step-time=-1"], "argument --step-time: must be a non-negative number, got '-1'"),
    (["compare", "--ilp", "--time-limit", "0"], "argument --time-limit: must be a positive number"),
    (["compare", "--paper-model", "1.5B", "-m", "0"], "--microbatches/-m: must be a positive integer"),
    (["simulate", "--step-time", "nan"], "argument --step-time: must be a non-negative number, got 'nan'"),
    (["simulate", "--polish", "inf"], "argument --polish: must be a positive number, got 'inf'"),
    (["show", "--chunks", "-2"], "argument --chunks: must be a positive integer, got '-2'"),
    (["export", "-m", "2.5"], "argument --microbatches/-m: must be a positive integer, got '2.5'"),
    (["plan", "--ranks", "0"], "argument --ranks/-p: must be a positive integer, got '0'"),
    (["plan", "--chunks", "2", "0"], "argument --chunks: must be a positive integer, got '0'"),
    (["profile", "--threads", "0"], "argument --threads: must be a positive integer, got '0'"),
    (["profile", "--layers=-1"], "argument --layers: must be a non-negative integer, got '-1'"),
    (["train", "--timeout=-5"], "argument --timeout: must be a positive number, got '-5'"),
    (["train", "--lr", "0"], "argument --lr: must be a positive number, got '0'"),
    (["train", "--max-norm=-1"], "argument --max-norm: must be a positive number, got '-1'"),
    (["train", "--steps", "1.5"], "argument --steps: must be a positive integer, got '1.5'"),
    (["train", "--dim", "0"], "argument --dim: must be a positive integer, got '0'"),
    (["train", "--data-parallel", "0"], "'0' is not a replica count (a positive integer)"),
]


@pytest.mark.parametrize("argv, message", NUMBERS)
def test_a_number_out_of_range_is_one_line(capfd, no_ranks, argv, message):
    assert message in one_line_error(capfd, *argv)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--seq-len", "0"], "argument --seq-len: must be a positive integer, got '0'"),
        (["--seq-len", "-5"], "argument --seq-len: must be a positive integer, got '-5'"),
        (["--microbatch-size", "0"], "argument --microbatch-size: must be a positive integer, got '0'"),
        (["--top", "-1"], "argument --top: must be a positive integer, got '-1'"),
        (["--tokens-per-step=-5"], "argument --tokens-per-step: must be a positive integer, got '-5'"),
        (["--tokens-per-step", "0"], "argument --tokens-per-step: must be a positive integer, got '0'"),
    ],
)
def test_plan_cluster_refuses_non_positive_sizes(capfd, model_config, flags, message):
    argv = ["plan", "--cluster", CLUSTER, "--model", model_config, "--tokens-per-step", "131072", *flags]
    assert message in one_line_error(capfd, *argv)


@pytest.mark.parametrize(
    "cluster, message",
    [
        ("nodes=2,gpus=8,intra=300GB,inter=25GB/s", "intra='300GB': a bandwidth needs a rate unit"),
        ("nodes=2,gpus=8,intra=300GB/s,inter=25", "inter='25': a bandwidth needs a rate unit"),
        ("nodes=2,gpus=8,intra=300GB/s,inter=200Gb/s", "inter='200Gb/s': b is bits"),
        ("nodes=2,gpus=8,intra=0GB/s,inter=25GB/s", "intra='0GB/s': a positive rate such as 25GB/s"),
        ("nodes=0,gpus=8,intra=300GB/s,inter=25GB/s", "nodes='0': a positive integer"),
        ("nodes=2,gpus=8,intra=300GB/s,inter=25GB/s,flops=nan", "flops='nan': a positive number"),
        ("nodes=2,gpus=8,intra=300GB/s,inter=25GB/s,memory=0", "memory='0': a memory budget must be"),
    ],
)
def test_plan_cluster_reads_bandwidths_with_their_unit_only(capfd, model_config, cluster, message):
    argv = ["plan", "--cluster", cluster, "--model", model_config, "--tokens-per-step", "131072"]
    assert message in one_line_error(capfd, *argv)


def test_plan_cluster_draws_the_best_layout(capsys, model_config, tmp_path):
    picture = tmp_path / "best.svg"
    argv = ["plan", "--cluster", CLUSTER, "--model", model_config, "--tokens-per-step", "131072"]
    code = main([*argv, "--mesh", "pp=4,dp=2,tp=2", "-o", str(picture)])
    out = capsys.readouterr().out
    assert code == 0 and f"wrote {picture}" in out
    assert "pp 4 × dp 2 (fsdp) × tp 2: zb-" in picture.read_text()
    code = main([*argv, "--json", "-o", str(tmp_path / "best.png")])
    assert code == 0 and json.loads(capsys.readouterr().out)["layouts"]
    assert (tmp_path / "best.png").read_bytes().startswith(b"\x89PNG")


def test_an_output_that_cannot_be_written_is_one_line(capfd, model_config, tmp_path):
    missing = str(tmp_path / "no-such-folder" / "out")
    argv = ["plan", "--cluster", CLUSTER, "--model", model_config, "--tokens-per-step", "131072"]
    for command in (
        ["show", "-o", f"{missing}.svg"],
        ["export", "-o", f"{missing}.json"],
        [*argv, "-o", f"{missing}.svg"],
    ):
        assert f"cannot write '{missing}" in one_line_error(capfd, *command)
    assert "must end in .svg or .png" in one_line_error(capfd, *argv, "-o", str(tmp_path / "plan.txt"))


def test_the_api_refuses_what_the_command_line_refuses():
    from zerobubble.schedule import CostModel, ScheduleError
    from zerobubble.schedule.compare import compare_schedules
    from zerobubble.schedule.modelplan.cluster import Cluster, TransformerShape, plan_cluster

    with pytest.raises(ScheduleError, match="microbatches must be a positive integer, got -32"):
        compare_schedules(4, -32, CostModel())
    with pytest.raises(ScheduleError, match="chunks must be a positive integer, got 0"):
        compare_schedules(4, 8, CostModel(), chunks=0)
    with pytest.raises(ScheduleError, match="step time must be finite and at least 0, got -1"):
        compare_schedules(4, 8, CostModel(), step_time=-1.0)
    shape = TransformerShape(
        layers=2, hidden=64, intermediate=256, heads=4, kv_heads=4, vocab=64, gated=False
    )
    cluster = Cluster.parse(CLUSTER)
    for sizes, name in (((4096, 0), "seq_len"), ((-5, 4096), "tokens_per_step")):
        with pytest.raises(ScheduleError, match=f"{name} must be a positive integer"):
            plan_cluster(shape, cluster, *sizes)
    with pytest.raises(ScheduleError, match="microbatch_size must be a positive integer"):
        plan_cluster(shape, cluster, 4096, 1024, microbatch_size=0)
    with pytest.raises(ScheduleError, match="a bandwidth needs a rate unit"):
        Cluster.parse("nodes=1,gpus=8,intra=300GB,inter=25GB/s")


@pytest.mark.parametrize("timeout", [-1, 0, math.nan, math.inf, True, "60"])
def test_a_pipeline_refuses_a_timeout_that_is_not_a_positive_number(timeout):
    """Checked before the process group is joined: every rank raises it, alone."""
    from torch import nn

    from zerobubble.runtime import Pipeline, PipelineError

    with pytest.raises(PipelineError, match="timeout must be a positive number of seconds"):
        Pipeline([nn.Linear(2, 2), nn.Linear(2, 2)], timeout=timeout)


def test_under_torchrun_the_mesh_and_ranks_must_be_its_world(capfd, no_ranks, monkeypatch):
    from zerobubble_demo.train import TrainConfig, launched_config

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    err = one_line_error(capfd, "train", "--mesh", "pp=2,dp=2")
    assert "torchrun started 2 processes (WORLD_SIZE=2) but the mesh 'pp=2,dp=2' has 4 ranks" in err
    err = one_line_error(capfd, "train", "--ranks", "4")
    assert "torchrun started 2 processes (WORLD_SIZE=2) but ranks=4" in err
    assert launched_config(TrainConfig()).ranks == 2
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launched_config(TrainConfig(data_parallel=2)).pipeline_ranks == 2


@pytest.mark.slow
def test_torchrun_with_a_mesh_larger_than_its_world_says_so():
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "zerobubble"]
    result = subprocess.run(
        [*command, "train", "--mesh", "pp=2,dp=2", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode != 0
    message = "zerobubble: error: torchrun started 2 processes (WORLD_SIZE=2) but the mesh 'pp=2,dp=2'"
    assert message in result.stdout + result.stderr
    assert "Mesh should not be bigger" not in result.stdout + result.stderr


@pytest.mark.multiprocess
def test_auto_that_fits_nothing_is_one_line_not_each_ranks_traceback(capfd):
    err = one_line_error(
        capfd, "train", *TINY.split(), "--no-progress", "--steps", "1", "--schedule", "auto",
        "--memory-limit", "1KiB",
    )  # fmt: skip
    assert 'schedule="auto" cannot run: no schedule fits the memory budget of 1.00 KiB per rank' in err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A checkpoint of the tiny run after one step (``train --save``)."""
    saved = tmp_path_factory.mktemp("saved") / "ckpt"
    assert main(["train", *TINY.split(), "--no-progress", "--steps", "1", "--save", str(saved)]) == 0
    return saved


def damaged_copy(checkpoint: Path, tmp_path: Path, name: str, damage) -> Path:
    """A copy of the checkpoint with ``damage(bytes) -> bytes`` done to its file ``name``."""
    copy = tmp_path / "damaged"
    copy.mkdir()
    for path in checkpoint.iterdir():
        data = path.read_bytes()
        (copy / path.name).write_bytes(damage(data) if path.name == name else data)
    return copy


def resume(capfd, directory: Path, *flags: str) -> str:
    return one_line_error(
        capfd, "train", *TINY.split(), "--no-progress", "--steps", "1", "--resume", str(directory), *flags
    )


def largest_data_file(checkpoint: Path) -> str:
    return max(
        (p for p in checkpoint.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size
    ).name


@pytest.mark.multiprocess
def test_resume_names_a_truncated_data_file(capfd, checkpoint, tmp_path, no_ranks):
    name = largest_data_file(checkpoint)
    copy = damaged_copy(checkpoint, tmp_path, name, lambda data: data[: len(data) // 2])
    err = resume(capfd, copy)
    assert f"the data file {copy / name} is truncated" in err and "write the checkpoint again" in err


@pytest.mark.multiprocess
def test_resume_names_a_data_file_damaged_inside(capfd, checkpoint, tmp_path):
    """Its length intact, only the ranks' read finds it: every rank says the same one line."""
    name = largest_data_file(checkpoint)
    copy = damaged_copy(
        checkpoint, tmp_path, name, lambda data: data[:100] + b"\x00" * (len(data) - 200) + data[-100:]
    )
    err = resume(capfd, copy)
    assert f"the data file {copy / name} is corrupt: its entry " in err and "does not read" in err


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "damage",
    [lambda data: data[: len(data) // 3], lambda data: b"\x80\x05garbage" + data[9:]],
    ids=["truncated", "garbled"],
)
def test_resume_names_a_damaged_index(capfd, checkpoint, tmp_path, no_ranks, damage):
    copy = damaged_copy(checkpoint, tmp_path, ".metadata", damage)
    err = resume(capfd, copy)
    assert f"cannot read the checkpoint's index {copy / '.metadata'}" in err and "truncated or corrupt" in err


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--dim", "32"],
            "parameter 0.tokens.weight is [16, 16] in the checkpoint but [16, 32] in the model",
        ),
        (
            ["--vocab", "32"],
            "parameter 0.tokens.weight is [16, 16] in the checkpoint but [32, 16] in the model",
        ),
        (
            ["--seq-len", "4"],
            "parameter 0.positions.weight is [8, 16] in the checkpoint but [4, 16] in the model",
        ),
        (["--layers", "3"], "the checkpoint holds 2 blocks but the model has 3 (--layers 3)"),
    ],
)
def test_resume_names_the_parameter_and_both_shapes_of_another_model(
    capfd, checkpoint, no_ranks, flags, message
):
    assert message in resume(capfd, checkpoint, *flags)


def test_resume_says_which_side_keeps_q_k_v_apart(checkpoint):
    """A checkpoint without tp (q, k, v fused) and a model with a tp mesh dimension (apart)."""
    from zerobubble_demo import ConfigError
    from zerobubble_demo.checkpoint import check_checkpoint
    from zerobubble_demo.models import GPTConfig

    apart = GPTConfig(vocab=16, seq_len=8, dim=16, heads=2, n_layers=2, fused_qkv=False)
    with pytest.raises(ConfigError, match=r"fuses q, k and v \(1\.qkv\.weight\).*resume without tp"):
        check_checkpoint(str(checkpoint), apart)
    check_checkpoint(str(checkpoint), GPTConfig(vocab=16, seq_len=8, dim=16, heads=2, n_layers=2))


def test_a_rank_failure_stands_for_one_error_only_when_every_rank_refused():
    from zerobubble.runtime import PipelineError
    from zerobubble.runtime.failures import PeerFailure
    from zerobubble.runtime.launch import RankFailure

    kinds = (PipelineError,)
    first, peer = PipelineError("no schedule fits"), PeerFailure("rank 0 stopped because rank 1 failed")
    assert RankFailure("", errors={0: first, 1: PipelineError("other")}).common_error(kinds) is first
    assert RankFailure("", errors={0: peer, 1: first}).common_error(kinds) is first
    assert RankFailure("", errors={0: first, 1: None}).common_error(kinds) is None  # a rank died
    assert RankFailure("", errors={0: first, 1: ValueError("bug")}).common_error(kinds) is None
    assert RankFailure("", errors={}).common_error(kinds) is None
