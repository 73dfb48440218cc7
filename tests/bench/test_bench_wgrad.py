"""``zerobubble bench wgrad``: its table on each device (the CPU always, a CUDA GPU where one is
present: ``benchmarks/device_check.sh`` runs this file on a lent one), every split it measures, and
its error for a GPU that is not there."""

from __future__ import annotations

import pytest
import torch

from zerobubble_bench.wgrad import wgrad_split_cost

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


@pytest.mark.parametrize("device", DEVICES)
def test_bench_wgrad_measures_on_the_device(device):
    table = wgrad_split_cost(
        (8,), repeats=1, device=device, modes=("fast paths", "generic only"), stages=("gpt", "conv")
    )
    ratios = [float(row[-1]) for row in table.rows]
    assert len(ratios) == 4
    assert all(0 < ratio < 100 for ratio in ratios)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where there is no GPU")
def test_bench_wgrad_on_cuda_without_a_gpu_is_a_clear_error(capsys):
    from zerobubble.cli import main

    assert main(["bench", "wgrad", "--device", "cuda", "--rows", "8", "--repeats", "1"]) == 2
    assert "--device cuda needs a CUDA GPU" in capsys.readouterr().err


def test_bench_wgrad_measures_every_split():
    threads = torch.get_num_threads()
    try:
        table = wgrad_split_cost([4], repeats=1)
    finally:
        torch.set_num_threads(threads)
    assert [(row[0][:3], row[1]) for row in table.rows] == [
        (stage, split)
        for stage in ("MLP", "GPT", "2×(", "Mul", "raw")
        for split in ("fast paths", "generic only", "torch pipelining")
    ]
    assert all(float(row[-1]) > 0 for row in table.rows)
