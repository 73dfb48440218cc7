"""Rank worker of tests/runtime/vocab/test_vocab_grid.py: the vocabulary-parallel head and embedding on
a ``DeviceMesh`` of pipeline × data-parallel ranks, trained beside the unsharded model in one process
(:func:`_training_equivalence.train_case`), then its state dicts and DCP checkpoint round-tripped.

Each case runs on four gloo ranks (pp 2 × dp 2); a case with ``refused`` returns the message of the
PipelineError its layout raises on this rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from _training_equivalence import Case, _batch, _pipeline, _worst, build_model, refusal, train_case


def _round_trip(case: Case, folder: str) -> dict[str, float]:
    """Train ``case`` two steps, then load its ``full_state_dict`` and its DCP checkpoint (model and
    optimizer) into fresh Pipelines of the same layout: the worst parameter difference of each, and
    of one more step from the DCP-loaded state against the uninterrupted pipeline."""
    import torch.distributed.checkpoint as dcp

    pipe = _pipeline(case, build_model(case))
    optimizer = torch.optim.AdamW(list(pipe.parameters()), lr=case.lr)
    replicas, replica = pipe.layout.grid.dp, pipe.layout.grid.dp_index
    for step in range(2):
        tokens, labels = _batch(case, step, replicas)
        optimizer.zero_grad()
        pipe.step(tokens.chunk(replicas)[replica], labels.chunk(replicas)[replica])
        pipe.optimizer_step(optimizer, max_norm=case.max_norm)
    pipe.synchronize()
    full = pipe.full_state_dict()
    state = {"model": pipe.state_dict(), "optim": pipe.optimizer_state_dict(optimizer, flatten=True)}
    dcp.save(state, checkpoint_id=folder)
    errors: dict[str, float] = {}
    loaded = _pipeline(case, build_model(dataclasses.replace(case, seed=case.seed + 7)))
    loaded.load_state_dict(full)
    errors["full_state_dict"] = _worst(_same(pipe, loaded), grads=False)
    resumed = _pipeline(case, build_model(dataclasses.replace(case, seed=case.seed + 9)))
    resumed_optimizer = torch.optim.AdamW(list(resumed.parameters()), lr=case.lr)
    target = {
        "model": resumed.state_dict(),
        "optim": resumed.optimizer_state_dict(resumed_optimizer, flatten=True),
    }
    dcp.load(target, checkpoint_id=folder)
    resumed.load_state_dict(target["model"])
    resumed.load_optimizer_state_dict(resumed_optimizer, target["optim"])
    errors["dcp"] = _worst(_same(pipe, resumed), grads=False)
    tokens, labels = _batch(case, 2, replicas)
    for each, each_optimizer in ((pipe, optimizer), (resumed, resumed_optimizer)):
        each_optimizer.zero_grad()
        each.step(tokens.chunk(replicas)[replica], labels.chunk(replicas)[replica])
        each.optimizer_step(each_optimizer, max_norm=case.max_norm)
        each.synchronize()
    errors["dcp, one more step"] = _worst(_same(pipe, resumed), grads=False)
    dist.barrier()
    return errors


def _same(pipe: Any, other: Any) -> list[tuple[Any, Any, slice]]:
    """(this pipeline's parameter, the other's) pairs of every parameter, by name."""
    mine, theirs = dict(pipe.module.named_parameters()), dict(other.module.named_parameters())
    return [(theirs[name], _whole(mine[name]), slice(None)) for name in mine]


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _inside_a_stage(case: Case) -> str:
    """The message of the PipelineError of a mesh with a dimension inside each stage (no
    ``parallelize=``: the request alone cannot tell)."""
    from torch.distributed.device_mesh import init_device_mesh

    from zerobubble import Pipeline
    from zerobubble.runtime import PipelineError

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "pp"))
    model = build_model(case)
    try:
        Pipeline(model["layers"], head=model["head"], embedding=model["embedding"], mesh=mesh, timeout=60)
    except PipelineError as error:
        return str(error)
    finally:
        dist.barrier()
    return "accepted"


def grid_cases(cases: list[dict[str, Any]], folder: str) -> list[Any]:
    """Each ``{"case": Case, "refused"?: bool, "checkpoint"?: bool}`` on this rank: the training
    errors (and with ``checkpoint``, the round trip's), or the refusal's message."""
    from zerobubble.runtime.launch import init_distributed

    init_distributed(backend="gloo", timeout=120)
    torch.set_num_threads(1)
    results: list[Any] = []
    for index, entry in enumerate(cases):
        case = entry["case"]
        if entry.get("refused"):
            results.append(refusal(case) if case.layout != "mesh-tp" else _inside_a_stage(case))
            continue
        result = train_case(case)
        if entry.get("checkpoint"):
            result.update(_round_trip(case, f"{folder}/{index}"))
        results.append(result)
    return results
