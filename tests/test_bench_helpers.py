"""The benchmark helpers leave the caller's process as they found it (RNG state, thread count)."""

import pytest
import torch

from zerobubble_bench.memory import mlp_blocks
from zerobubble_bench.split_models import split_model
from zerobubble_bench.tables import preserved_torch_state
from zerobubble_bench.wgrad import wgrad_split_cost
from zerobubble_bench.workloads import mlp_layers, uneven_lm_workload, workload


@pytest.mark.parametrize(
    "build",
    [
        lambda: mlp_layers(2, 8, seed=3),
        lambda: workload("gpt", 2, 1).make_layers(),
        lambda: uneven_lm_workload(2, 1).make_layers(),
        lambda: split_model("convnet", width=4, batch=2, seq=4),
        lambda: mlp_blocks(5),
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
    table = wgrad_split_cost((4,), repeats=1, threads=wanted, modes=("fast paths",))
    assert torch.get_num_threads() == before
    assert len(table.rows) == 3 and "glibc" not in table.notes[0]  # no allocator tuning unless asked


def test_preserved_torch_state_restores_after_an_error():
    threads, state = torch.get_num_threads(), torch.random.get_rng_state()
    with pytest.raises(RuntimeError), preserved_torch_state():
        torch.set_num_threads(threads + 1)
        torch.manual_seed(0)
        raise RuntimeError("the benchmark failed")
    assert torch.get_num_threads() == threads and torch.equal(torch.random.get_rng_state(), state)
