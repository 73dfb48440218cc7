"""Rank worker: our exported torch CSV run by torch's own ``_PipelineScheduleRuntime``.

Module-level so spawned ranks can import it; it returns plain Python numbers to the parent.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch
from torch import nn

from zerobubble.runtime.launch import init_distributed
from zerobubble.schedule import build_schedule
from zerobubble.schedule.export import to_torch_csv, torch_placement

BLOCKS, WIDTH, BATCH = 4, 6, 8


def mlp(seed: int) -> list[nn.Module]:
    """``BLOCKS`` Linear + Tanh blocks in float64, seeded."""
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()).double() for _ in range(BLOCKS)]


def squared_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).square().mean()


def reference_grads(seed: int, inputs, targets, microbatches: int) -> dict[str, torch.Tensor]:
    """Gradients of the mean microbatch loss in one process, by ``"<block>.<parameter>"``."""
    model = nn.Sequential(*mlp(seed))
    for x, y in zip(inputs.chunk(microbatches), targets.chunk(microbatches)):
        (squared_loss(model(x), y) / microbatches).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def torch_runtime_cases(cases: list[tuple[str, int]]) -> dict[int, dict]:
    """For each ``(schedule, microbatches)``: export our schedule's CSV and placement, build this rank's
    torch ``PipelineStage`` objects from the placement, run one step in ``_PipelineScheduleRuntime``
    and return the largest relative gradient error against :func:`reference_grads`."""
    init_distributed(backend="gloo", timeout=60)
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    rank, world = dist.get_rank(), dist.get_world_size()
    folder = tempfile.mkdtemp(prefix=f"zb-torch-csv-{rank}-")
    results = {}
    for index, (name, microbatches) in enumerate(cases):
        schedule = build_schedule(name, world, microbatches)
        csv_path = os.path.join(folder, f"{name}.csv")
        with open(csv_path, "w", encoding="utf-8") as handle:
            handle.write(to_torch_csv(schedule))
        placement = json.loads(json.dumps(torch_placement(schedule)))  # as a reader of the file gets it
        stages_here, count = placement["stages"][rank], placement["num_stages"]
        blocks = mlp(index)
        per_stage = BLOCKS // count
        stages = [
            PipelineStage(
                nn.Sequential(*blocks[s * per_stage : (s + 1) * per_stage]), s, count, torch.device("cpu")
            )
            for s in stages_here
        ]
        runtime = _PipelineScheduleRuntime(stages, n_microbatches=microbatches, loss_fn=squared_loss)
        runtime._load_csv(csv_path, format="compute_only")
        torch.manual_seed(1000 + index)
        inputs = torch.randn(BATCH, WIDTH, dtype=torch.float64)
        targets = torch.randn(BATCH, WIDTH, dtype=torch.float64)
        args = (inputs,) if 0 in stages_here else ()
        kwargs = {"target": targets, "losses": []} if count - 1 in stages_here else {}
        runtime.step(*args, **kwargs)
        expected = reference_grads(index, inputs, targets, microbatches)
        errors = {}
        for stage in stages:
            for block, module in enumerate(stage.submod):
                for pname, p in module.named_parameters():
                    key = f"{stage.stage_index * per_stage + block}.{pname}"
                    want = expected[key]
                    errors[key] = float((p.grad - want).norm() / want.norm())
        results[index] = {
            "style": placement["style"],
            "stages": stages_here,
            "errors": errors,
            "actions": len(runtime.pipeline_order_with_comms[rank]),
        }
    return results
