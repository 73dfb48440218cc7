"""FSDP2 units per layer (``fsdp=FSDPOptions(...)``): ZeRO-3 inside the pipeline, and without one.

One spawn of 4 gloo ranks runs every case, each against one process training the whole model on the
whole batch (float64, 3 clipped AdamW steps, post-validated): after each step every gradient (full
tensors) and the loss, after the last every parameter.

* pp 2 × fsdp 2 with per-layer units resharded after forward under zb-h1, zb-v and 1f1b; pp 1 ×
  fsdp 4 (no pipeline: ZeRO-3) under zb-h1 and 1f1b, and HSDP (2 × 2) without a pipeline; units of
  2 layers kept whole for the step; a chunk resharded after forward; and the default
  (``fsdp=None``), whose collectives are unchanged: one all-gather and one reduce-scatter per chunk
  per step.  ``evaluate`` then matches the reference's loss and leaves every parameter sharded.
* per-layer units gather each layer at least once per forward and B (more collectives than per
  chunk) and hold fewer parameter bytes at their peak than the per-chunk layout (measured with
  :func:`~zerobubble.runtime.parallel.fsdp.parameter_peak`).
* a per-layer Pipeline saves with ``torch.distributed.checkpoint`` and a per-chunk one loads it:
  both then take the same step to the same parameters.
* ``FSDPOptions`` and ``fsdp=`` are checked when the request is made (one process).
"""

from __future__ import annotations

import re
import tempfile

import pytest
import torch
from _dist import DistSpy, relative_error, rich_batch, rich_layers, run_ranks, token_loss
from torch import nn

from zerobubble.errors import ScheduleError
from zerobubble.runtime import PipelineError
from zerobubble.runtime.construct.request import PipelineRequest
from zerobubble.runtime.launch import init_distributed
from zerobubble.runtime.parallel.fsdp import parameter_peak
from zerobubble.runtime.tensors import full_value
from zerobubble.schedule.sharding import FSDPOptions

STEPS = 3
MAX_NORM = 0.3
TOLERANCE = 1e-5
BATCH = 8
LAYERED = FSDPOptions()  # per layer, resharded after forward, one unit prefetched

MESHES = {  # name: (shape, dimension names, data_parallel)
    "pp2": ((2, 2), ("dp", "pp"), "fsdp"),
    "pp1": ((4, 1), ("dp", "pp"), "fsdp"),
    "pp1 hsdp": ((2, 2, 1), ("dp_replicate", "dp_shard", "pp"), "hsdp"),
}
CASES = {  # name: (mesh, schedule, fsdp)
    "pp2 zb-h1": ("pp2", "zb-h1", LAYERED),
    "pp2 zb-v": ("pp2", "zb-v", LAYERED),
    "pp2 1f1b": ("pp2", "1f1b", LAYERED),
    "pp1 zb-h1": ("pp1", "zb-h1", LAYERED),
    "pp1 1f1b": ("pp1", "1f1b", FSDPOptions(prefetch=2)),
    "pp1 hsdp zb-h1": ("pp1 hsdp", "zb-h1", LAYERED),
    "pp2 zb-h1 pairs kept": ("pp2", "zb-h1", FSDPOptions(units=2, reshard_after_forward=False, prefetch=0)),
    "pp2 zb-h1 chunk resharded": ("pp2", "zb-h1", FSDPOptions(units="chunk")),
    "pp2 zb-h1 default": ("pp2", "zb-h1", None),
    "pp2 zb-v resharded after forward only": (
        "pp2",
        "zb-v",
        FSDPOptions(reshard_after_forward=True, reshard_after_backward=False),
    ),
    "pp1 1f1b resharded after backward only": (
        "pp1",
        "1f1b",
        FSDPOptions(reshard_after_forward=False, reshard_after_backward=True),
    ),
}


class CollectiveCounter(DistSpy):
    """Counts FSDP2's all-gathers and reduce-scatters (torch.distributed's functions, wrapped)."""

    GATHERS, SCATTERS = (
        ("all_gather_single", "all_gather_into_tensor"),
        ("reduce_scatter_single", "reduce_scatter_tensor"),
    )

    def __init__(self):
        super().__init__(self.GATHERS + self.SCATTERS)
        self.counts = dict.fromkeys(self.GATHERS + self.SCATTERS, 0)

    def seen(self, name: str, args: tuple, kwargs: dict) -> None:
        self.counts[name] += 1

    def gathers(self) -> int:
        return sum(self.counts[name] for name in self.GATHERS)

    def scatters(self) -> int:
        return sum(self.counts[name] for name in self.SCATTERS)


def _layers(seed: int) -> list[nn.Module]:
    return [layer.double() for layer in rich_layers(seed)]


def _pipeline(mesh, schedule: str, fsdp, seed: int = 3, data_parallel: str = "fsdp"):
    from zerobubble import Pipeline

    return Pipeline(
        _layers(seed), schedule=schedule, microbatches=2, loss_fn=token_loss, timeout=60, mesh=mesh,
        data_parallel=data_parallel, fsdp=fsdp,
    )  # fmt: skip


def _forward(layers, inputs):
    values = inputs
    for layer in layers:
        values = layer(*values) if isinstance(values, tuple) else layer(values)
    return values


def run_case(mesh, schedule: str, fsdp, data_parallel: str) -> dict:
    pipe = _pipeline(mesh, schedule, fsdp, data_parallel=data_parallel)
    layers = _layers(seed=3)
    model = nn.Sequential(*layers)
    adamw = lambda params: torch.optim.AdamW(params, lr=0.05, weight_decay=0.01)  # noqa: E731
    optimizer, reference = adamw(list(pipe.parameters())), adamw(model.parameters())
    grid = pipe.layout.grid
    rows = slice(BATCH // grid.dp * grid.dp_index, BATCH // grid.dp * (grid.dp_index + 1))
    out: dict = {"grad": [], "loss": [], "gathers": [], "scatters": [], "peak": []}
    mine = dict(pipe.named_parameters())
    for step in range(STEPS):
        inputs, targets = rich_batch(BATCH, seed=300 + step)
        with CollectiveCounter() as counter, parameter_peak() as peak:
            loss = pipe.step(inputs[rows], targets[rows])
        out["gathers"].append(counter.gathers())
        out["scatters"].append(counter.scatters())
        out["peak"].append(peak.peak)
        model.zero_grad(set_to_none=True)
        expected_loss = token_loss(_forward(layers, inputs), targets)
        expected_loss.backward()
        expected = dict(model.named_parameters())
        out["grad"].append(max(relative_error(full_value(p.grad), expected[n].grad) for n, p in mine.items()))
        if loss is not None:
            out["loss"].append(abs(loss.item() - expected_loss.item()) / expected_loss.item())
        pipe.optimizer_step(optimizer, max_norm=MAX_NORM)
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), MAX_NORM)
        reference.step()
        pipe.zero_grad(set_to_none=True)
    pipe.synchronize()
    expected = dict(model.named_parameters())
    out["param"] = max(relative_error(full_value(p).detach(), expected[n].detach()) for n, p in mine.items())
    out["chunks"] = len(pipe.stages)
    out["resharded"] = all(type(p).__name__ == "DTensor" for p in pipe.parameters())
    out["clipped"] = pipe.optimizer_stats.clipped
    out["paths"] = sorted({record.path for record in pipe.split_report()})
    inputs, targets = rich_batch(BATCH, seed=999)
    evaluated = pipe.evaluate(inputs[rows], targets[rows])  # the mean over the replicas' rows
    if evaluated is not None:
        with torch.no_grad():
            expected_loss = token_loss(_forward(layers, inputs), targets).item()
        out["eval"] = abs(evaluated.item() - expected_loss) / expected_loss
    out["resharded after evaluate"] = all(type(p).__name__ == "DTensor" for p in pipe.parameters())
    return out


def checkpoint_case(mesh, directory: str) -> dict:
    """Per-layer units save (DCP), per-chunk units load; both take the same step."""
    import torch.distributed.checkpoint as dcp

    saver, loader = _pipeline(mesh, "zb-h1", LAYERED, seed=3), _pipeline(mesh, "zb-h1", None, seed=8)
    adamw = lambda pipe: torch.optim.AdamW(list(pipe.parameters()), lr=0.05)  # noqa: E731
    saving, loading = adamw(saver), adamw(loader)
    grid = saver.layout.grid
    rows = slice(BATCH // grid.dp * grid.dp_index, BATCH // grid.dp * (grid.dp_index + 1))

    def step(pipe, optimizer, seed):
        inputs, targets = rich_batch(BATCH, seed=seed)
        pipe.step(inputs[rows], targets[rows])
        pipe.optimizer_step(optimizer, max_norm=MAX_NORM)
        pipe.zero_grad(set_to_none=True)

    for seed in (1, 2):
        step(saver, saving, seed)
    saver.synchronize()
    dcp.save(
        {"model": saver.state_dict(), "optim": saver.optimizer_state_dict(saving, flatten=True)},
        checkpoint_id=directory,
    )
    state = {"model": loader.state_dict(), "optim": loader.optimizer_state_dict(loading, flatten=True)}
    dcp.load(state, checkpoint_id=directory)
    loader.load_state_dict(state["model"])
    loader.load_optimizer_state_dict(loading, state["optim"])
    for pipe, optimizer in ((saver, saving), (loader, loading)):
        step(pipe, optimizer, 3)
        pipe.synchronize()
    theirs = dict(loader.named_parameters())
    return {
        "param": max(
            relative_error(full_value(p).detach(), full_value(theirs[n]).detach())
            for n, p in saver.named_parameters()
        )
    }


def rank_worker(directory: str) -> dict:
    init_distributed(backend="gloo", timeout=60)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {}
    for name, (shape, dims, _) in MESHES.items():
        meshes[name] = init_device_mesh("cpu", shape, mesh_dim_names=dims)
    results = {}
    for name, (mesh, schedule, fsdp) in CASES.items():
        results[name] = run_case(meshes[mesh], schedule, fsdp, MESHES[mesh][2])
    results["checkpoint"] = checkpoint_case(meshes["pp2"], directory)
    return results


@pytest.fixture(scope="module")
def outcomes() -> list[dict]:
    with tempfile.TemporaryDirectory() as directory:
        return run_ranks(rank_worker, 4, directory, timeout=300)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_units_train_exactly_as_one_process(outcomes, case):
    per_rank = [results[case] for results in outcomes]
    for rank, r in enumerate(per_rank):
        assert max(r["grad"]) <= TOLERANCE and r["param"] <= TOLERANCE, (rank, r)
        assert r["clipped"] > 0 and r["resharded"] and r["resharded after evaluate"], (rank, r)
        assert r.get("eval", 0.0) <= TOLERANCE, (rank, r)
        assert not any("fallback" in path for path in r["paths"]), r["paths"]
    losses = [e for r in per_rank for e in r["loss"]]
    pipelines = 4 // MESHES[CASES[case][0]][0][-1]  # one loss per step on each pipeline's last stage
    assert len(losses) == pipelines * STEPS and max(losses) <= TOLERANCE, losses


@pytest.mark.multiprocess
def test_the_default_layout_gathers_and_scatters_each_chunk_once_a_step(outcomes):
    for results in outcomes:
        r = results["pp2 zb-h1 default"]
        assert r["gathers"] == [r["chunks"]] * STEPS and r["scatters"] == [r["chunks"]] * STEPS, r


@pytest.mark.multiprocess
def test_per_layer_units_gather_per_op_and_hold_less_at_their_peak(outcomes):
    for results in outcomes:
        layered, chunked = results["pp2 zb-h1"], results["pp2 zb-h1 default"]
        # each layer unit at least once in F and once in B per microbatch
        assert min(layered["gathers"]) > 2 * 2 * chunked["gathers"][0], layered["gathers"]
        assert layered["scatters"][-1] >= layered["scatters"][0] > chunked["scatters"][0], layered
        assert max(layered["peak"]) < min(chunked["peak"]), (layered["peak"], chunked["peak"])


@pytest.mark.multiprocess
def test_a_per_layer_checkpoint_loads_into_per_chunk_units(outcomes):
    for results in outcomes:
        assert results["checkpoint"]["param"] <= TOLERANCE, results["checkpoint"]


@pytest.mark.parametrize(
    ("fsdp", "data_parallel", "message"),
    [
        (FSDPOptions(), "replicate", 'says how data_parallel="fsdp" or "hsdp" shards, but data_parallel='),
        ({"units": "layer"}, "fsdp", "fsdp={'units': 'layer'}: pass FSDPOptions("),
        (FSDPOptions(bucket_bytes=25e6), "fsdp", "fsdp=FSDPOptions(bucket_bytes=25000000.0): buckets are"),
    ],
)
def test_fsdp_options_are_checked_when_the_request_is_made(fsdp, data_parallel, message):
    with pytest.raises(PipelineError, match=re.escape(message)):
        PipelineRequest(layers=[nn.Linear(2, 2)], fsdp=fsdp, data_parallel=data_parallel)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"units": "block"}, "FSDPOptions(units='block'): \"layer\""),
        ({"units": 0}, "FSDPOptions(units=0)"),
        ({"units": True}, "FSDPOptions(units=True)"),
        ({"reshard_after_forward": 1}, "FSDPOptions(reshard_after_forward=1): True or False"),
        ({"prefetch": -1}, "FSDPOptions(prefetch=-1): the number of units gathered ahead"),
        ({"bucket_bytes": -1}, "FSDPOptions(bucket_bytes=-1): a byte count, 0 or more"),
        ({"bucket_bytes": "25MB"}, "FSDPOptions(bucket_bytes='25MB'): a byte count"),
        ({"bucket_bytes": float("nan")}, "FSDPOptions(bucket_bytes=nan): a byte count"),
        ({"bucket_bytes": True}, "FSDPOptions(bucket_bytes=True): a byte count"),
    ],
)
def test_bad_fsdp_options_are_refused(options, message):
    with pytest.raises(PipelineError, match=re.escape(message)):
        FSDPOptions(**options)
    with pytest.raises(ScheduleError, match=re.escape(message)):  # the schedule layer's record too
        FSDPOptions(**options)
