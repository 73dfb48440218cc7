"""The B/W split and the executor on each device: the CPU always, a CUDA GPU where one is present.

The CUDA cases are skipped without a GPU; ``benchmarks/device_check.sh`` runs them on a lent one,
with ``tests/bench/test_bench_wgrad.py`` (``bench wgrad`` on each device), ``bench wgrad --device
cuda`` and a traced training run.  The CPU cases run the same code, so
the checks themselves are exercised on every machine, CI included.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _dist import LocalComm
from torch import nn
from torch.nn import functional as F

from zerobubble.runtime.execute.executor import Executor, StageState
from zerobubble.runtime.observe.trace import TraceRecorder
from zerobubble.runtime.wgrad import FastPaths, WeightGradStore, install_deferral
from zerobubble.schedule import build_schedule
from zerobubble_demo.split_models import SPLIT_MODELS, split_model

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
MICROBATCHES = 4


@pytest.fixture(autouse=True)
def _float32_products_in_float32():
    """TF32 would round the split's products and the reference's apart on a GPU."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _tolerance(device: str) -> dict[str, float]:
    # a GPU's reductions may sum in another order than the reference's, run to run
    return {"rtol": 1e-4, "atol": 1e-6} if device == "cuda" else {"rtol": 1e-5, "atol": 1e-7}


def _through(layers: list[nn.Module], values):
    for layer in layers:
        values = layer(*values) if isinstance(values, tuple) else layer(values)
    return values


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", SPLIT_MODELS)
@pytest.mark.parametrize("split", ["fast paths", "generic only"])
def test_split_models_on_the_device_end_as_plain_autograd(device, name, split):
    """Every parameter gradient and floating buffer after B then W (even microbatches) or a fused
    BW (odd ones) equals one plain backward per microbatch, nothing reaches ``.grad`` in a B."""
    model = split_model(name, batch=2 * MICROBATCHES)
    reference = [layer.to(device) for layer in model.layers]
    layers = [layer.to(device) for layer in split_model(name, batch=2 * MICROBATCHES).layers]
    store = WeightGradStore()
    install_deferral(layers, store, None if split == "fast paths" else FastPaths())
    batches = zip(model.inputs.to(device).chunk(MICROBATCHES), model.targets.to(device).chunk(MICROBATCHES))
    for j, (inputs, targets) in enumerate(batches):
        (model.loss_fn(_through(reference, inputs), targets) / MICROBATCHES).backward()
        loss = model.loss_fn(_through(layers, inputs), targets) / MICROBATCHES
        deferred = j % 2 == 0
        before = _grads(layers)
        store.begin((0, j), deferred)
        loss.backward()
        store.end()
        if deferred:
            after = _grads(layers)
            changed = [name for name, grad in after.items() if not _same(grad, before[name])]
            assert changed == [], f"B changed .grad of {changed}"
            store.flush((0, j))
    assert store.pending_keys() == []
    expected, actual = nn.Sequential(*reference), nn.Sequential(*layers)
    grads = dict(expected.named_parameters())
    for param_name, param in actual.named_parameters():
        torch.testing.assert_close(param.grad, grads[param_name].grad, msg=param_name, **_tolerance(device))
    buffers = dict(expected.named_buffers())
    for buffer_name, buffer in actual.named_buffers():
        if buffer.is_floating_point():
            torch.testing.assert_close(buffer, buffers[buffer_name], msg=buffer_name, **_tolerance(device))


def _grads(layers: list[nn.Module]) -> dict[str, torch.Tensor | None]:
    """A copy of every parameter's ``.grad``, by name."""
    named = nn.Sequential(*layers).named_parameters()
    return {name: None if p.grad is None else p.grad.clone() for name, p in named}


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


@pytest.mark.parametrize("device", DEVICES)
def test_two_chunks_on_one_rank_on_the_device_equal_one_process_and_are_traced(device):
    """zb-v's two chunks on one rank (local hand-overs, the B/W split, dropout's per-forward seeds
    on the device's generator) against one process; the trace recorder times every op, with CUDA
    events on a GPU."""
    torch.manual_seed(0)
    chunks = [
        nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.0), nn.LayerNorm(16)).to(device),
        nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4)).to(device),
    ]
    reference = copy.deepcopy(chunks)
    stages = {}
    for index, chunk in enumerate(chunks):
        store = WeightGradStore()
        install_deferral([chunk], store)
        stages[index] = StageState(index, chunk, store, index == 0, index == 1, f"chunk {index}")
    schedule = build_schedule("zb-v", 1, MICROBATCHES)
    executor = Executor(schedule, 0, stages, LocalComm(device), F.mse_loss)  # type: ignore[arg-type]
    recorder = TraceRecorder(device)
    executor.recorder = recorder
    generator = torch.Generator().manual_seed(1)
    inputs = [(torch.randn(3, 8, generator=generator).to(device),) for _ in range(MICROBATCHES)]
    targets = [torch.randn(3, 4, generator=generator).to(device) for _ in range(MICROBATCHES)]

    losses = executor.run_step(inputs, targets)

    expected_losses = [F.mse_loss(_through(reference, x), y) for (x,), y in zip(inputs, targets)]
    (sum(expected_losses) / MICROBATCHES).backward()
    tolerance = _tolerance(device)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected_losses).detach(), **tolerance)
    for chunk, expected in zip(chunks, reference):
        for (name, param), (_, reference_param) in zip(chunk.named_parameters(), expected.named_parameters()):
            torch.testing.assert_close(param.grad, reference_param.grad, msg=name, **tolerance)
    ops, _, _ = recorder.seconds()[-1]
    assert len(ops) == len(schedule.programs[0])
    assert all(end >= start for start, end in ops)
    starts = [start for start, _ in ops]
    assert starts == sorted(starts), "ops recorded out of program order"
