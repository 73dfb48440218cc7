"""Expert parallelism with FSDP2 (``data_parallel="fsdp"``) and with tensor parallelism, run in the
4-rank spawn of tests/runtime/parallel/test_expert_parallel.py: the non-expert parameters sharded over
every replica (the ``ep`` ranks, and ``dp`` ones too), the experts over ``ep`` alone; attention
tensor-parallel over ``tp`` beside ``ep``; three clipped AdamW steps against the model in one
process on the whole batch, in float64; a DCP checkpoint of the sharded layout resumed in the
replicated one and back; the layouts still refused.

Module-level so that spawned ranks can import it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from _expert_parallel import (
    _half,
    _microbatches,
    _parameter_errors,
    _reference_run,
    _resumed,
    _train,
    _train_steps,
    refusals,
)
from _hf_moe import batch, moe_model

#: (case, family, schedule, aux, units): each on (pp 2, ep 2) with data_parallel="fsdp"
FSDP_CASES = [
    ("1f1b mixtral aux", "mixtral", "1f1b", True, None),
    ("zb-v qwen2_moe", "qwen2_moe", "zb-v", False, None),  # its shared expert is FSDP2's, the routed not
    ("zb-v mixtral layer units", "mixtral", "zb-v", True, "layer"),  # gathered per layer, W reads none
    ("dualpipe-v qwen3_moe", "qwen3_moe", "dualpipe-v", False, None),
    ("auto mixtral", "mixtral", "auto", False, None),  # planned: the schedule, the cut and FSDP2's units
]


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _pipeline(model: Any, schedule: str, mesh: Any, aux: bool, units: str | None = None) -> Any:
    from _hf_models import lm_loss

    from zerobubble import FSDPOptions, Pipeline
    from zerobubble.hf import pipeline_layers, with_router_aux_loss

    example = _half(*batch("whole", seed=10)[:2], mesh) if schedule == "auto" else None
    return Pipeline(
        pipeline_layers(model), schedule=schedule, microbatches=_microbatches(schedule),
        loss_fn=with_router_aux_loss(lm_loss) if aux else lm_loss, timeout=60, mesh=mesh,
        data_parallel="fsdp", fsdp=FSDPOptions(units=units) if units else None, example=example,
    )  # fmt: skip


def _kinds(pipe: Any) -> dict[str, list[str]]:
    """This rank's parameters by what holds them: ``"fsdp"`` (FSDP2's shards over the replicas),
    ``"experts"`` (the ep shards FSDP2 ignores), ``"plain"`` (neither)."""
    from zerobubble.runtime.parallel.experts import expert_parameters

    experts = {id(p) for p in expert_parameters([pipe.module])}
    kinds: dict[str, list[str]] = {"fsdp": [], "experts": [], "plain": []}
    for name, param in pipe.named_parameters():
        kind = "experts" if id(param) in experts else "fsdp" if hasattr(param, "placements") else "plain"
        kinds[kind].append(name)
    return kinds


def trained(cases: list[tuple[str, str, str, bool, str | None]]) -> dict:
    """Each case of :data:`FSDP_CASES` on (pp 2, ep 2), then Mixtral with 1F1B on (pp 1, dp 2, ep 2),
    FSDP2 over the four replicas' column, the experts over ep and averaged over dp."""
    out: dict = {}
    pp_ep, dp_ep = ((2, 2), ("pp", "ep")), ((1, 2, 2), ("pp", "dp", "ep"))
    layouts = [(*case, pp_ep) for case in cases]
    layouts.append(("1f1b mixtral pp1 dp2 ep2", "mixtral", "1f1b", False, None, dp_ep))
    for name, family, schedule, aux, units, (shape, names) in layouts:
        mesh = _mesh(shape, names)
        model = moe_model(family, aux)
        reference = copy.deepcopy(model)
        pipe = _pipeline(model, schedule, mesh, aux, units)
        optimizers = tuple(torch.optim.AdamW(m.parameters(), lr=0.01) for m in (pipe, reference))
        losses, mismatches = _train(pipe, reference, mesh, range(3), optimizers)
        out[name] = {
            "losses": losses,
            "params": _parameter_errors(pipe, reference),
            "mismatches": mismatches,
            "kinds": _kinds(pipe),
            "sharded": pipe.sharding,
            "plan": None if pipe.plan is None else pipe.plan.reason,
        }
    return out


def checkpoints(root: str) -> dict:
    """Mixtral with its aux loss, zb-v on (pp 2, ep 2): two steps with FSDP2, saved with DCP, loaded
    into the replicated layout; two replicated steps loaded into FSDP2; each resumes the next step
    against the uninterrupted run on the whole batch."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    _, after, _, _, last_loss = _reference_run("mixtral")
    mesh = _mesh((2, 2), ("pp", "ep"))
    out: dict = {}
    for saved_as, loaded_as in (("fsdp", "replicate"), ("replicate", "fsdp")):
        directory = str(Path(root) / f"ep-{saved_as}")
        pipe = _built(saved_as, mesh)
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.01)
        _train_steps(pipe, optimizer, mesh, range(2))
        state = {"model": pipe.state_dict(), "optim": pipe.optimizer_state_dict(optimizer, flatten=True)}
        dcp.save(state, checkpoint_id=directory)
        del pipe, optimizer, state
        dist.barrier()
        resumed = _built(loaded_as, mesh)
        out[f"{loaded_as} from {saved_as}"] = _resumed(resumed, mesh, directory, after, last_loss)
    return out


def _built(data_parallel: str, mesh: Any) -> Any:
    from _expert_parallel import _pipeline as replicated

    model = moe_model("mixtral", aux=True)
    if data_parallel == "fsdp":
        return _pipeline(model, "zb-v", mesh, True)
    return replicated(model, "zb-v", mesh, True)


def refused() -> dict[str, str]:
    """What expert parallelism with sharding still refuses: HSDP's rows beside ``ep``, and running
    a pair's halves on two threads (both would post FSDP2's collectives)."""
    from _hf_models import lm_loss

    from zerobubble import Pipeline
    from zerobubble.hf import pipeline_layers

    hsdp = _mesh((1, 1, 2, 2), ("pp", "dp_replicate", "dp_shard", "ep"))
    mesh = _mesh((2, 2), ("pp", "ep"))
    layers = pipeline_layers(moe_model("mixtral", aux=False))
    threads = {"schedule": "dualpipe-v", "microbatches": 4, "overlap": "threads"}
    attempts = {
        "hsdp": lambda: Pipeline(layers, loss_fn=lm_loss, mesh=hsdp, data_parallel="hsdp", timeout=60),
        "threads": lambda: Pipeline(
            layers, loss_fn=lm_loss, mesh=mesh, data_parallel="fsdp", timeout=60, **threads
        ),
    }
    return refusals(attempts)


def attention_over_tp(layer: Any, mesh: Any) -> Any:
    """A decoder block's attention tensor-parallel over the mesh's ``"tp"`` (Megatron's cut: q, k, v
    by columns, o by rows); every other layer as it is."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    attention = getattr(getattr(layer, "layer", None), "self_attn", None)
    if attention is not None:
        plan = {name: ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")}
        parallelize_module(attention, mesh["tp"], {**plan, "o_proj": RowwiseParallel()})
    return layer


#: (case, schedule, data_parallel) on (pp 1, ep 2, tp 2): Mixtral without the aux loss
TP_CASES = [("1f1b replicated", "1f1b", "replicate"), ("zb-v fsdp", "zb-v", "fsdp")]


def tensor_parallel(cases: list[tuple[str, str, str]]) -> dict:
    """Each case on (pp 1, ep 2, tp 2): the attention cut over tp, the experts over ep (each tp
    rank runs its ep group's tokens through them), three clipped steps against one process."""
    from _hf_models import lm_loss

    from zerobubble import Pipeline
    from zerobubble.hf import pipeline_layers

    mesh = _mesh((1, 2, 2), ("pp", "ep", "tp"))
    out: dict = {}
    for name, schedule, data_parallel in cases:
        model = moe_model("mixtral", aux=False)
        reference = copy.deepcopy(model)
        pipe = Pipeline(
            pipeline_layers(model), schedule=schedule, microbatches=2, loss_fn=lm_loss, timeout=60,
            mesh=mesh, parallelize=attention_over_tp, data_parallel=data_parallel,
        )  # fmt: skip
        optimizers = tuple(torch.optim.AdamW(m.parameters(), lr=0.01) for m in (pipe, reference))
        losses, mismatches = _train(pipe, reference, mesh, range(3), optimizers)
        meshes = {
            each: tuple(param.device_mesh.mesh_dim_names or ())
            for each, param in pipe.named_parameters()
            if hasattr(param, "device_mesh") and ("experts" in each or "q_proj" in each)
        }
        out[name] = {
            "losses": losses,
            "params": _parameter_errors(pipe, reference),
            "mismatches": mismatches,
            "meshes": meshes,
            "deferred": [r.path for r in pipe.split_report() if "Experts" in r.type],
        }
    return out


def fsdp_cases(root: str) -> dict:
    """Everything the test asks of expert parallelism with FSDP2 and tensor parallelism."""
    return {
        "trained": trained(FSDP_CASES),
        "checkpoints": checkpoints(root),
        "refused": refused(),
        "tensor parallel": tensor_parallel(TP_CASES),
    }
