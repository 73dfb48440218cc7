"""Pipeline(schedule="auto") on 2 ranks: one plan everywhere, exact gradients, errors before allocating,
and a calibration from the recorded second step that every rank agrees on."""

from __future__ import annotations

import dataclasses

import pytest
from _auto_worker import auto_cases
from _dist import run_ranks

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def results():
    return run_ranks(auto_cases, 2)


def test_every_rank_runs_the_same_plan(results):
    first, second = results
    assert first["schedule"] == second["schedule"] == first["plan_schedule"]
    assert first["partition"] == second["partition"]
    assert first["layers"] == second["layers"] == 8
    assert first["schedule"] in first["reason"]


def test_gradients_equal_one_process_from_the_first_step(results):
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert len(losses) == 1 and losses[0] < 1e-5
    names = [name for r in results for name in r["grads"]]
    assert len(names) == len(set(names)) > 0  # every parameter lives on exactly one rank
    for r in results:
        for name, error in r["grads"].items():
            assert error < 1e-5, name


def test_recorded_steps_calibrate_the_plan_on_every_rank_alike(results):
    first, second = results
    assert not first["calibrated_after_first_step"]  # the first step is not recorded
    calibration = first["calibration"]
    assert calibration is not None and calibration == second["calibration"]
    assert calibration["steps"] == 1 and calibration["predicted_iteration_time"] > 0
    stages = len(first["partition"]) + 1
    assert all(len(values) == stages for values in calibration["measured_seconds"].values())
    assert max(calibration["measured_seconds"]["f"]) > 0
    # the re-plan searches partitions afresh and may find none as good as the running one: it then
    # keeps the running plan; it proposes another only when that is predicted faster
    replanned = calibration["replan"]["predicted_iteration_time"]
    assert calibration["keeps_plan"] or replanned < calibration["predicted_iteration_time"]
    for r in results:
        assert r["recorder_detached"] and r["schedule_after_calibration"] == r["schedule"]


def test_gradients_stay_exact_after_calibration(results):
    losses = [r["loss_after_calibration"] for r in results if r["loss_after_calibration"] is not None]
    assert len(losses) == 1 and losses[0] < 1e-5
    for r in results:
        assert set(r["grads_after_calibration"]) == set(r["grads"])
        for name, error in r["grads_after_calibration"].items():
            assert error < 1e-5, name


def test_a_named_schedule_cut_where_the_profile_says(results):
    profiled = [result["profiled"] for result in results]
    assert all(p["schedule"] == "zb-v" and p["candidates"] == ["zb-v"] for p in profiled)
    cuts = [(p["partition"], p["bounds"]) for p in profiled]
    assert cuts[0] == cuts[1] and cuts[0][0] == cuts[0][1]  # the plan's cut, on every rank
    assert sum(p["loss"] is not None for p in profiled) == 1  # the rank holding the last stage
    for p in profiled:
        assert p["loss"] is None or p["loss"] < 1e-5
        assert p["grads"] and max(p["grads"].values()) < 1e-5


def test_partition_profile_needs_a_schedule_name(results):
    for result in results:
        assert "partition='even'" in result["partition_word"] and '"profile"' in result["partition_word"]
        assert 'schedule="auto" always chooses its partition' in result["profile_with_auto"]


def test_budget_too_small_is_refused_on_every_rank(results):
    for r in results:
        assert "no schedule fits the memory budget of 2.00 KiB" in r["too_small"]
        assert "rank" in r["too_small"] and "against the budget of 2048 bytes" in r["too_small"]


def test_auto_needs_an_example_batch(results):
    for r in results:
        assert "pass example=(inputs, targets)" in r["no_example"]


def test_train_auto_then_replan_from_its_trace(tmp_path, capsys):
    import json

    from zerobubble.cli import main
    from zerobubble_demo.train import run_training

    summary = run_training(_tiny_config(schedule="auto", memory_limit="1GiB", steps=4, trace=str(tmp_path)))
    assert summary.schedule != "auto" and len(summary.losses) == 4
    assert any(line.startswith("auto plan: ") for line in summary.lines())
    # steps 2 to 4 were recorded (by the trace's own recorder) and calibrated the plan
    assert any(line.startswith("auto plan calibrated on 3 recorded steps") for line in summary.lines())
    recorded = json.loads((tmp_path / "summary.json").read_text())
    assert recorded["layer_profile"] is not None and recorded["layer_bounds"][-1] == 4
    assert main(["plan", "--trace", str(tmp_path), "--ranks", "2", "-m", "4", "--json"]) == 0
    replanned = json.loads(capsys.readouterr().out)
    assert replanned["predicted_iteration_time"] > 0 and len(replanned["peak_bytes"]) == 2
    assert min(replanned["peak_bytes"]) > 0 and replanned["bytes_known"]  # the recorded profile's bytes


def test_train_cuts_a_named_schedule_where_the_profile_says():
    from zerobubble_demo.train import run_training

    summary = run_training(_tiny_config(schedule="zb-v", partition="profile", steps=2))
    assert summary.schedule == "zb-v" and len(summary.losses) == 2
    assert any(line.startswith("auto plan: zb-v (v=2) with partition [") for line in summary.lines())


def test_ranks_profile_in_turns_when_they_outnumber_the_cores(monkeypatch):
    import os

    import torch

    from zerobubble.runtime.construct.auto import profiling_turns

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    cpu = torch.device("cpu")
    assert profiling_turns(2, cpu) == 1
    assert profiling_turns(4, cpu) == 2
    assert profiling_turns(3, cpu) == 2
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert profiling_turns(2, cpu) == 2  # two ranks of two threads each on two cores
    assert profiling_turns(4, torch.device("cuda", 0)) == 1  # a device per rank


def _tiny_config(**settings):
    """A TrainConfig of the built-in GPT small enough for a test: 2 ranks, 4 microbatches."""
    from zerobubble_demo.train import TrainConfig

    tiny = TrainConfig(ranks=2, microbatches=4, batch_size=8, seq_len=8, vocab=16, dim=16, heads=2, layers=2)
    return dataclasses.replace(tiny, progress=False, timeout=60, **settings)


@pytest.mark.parametrize("turns, evicted", [(1, 0), (2, 64 * 2**20)])
def test_the_profile_evicts_the_caches_only_when_ranks_take_turns_on_a_core(
    monkeypatch, tmp_path, turns, evicted
):
    import torch
    import torch.distributed as dist
    from torch import nn

    from zerobubble.runtime.construct import auto

    asked: list[int] = []
    real_profile = auto.profile_layers

    def profile_layers(named, inputs, targets, loss_fn, device, repeats, comm, evict_bytes, kwargs):
        asked.append(evict_bytes)
        return real_profile(named, inputs, targets, loss_fn, device, repeats=1, comm=comm, kwargs=kwargs)

    monkeypatch.setattr(auto, "profiling_turns", lambda world, device: turns)
    monkeypatch.setattr(auto, "profile_layers", profile_layers)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        layers = [("a", nn.Linear(4, 4)), ("b", nn.Linear(4, 4))]
        example = (torch.randn(4, 4), torch.randn(4, 4))
        cpu = torch.device("cpu")
        planning = auto.Planning(ranks=1, microbatches=2, post_validation=False)
        auto.plan_for_pipeline(layers, example, nn.functional.mse_loss, None, cpu, planning)
    finally:
        dist.destroy_process_group()
    assert asked == [evicted]
