"""`zerobubble plan` and `zerobubble profile`, profiling one process, and re-planning from a trace."""

from __future__ import annotations

import json

import pytest
import torch
from _model_profiles import MiB, lm_profile
from torch import nn

from zerobubble.cli import main
from zerobubble.runtime.construct.profile import profile_layers
from zerobubble.schedule import ScheduleError
from zerobubble.schedule.modelplan import LayerProfile, ModelProfile, plan, profile_from_trace
from zerobubble.schedule.modelplan.cluster import CALIBRATED_EFFICIENCY


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def profile_file(tmp_path):
    path = tmp_path / "profile.json"
    lm_profile().save(path)
    return str(path)


def test_plan_json_has_the_chosen_setup(capsys, profile_file, tmp_path):
    picture = tmp_path / "plan.svg"
    code, out, _ = run(
        capsys,
        "plan",
        "--profile",
        profile_file,
        "--ranks",
        "2",
        "--memory-limit",
        "24GiB",
        "--json",
        "-o",
        str(picture),
    )
    assert code == 0
    data = json.loads(out)
    for key in ("schedule", "chunks", "partition", "predicted_iteration_time", "peak_bytes"):
        assert key in data
    assert len(data["peak_bytes"]) == 2 and max(data["peak_bytes"]) <= 24 * 2**30
    expected = plan(lm_profile(), 2, 8, "24GiB")
    assert data["schedule"] == expected.winner.schedule and data["partition"] == list(expected.partition)
    assert picture.stat().st_size > 0


def test_plan_table_names_the_winner(capsys, profile_file):
    code, out, _ = run(capsys, "plan", "--profile", profile_file, "--ranks", "2")
    assert code == 0
    winner = plan(lm_profile(), 2, 8).winner.schedule
    assert f"* {winner}" in out and f"chosen: {winner}" in out


def test_plan_on_a_mesh_says_the_memory_per_rank(capsys, profile_file):
    code, out, _ = run(
        capsys, "plan", "--profile", profile_file, "--mesh", "pp=2,dp=2,tp=2", "--data-parallel", "fsdp"
    )
    assert code == 0 and "on dp 2 (FSDP2) × tp 2 the busiest rank holds" in out


def test_plan_of_a_cluster_on_paper(capsys, tmp_path):
    config = tmp_path / "config.json"
    sizes = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8}
    sizes["num_attention_heads"] = 16
    config.write_text(json.dumps({"model_type": "llama", "vocab_size": 32000, **sizes}))
    cluster = "nodes=2,gpus=8,intra=300GB/s,inter=25GB/s"
    argv = ["plan", "--cluster", cluster, "--model", str(config), "--tokens-per-step", str(64 * 2048)]
    code, out, _ = run(capsys, *argv, "--seq-len", "2048")
    assert code == 0 and "on 16 GPUs" in out and "best: pp " in out and "tok/s/GPU" in out
    code, out, _ = run(capsys, *argv, "--seq-len", "2048", "--mesh", "pp=2,dp=4,tp=2", "--json")
    (row,) = json.loads(out)["layouts"]
    assert code == 0 and (row["pp"], row["dp"], row["tp"], row["sharding"]) == (2, 4, 2, "fsdp")
    assert (
        json.loads(out)["cluster"]["efficiency"] == CALIBRATED_EFFICIENCY
    )  # the assumptions, in the JSON too
    code, _, err = run(capsys, "plan", "--cluster", cluster)
    assert code == 2 and "--cluster needs --model" in err
    code, _, err = run(capsys, *argv, "--data-parallel", "hsdp")  # not silently planned as fsdp
    assert code == 2 and "--cluster plans data parallelism replicated or with FSDP2" in err


def test_plan_of_a_cluster_prints_what_it_assumed(capsys, tmp_path):
    config = tmp_path / "config.json"
    sizes = {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "vocab_size": 1000}
    config.write_text(json.dumps(sizes))
    argv = ["plan", "--model", str(config), "--tokens-per-step", str(16 * 1024), "--seq-len", "1024"]
    code, out, _ = run(capsys, *argv, "--cluster", "nodes=2,gpus=4,intra=300GB/s,inter=25GB/s")
    assert code == 0
    assert (
        f"assumed per GPU: 312 TFLOP/s peak (default) × matmul efficiency {CALIBRATED_EFFICIENCY:g} "
        f"(default) = {312 * CALIBRATED_EFFICIENCY:g} TFLOP/s for a large product; 2039 GB/s of memory "
        "bandwidth (default), 108 multiprocessors (default); 80.00 GiB of memory (default)\n"
        "assumed links: 300 GB/s a GPU within a node of 4, 25 GB/s a GPU between the 2 nodes; "
        "10 µs a message (default)\n"
    ) in out
    given = "nodes=2,gpus=4,intra=100GB/s,inter=10GB/s,flops=989e12,memory=94GiB,efficiency=0.4,latency=2e-5,"
    given += "hbm=3350GB/s,sms=132"
    code, out, _ = run(capsys, *argv, "--cluster", given)
    assert code == 0 and "(default)" not in out
    assert "989 TFLOP/s peak × matmul efficiency 0.4 = 395.6 TFLOP/s for a large product" in out
    assert "94.00 GiB of memory\n" in out
    assert "100 GB/s a GPU within a node of 4, 10 GB/s a GPU between the 2 nodes; 20 µs a message" in out


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (("--memory-limit", "1KiB"), "against the budget of 1024 bytes"),
        (("--memory-limit", "lots"), "cannot read memory budget"),
        ((), "give exactly one of --profile"),
    ],
)
def test_plan_errors_are_one_line(capsys, profile_file, extra, fragment):
    argv = ["plan", *extra] + (["--profile", profile_file] if extra else [])
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert fragment in err and len(err.strip().splitlines()) == 1


# -- profiling ---------------------------------------------------------------------------------------


def test_profile_layers_measures_the_split_and_leaves_the_model_alone():
    torch.manual_seed(0)
    layers = [nn.Linear(16, 32), nn.ReLU(), nn.LayerNorm(32), nn.Linear(32, 4)]
    inputs, targets = torch.randn(8, 16), torch.randn(8, 4)
    state = torch.random.get_rng_state()
    profile = profile_layers(layers, inputs, targets, nn.functional.mse_loss, repeats=3)
    assert [layer.name for layer in profile.layers] == ["0", "1", "2", "3"]
    linear, relu, norm, head = profile.layers
    assert relu.backward_weight == 0.0 and relu.weight_input_bytes == 0.0 and relu.static_bytes == 0.0
    # LayerNorm's parameter gradients come from B's kernel and wait for W: W keeps just those
    assert norm.weight_input_bytes == 2 * 32 * 4
    assert linear.weight_input_bytes >= 8 * 16 * 4  # W keeps the input (and the output gradient)
    assert linear.backward_weight > 0.0 and head.backward_weight > 0.0
    assert linear.backward_fused > 0.0 and relu.backward_fused == 0.0  # no W: the fused backward is B
    assert linear.parameter_bytes == (16 * 32 + 32) * 4
    assert linear.static_bytes == 4 * linear.parameter_bytes  # parameters, gradients, Adam's two moments
    assert linear.output_bytes == 8 * 32 * 4 and head.output_bytes == 8 * 4 * 4
    assert all(layer.activation_bytes > 0 for layer in profile.layers)
    assert all(p.grad is None for layer in layers for p in layer.parameters())
    assert torch.equal(torch.random.get_rng_state(), state)
    assert profile.microbatch_size == 8


class _InputProbe(nn.Module):
    """A Linear that reports whether its input asks for a gradient (``report`` survives deepcopy)."""

    def __init__(self, report):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.report = report

    def forward(self, x):
        self.report(x.requires_grad)
        return self.fc(x)


def test_first_layer_is_profiled_as_the_first_stage_runs_it():
    """The first stage's B computes no gradient of the data: profiling one would overstate its T_B."""
    seen: dict[int, set[bool]] = {0: set(), 1: set()}
    layers = [_InputProbe(lambda flag, i=i: seen[i].add(flag)) for i in (0, 1)]
    profile_layers(layers, torch.randn(2, 4), torch.randn(2, 4), nn.functional.mse_loss, repeats=1)
    assert seen == {0: {False}, 1: {True}}


class _NeedsMask(nn.Module):
    """A Linear masked by its keyword ``attention_mask`` (no default), scaled by ``scale``; it reports
    what it was given (``report`` survives deepcopy)."""

    def __init__(self, report):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.report = report

    def forward(self, x, attention_mask, *, scale: float = 1.0):
        self.report(("mask", tuple(attention_mask.shape), scale))
        return self.fc(x) * attention_mask[:, None] * scale


class _TakesAll(nn.Module):
    def __init__(self, report):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.report = report

    def forward(self, x, **kwargs):
        self.report(("all", tuple(sorted(kwargs))))
        return self.fc(x)


def test_layers_are_profiled_with_the_keywords_a_stage_gives_them():
    """profile_layers(kwargs=) hands every forward (timed, warm-up, fused) of each layer the keywords
    its forward takes, as a stage does; a layer that needs one fails without."""
    from zerobubble.runtime.construct.staging import StageModule

    def layers(report):
        torch.manual_seed(0)
        return [_NeedsMask(report), nn.Linear(4, 4), _TakesAll(report)]  # nn.Linear takes none

    inputs, targets = torch.randn(2, 4), torch.randn(2, 4)
    kwargs = {"attention_mask": torch.tensor([1.0, 0.0]), "scale": 2.0}
    profiled: list = []
    profile_layers(layers(profiled.append), inputs, targets, nn.functional.mse_loss, repeats=1, kwargs=kwargs)
    staged: list = []
    StageModule(layers(staged.append))(inputs, **kwargs)
    assert set(profiled) == set(staged) == {("mask", (2,), 2.0), ("all", ("attention_mask", "scale"))}
    assert len(profiled) >= 4  # the warm-up and the timed forward of both layers, at least
    with pytest.raises(TypeError, match="attention_mask"):
        profile_layers(layers(profiled.append), inputs, targets, nn.functional.mse_loss, repeats=1)


def test_the_example_may_carry_the_steps_keyword_arguments():
    from zerobubble.runtime import PipelineError
    from zerobubble.runtime.construct.auto import example_parts

    mask = torch.ones(4, 3)
    assert example_parts((1, 2)) == (1, 2, {})
    assert example_parts([1, 2, {"attention_mask": mask}]) == (1, 2, {"attention_mask": mask})
    for example, words in [
        (None, "got NoneType"),
        ((1,), "got a 1-element tuple"),
        ((1, 2, mask), "got a third element that is a Tensor, not a dict"),
        ((1, 2, {}, 4), "got a 4-element tuple"),
    ]:
        with pytest.raises(PipelineError, match="example=\\(inputs, targets, \\{") as error:
            example_parts(example)
        assert words in str(error.value)


def test_caches_are_evicted_before_each_timed_piece_only():
    from zerobubble.runtime.construct.profile import CacheEvictor, split_backward
    from zerobubble.runtime.wgrad import WeightGradStore, install_deferral

    layer, store, calls = nn.Linear(4, 4), WeightGradStore(), []
    install_deferral([layer], store)
    out = layer(torch.randn(2, 4, requires_grad=True))
    b, w, kept = split_backward(layer, [out.sum()], None, store, evict=lambda: calls.append("evict"))
    assert calls == ["evict", "evict"] and b > 0 and w > 0 and kept > 0  # before B, before W
    assert layer.weight.grad is not None
    assert CacheEvictor(torch.device("cpu"), 0).buffer is None
    evictor = CacheEvictor(torch.device("cpu"), 1024)
    evictor()
    assert evictor.buffer is not None and evictor.buffer.numel() == 256 and bool((evictor.buffer == 1).all())
    with pytest.raises(ValueError, match="evict_bytes must be >= 0"):
        CacheEvictor(torch.device("cpu"), -1)


# -- re-planning from a trace ------------------------------------------------------------------------


def _summary(with_profile: bool) -> dict:
    profile = lm_profile()
    return {
        "costs_seconds": {"f": [0.02, 0.03], "b": [0.05, 0.06], "w": [0.0, 0.0]},  # fused BW recorded
        "layer_bounds": [0, 5, 8],
        "transfer_latency": 2e-4,
        "layer_profile": profile.to_dict() if with_profile else None,
    }


def test_trace_rescales_the_layer_profile_to_the_measured_stages():
    rebuilt = profile_from_trace(_summary(with_profile=True))
    original = lm_profile()
    assert len(rebuilt.layers) == 8 and rebuilt.comm_latency == 2e-4
    first, second = rebuilt.layers[:5], rebuilt.layers[5:]
    assert sum(layer.forward for layer in first) == pytest.approx(0.02)
    assert sum(layer.backward_input + layer.backward_weight for layer in second) == pytest.approx(0.06)
    # the fused backward is split as the profile splits it, and the layers keep their shares and bytes
    head = rebuilt.layers[7]
    assert head.backward_weight / head.backward_input == pytest.approx(
        original.layers[7].backward_weight / original.layers[7].backward_input
    )
    assert head.activation_bytes == original.layers[7].activation_bytes == 8 * MiB


def test_trace_without_a_profile_plans_per_stage(capsys, tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps(_summary(with_profile=False)))
    code, out, _ = run(capsys, "plan", "--trace", str(tmp_path), "--ranks", "2", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["partition"] == [1] and data["chunks"] == 1  # two recorded stages: one per rank
    stages = profile_from_trace(_summary(with_profile=False)).layers
    assert [layer.forward for layer in stages] == [0.02, 0.03]
    # times only: no bytes are reported (not "0 B"), and no alternative claims any
    assert data["bytes_known"] is False and data["peak_bytes"] is None
    assert all(row["peak_bytes"] is None for row in data["alternatives"])


def test_a_trace_of_times_reports_no_memory_and_refuses_a_budget(capsys, tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps(_summary(with_profile=False)))
    code, out, _ = run(capsys, "plan", "--trace", str(tmp_path), "--ranks", "2")
    assert code == 0 and " 0 B" not in out
    assert "peak memory not recorded (the profile holds times only)" in out  # the reason
    rows = [line for line in out.splitlines() if line[2:].startswith(("zb-", "1f1b", "gpipe"))]
    # two recorded stages: the V schedules need four; every other one is built, the memory-planned
    # ones on the run's own memory model (one unit a stage), and none claims a peak in bytes
    planned = [row for row in rows if "n/a: needs at least 4 layers" not in row]
    assert len(planned) == 7 and all("not recorded" in row for row in planned)
    code, _, err = run(capsys, "plan", "--trace", str(tmp_path), "--ranks", "2", "--memory-limit", "1GiB")
    assert code == 2 and "holds times but no bytes" in err and "memory budget cannot be checked" in err


def test_a_trace_with_its_layer_profile_reports_the_predicted_peak(capsys, tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps(_summary(with_profile=True)))
    code, out, _ = run(capsys, "plan", "--trace", str(tmp_path), "--ranks", "2", "--json")
    data = json.loads(out)
    assert code == 0 and data["bytes_known"] is True and min(data["peak_bytes"]) > 8 * MiB


def test_trace_that_is_not_a_summary_is_refused(tmp_path):
    with pytest.raises(ScheduleError, match="not a trace summary"):
        profile_from_trace({"measured": {}})
    assert isinstance(ModelProfile((LayerProfile("x", 1.0, 1.0, 0.0),)), ModelProfile)
