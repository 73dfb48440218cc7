"""The benchmark helpers leave the caller's process as they found it (RNG state, thread count)."""

import pytest
import torch

from zerobubble_bench.memory import AllocationMeter, dropout_blocks, mlp_blocks
from zerobubble_bench.tables import preserved_torch_state
from zerobubble_bench.wgrad import wgrad_split_cost
from zerobubble_bench.workloads import mlp_layers, uneven_lm_workload, workload
from zerobubble_demo.split_models import split_model


@pytest.mark.parametrize(
    "build",
    [
        lambda: mlp_layers(2, 8, seed=3),
        lambda: workload("gpt", 2, 1).make_layers(),
        lambda: uneven_lm_workload(2, 1).make_layers(),
        lambda: split_model("convnet", width=4, batch=2, seq=4),
        lambda: mlp_blocks(5),
        lambda: dropout_blocks(5),
    ],
)
def test_building_a_benchmark_model_keeps_the_global_rng(build):
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build()
    assert torch.equal(torch.rand(4), expected)


def test_seeded_builds_are_still_reproducible():
    first, second = mlp_layers(1, 4, seed=9), mlp_layers(1, 4, seed=9)
    assert torch.equal(first[0][0].weight, second[0][0].weight)


def test_wgrad_benchmark_restores_the_thread_count():
    before = torch.get_num_threads()
    wanted = 2 if before != 2 else 1
    table = wgrad_split_cost((4,), repeats=1, threads=wanted, modes=("fast paths",), stages=("mlp", "mha"))
    assert torch.get_num_threads() == before
    assert [row[0][:3] for row in table.rows] == ["MLP", "Mul"]  # the stages asked for, in table order
    assert "glibc" not in table.notes[0]  # no allocator tuning unless asked


def test_preserved_torch_state_restores_after_an_error():
    threads, state = torch.get_num_threads(), torch.random.get_rng_state()
    with pytest.raises(RuntimeError), preserved_torch_state():
        torch.set_num_threads(threads + 1)
        torch.manual_seed(0)
        raise RuntimeError("the benchmark failed")
    assert torch.get_num_threads() == threads and torch.equal(torch.random.get_rng_state(), state)


def test_plan_table_pairs_each_configuration_with_auto_round_by_round():
    from zerobubble_bench.plan import _plan_table

    result = {
        "times": {
            "auto (zb-h1, cuts [1])": [1.0, 1.0, 2.0, 2.0],
            "zb-v, even split [1]": [1.5, 1.5, 2.2, 2.2],
        },
        "steps_per_round": 2,
        "predicted": {"profile": {}, "calibrated": {}},
        "reason": "a reason",
        "calibration": "a calibration",
    }
    table = _plan_table("LM", 2, 8, 2, result)
    column = table.columns.index("× auto, paired by round (min–max)")
    rows = {row[0]: row for row in table.rows}
    # rounds: auto 1.0 then 2.0, zb-v 1.5 then 2.2 -> 1.5 and 1.1, median 1.3
    assert rows["zb-v, even split [1]"][column] == "1.300 (1.100–1.500)"
    assert rows["auto (zb-h1, cuts [1])"][column] == "1.000 (1.000–1.000)"
    assert rows["zb-v, even split [1]"][2] == "1.233"  # medians over all steps, unpaired: 1.85 / 1.5


def test_interleaved_rounds_time_only_the_steps_after_each_settle_step(monkeypatch):
    from zerobubble_bench import workloads

    clock = [0.0]
    calls = {"a": 0, "b": 0}

    def runner(name):
        def step():
            calls[name] += 1
            clock[0] += calls[name]  # the n-th call of a configuration lasts n

        return step

    monkeypatch.setattr(workloads.dist, "barrier", lambda: None)
    monkeypatch.setattr(workloads.time, "perf_counter", lambda: clock[0])
    times = workloads.interleaved({"a": runner("a"), "b": runner("b")}, rounds=2, steps=2, warmup=1, settle=1)
    # call 1 warms up; each round settles with one call, then times two: calls 3, 4 and 6, 7
    assert times == {"a": [3, 4, 6, 7], "b": [3, 4, 6, 7]}
    assert calls == {"a": 7, "b": 7}
    calls.update(a=0, b=0)
    unsettled = workloads.interleaved({"a": runner("a")}, rounds=2, steps=2, warmup=1, settle=0)
    assert unsettled == {"a": [2, 3, 4, 5]}


def test_the_cli_offers_every_bench_wgrad_stage_and_model():
    import argparse

    from zerobubble.cli import build_parser
    from zerobubble_bench.wgrad import SPLIT_STAGES
    from zerobubble_demo.split_models import REFERENCE_MODELS, SPLIT_MODELS

    def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return action.choices[name]

    wgrad = subparser(subparser(build_parser(), "bench"), "wgrad")
    choices = {action.dest: action.choices for action in wgrad._actions}
    assert list(choices["models"]) == [*SPLIT_MODELS, *REFERENCE_MODELS]
    assert list(choices["stages"]) == list(SPLIT_STAGES)


def test_the_allocation_meter_counts_live_storages_and_files_them_by_holder():
    outside = torch.ones(1000)  # allocated before: not counted, nor is a view of an excluded tensor
    excluded = torch.ones(100)
    held: list[torch.Tensor] = []
    meter = AllocationMeter(
        [excluded], classify=lambda: {"held": {t.untyped_storage().data_ptr() for t in held}}
    )
    with meter:
        held.append(torch.zeros(1000))  # 4000 bytes
        extra = torch.zeros(2000)  # 8000 more: the peak, 12000
        excluded.view(10, 10).add_(1)
        del extra
        torch.zeros(500)  # 2000, freed at once
        outside.view(10, 100).mul(1)  # 4000, freed at once
    assert meter.peak == 12000
    assert meter.where == {"held": 4000, "other": 8000}
