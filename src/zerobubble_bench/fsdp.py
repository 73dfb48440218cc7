"""``bench fsdp``: the data-parallel dimension replicated, with ZeRO, or sharded by FSDP2, side by side.

Three Pipelines of the same layers on one (dp 2, pp 2) mesh of 4 gloo ranks: ``data_parallel=
"replicate"`` with AdamW, the same with ``ZeroRedundancyOptimizer(AdamW)`` over the data-parallel
group, and ``data_parallel="fsdp"`` with AdamW on the FSDP2 shards.  Per configuration: the bytes a
rank holds between steps (each tensor's local storage — a DTensor's shard — of parameters,
gradients and optimizer state; the largest over the ranks) and the median time of ``step`` +
clipped ``optimizer_step``, the configurations taking turns step by step.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zerobubble.runtime.launch import init_distributed, launch

from . import Benchmark
from .tables import Table

CONFIGURATIONS = ("replicated", "replicated + ZeRO", "fsdp")
_KINDS = ("parameters", "gradients", "optimizer state")


def data_parallel_table(
    *, steps: int, width: int, blocks: int, schedule: str, post_validation: bool
) -> Table:
    """Bytes per rank and step times of :data:`CONFIGURATIONS` on (dp 2, pp 2)."""
    per_rank = launch(
        _measure_rank, 4, (steps, width, blocks, schedule, post_validation), threads=1, timeout=900
    )
    table = Table(
        f"Data parallelism on a (dp 2, pp 2) mesh of 4 gloo ranks, {schedule}, {blocks} Linear–GELU–"
        f"Linear blocks of width {width} (float32), post_validation={post_validation}",
        [
            "configuration",
            *(f"{kind} (MiB/rank)" for kind in _KINDS),
            "total (MiB/rank)",
            "vs replicated",
            "step + optimizer_step (ms)",
            "quartiles (ms)",
            "vs replicated",
        ],
    )
    held = {name: {k: max(r[name][k] for r in per_rank) for k in _KINDS} for name in CONFIGURATIONS}
    times = per_rank[0]["times"]
    base_bytes = sum(held["replicated"].values())
    base_time = statistics.median(times["replicated"])
    for name in CONFIGURATIONS:
        q1, mid, q3 = statistics.quantiles(times[name], n=4)
        total = sum(held[name].values())
        table.rows.append(
            [
                name,
                *(f"{held[name][kind] / 2**20:.3f}" for kind in _KINDS),
                f"{total / 2**20:.3f}",
                f"{total / base_bytes:.2f}×",
                f"{mid:.1f}",
                f"{q1:.1f}–{q3:.1f}",
                f"{mid / base_time:.2f}×",
            ]
        )
    table.notes.append(
        "Bytes: after 3 warm-up steps and synchronize(), before zero_grad; the largest over the 4 ranks. "
        f"Times: rank 0, {steps} steps per configuration, the configurations in turn (order reversed "
        "every step); 4 ranks share this machine's cores, so the quartiles show the noise."
    )
    return table


def _measure_rank(steps: int, width: int, blocks: int, schedule: str, post_validation: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    init_distributed(backend="gloo", timeout=300)
    torch.manual_seed(0)
    layers = [
        nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        for _ in range(blocks)
    ]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    pipes, optimizers = _configurations(layers, mesh, schedule, post_validation)
    generator = torch.Generator().manual_seed(1 + mesh.get_local_rank("dp"))
    inputs, targets = torch.randn(16, width, generator=generator), torch.randn(16, width, generator=generator)

    def step(name: str) -> None:
        pipes[name].step(inputs, targets)
        pipes[name].optimizer_step(optimizers[name], max_norm=1.0)

    result: dict[str, Any] = {}
    for name, pipe in pipes.items():
        for _ in range(3):
            pipe.zero_grad(set_to_none=True)
            step(name)
        pipe.synchronize()
        result[name] = _held(list(pipe.parameters()), optimizers[name])
        pipe.zero_grad(set_to_none=True)
    times: dict[str, list[float]] = {name: [] for name in pipes}
    dist.barrier()
    for index in range(steps):
        for name in CONFIGURATIONS[:: -1 if index % 2 else 1]:
            started = time.perf_counter()
            step(name)
            times[name].append((time.perf_counter() - started) * 1e3)
            pipes[name].zero_grad(set_to_none=True)
    for pipe in pipes.values():
        pipe.synchronize()
    dist.barrier()
    result["times"] = times
    return result


def _configurations(
    layers: Sequence[nn.Module], mesh: Any, schedule: str, post_validation: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One Pipeline (on a copy of ``layers``) and its optimizer per entry of :data:`CONFIGURATIONS`."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from zerobubble import Pipeline

    pipes: dict[str, Any] = {}
    optimizers: dict[str, Any] = {}
    for name in CONFIGURATIONS:
        pipe = pipes[name] = Pipeline(
            copy.deepcopy(layers),
            mesh=mesh,
            data_parallel="fsdp" if name == "fsdp" else "replicate",
            schedule=schedule,
            microbatches=4,
            loss_fn=F.mse_loss,
            timeout=300,
            post_validation=post_validation,
        )
        params = list(pipe.parameters())
        optimizers[name] = (
            ZeroRedundancyOptimizer(
                params, optimizer_class=torch.optim.AdamW, process_group=pipe.layout.dp_group, lr=1e-3
            )
            if "ZeRO" in name
            else torch.optim.AdamW(params, lr=1e-3)
        )
    return pipes, optimizers


def _held(params: list[torch.Tensor], optimizer: Any) -> dict[str, int]:
    """Local bytes of ``params``, their gradients and ``optimizer``'s state tensors."""
    local = getattr(optimizer, "optim", optimizer)  # ZeRO keeps the state in its local optimizer
    state = [v for s in local.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return {
        "parameters": _bytes(params),
        "gradients": _bytes(p.grad for p in params if p.grad is not None),
        "optimizer state": _bytes(state),
    }


def _bytes(tensors) -> int:
    total = 0
    for tensor in tensors:
        value = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += value.numel() * value.element_size()
    return total


# ---- the ``zerobubble bench fsdp`` command ----


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``zerobubble bench fsdp``."""
    parser.add_argument("--steps", type=int, default=30, help="timed steps per configuration")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--schedule", default="zb-h1")
    parser.add_argument(
        "--synchronous", action="store_true", help="post_validation=False (a synchronous optimizer step)"
    )


def check(args: argparse.Namespace) -> None:
    """Positive sizes and enough blocks for the schedule's chunks."""
    from zerobubble.errors import UsageError

    for name, least in (("steps", 4), ("width", 1), ("blocks", 4)):
        if getattr(args, name) < least:
            raise UsageError(f"--{name} must be at least {least}")


def run(args: argparse.Namespace) -> list[Table]:
    """``zerobubble bench fsdp``'s table."""
    return [
        data_parallel_table(
            steps=args.steps,
            width=args.width,
            blocks=args.blocks,
            schedule=args.schedule,
            post_validation=not args.synchronous,
        )
    ]


BENCHMARK = Benchmark(
    name="fsdp",
    help="data parallelism replicated, with ZeRO or sharded by FSDP2: bytes per rank and step time",
    add_arguments=add_arguments,
    run=run,
    check=check,
)
