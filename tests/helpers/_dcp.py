"""Rank worker for tests/runtime/state/test_dcp.py: torch.distributed.checkpoint across layouts (issue 28).

One spawn of four gloo ranks saves a tied float64 model and its AdamW state with DCP from one layout
and loads them into others — another schedule, partition and number of ranks, two pipelines on
sub-groups of the world, the unpipelined model through torch's own ``get_state_dict`` /
``set_state_dict`` — and, the other way, a checkpoint the unpipelined model saved into a Pipeline.
Every loaded layout takes one more step; the worker returns how far its loss and parameters are from
a single-process run that was never interrupted.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from zerobubble.runtime.launch import init_distributed

WIDTH, VOCAB, SEQ, BATCH = 8, 13, 3, 8
SAVED_AT = 2  # steps before the checkpoint; every layout then takes step SAVED_AT
MAX_NORM = 0.5  # small enough to clip: the steps are post-validated, some rolled back
TIED = ("0.embed.weight", "7.weight")
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, tokens):
        return self.embed(tokens) * self.scale


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, hidden):
        return hidden + torch.tanh(self.fc(self.norm(hidden)))


class TiedHead(nn.Module):
    def __init__(self, embed: Embed, tied: bool = True):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        weight = embed.embed.weight
        self.weight = weight if tied else nn.Parameter(weight.detach().clone())

    def forward(self, hidden):
        return F.linear(self.norm(hidden), self.weight)


def layers(seed: int, tied: bool = True) -> list[nn.Module]:
    """Eight float64 layers: an embedding, six blocks and a head tied to the embedding (or holding a
    copy of its weight: FSDP refuses a parameter tied across chunks)."""
    torch.manual_seed(seed)
    embed = Embed()
    return [module.double() for module in (embed, *(Block() for _ in range(6)), TiedHead(embed, tied))]


def token_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return (
        torch.randint(VOCAB, (BATCH, SEQ), generator=generator),
        torch.randint(VOCAB, (BATCH, SEQ), generator=generator),
    )


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def plain_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    inputs, targets = batch(step)
    loss = token_loss(model(inputs), targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def reference(
    tied: bool = True,
) -> tuple[list[float], dict[str, torch.Tensor], nn.Module, torch.optim.Optimizer]:
    """The uninterrupted run: losses of steps 0..SAVED_AT, the state dict after them, and the model
    and optimizer as they were at the checkpoint (after SAVED_AT steps)."""
    model = nn.Sequential(*layers(0, tied))
    optimizer = adamw(model.parameters())
    losses = [plain_step(model, optimizer, step) for step in range(SAVED_AT)]
    saved = nn.Sequential(*layers(0, tied))
    saved_optimizer = adamw(saved.parameters())
    saved.load_state_dict(model.state_dict())
    saved_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # torch's load shares tensors
    losses.append(plain_step(model, optimizer, SAVED_AT))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, saved, saved_optimizer


def pipeline_step(pipe, optimizer, step: int) -> float | None:
    """One step of the global batch: each replica its shard."""
    inputs, targets = batch(step)
    replicas, index = pipe.data_parallel, pipe.layout.grid.dp_index
    rows = slice(index * BATCH // replicas, (index + 1) * BATCH // replicas)
    loss = pipe.step(inputs[rows], targets[rows])
    pipe.optimizer_step(optimizer, MAX_NORM)
    optimizer.zero_grad(set_to_none=True)
    return None if loss is None else float(loss)


def distance(state: dict, expected: dict) -> float:
    """Largest absolute difference over the entries of ``expected`` (inf when a key is missing)."""
    if set(state) != set(expected):
        return float("inf")
    return max(float((state[k].double() - expected[k].double()).abs().max()) for k in expected)


def resumed(
    pipe, directory: str, flatten: bool, expected_loss: float, expected: dict, group=None, tied: bool = True
) -> dict:
    """Load ``directory`` into ``pipe`` in place (DCP), take step SAVED_AT, compare with the reference."""
    optimizer = adamw(pipe.parameters())
    state = {"model": pipe.state_dict(), "optim": pipe.optimizer_state_dict(optimizer, flatten=flatten)}
    dcp.load(state, checkpoint_id=directory, process_group=group)
    loaded = pipe.load_state_dict(state["model"])
    missing = pipe.load_optimizer_state_dict(optimizer, state["optim"])
    loss = pipeline_step(pipe, optimizer, SAVED_AT)
    full = pipe.full_state_dict()
    return {
        "loss": None if loss is None else abs(loss - expected_loss),
        "params": distance(full, expected),
        "strict": (list(loaded.missing_keys), list(loaded.unexpected_keys), missing),
        "tied": bool(torch.equal(full[TIED[0]], full[TIED[1]])) or not tied,
    }


def cases(root: str) -> dict:
    init_distributed(backend="gloo", timeout=120)
    from zerobubble import Pipeline

    rank = int(os.environ["RANK"])
    saved_flat, saved_nested, saved_plain = (str(Path(root) / name) for name in ("flat", "nested", "plain"))
    losses, expected, plain_model, plain_optimizer = reference()
    out: dict = {}

    # layout A: zb-v, pp 2 x dp 2 (replicas), trained SAVED_AT steps and saved flat and nested
    pipe = Pipeline(
        layers(0), schedule="zb-v", microbatches=2, loss_fn=token_loss, data_parallel=2, timeout=60
    )
    optimizer = adamw(pipe.parameters())
    trained = [pipeline_step(pipe, optimizer, step) for step in range(SAVED_AT)]
    if trained[0] is not None:
        out["trained"] = max(abs(a - b) for a, b in zip(trained, losses))  # type: ignore[operator]
    flat = pipe.optimizer_state_dict(optimizer, flatten=True)
    nested = pipe.optimizer_state_dict(optimizer)
    out["optim keys"] = sorted(nested["state"])
    out["flat keys"] = sorted(flat)
    out["groups"] = [group["params"] for group in nested["param_groups"]]
    dcp.save({"model": pipe.state_dict(), "optim": flat}, checkpoint_id=saved_flat)
    dcp.save({"model": pipe.state_dict(), "optim": nested}, checkpoint_id=saved_nested)
    if rank == 0:  # the unpipelined model's own checkpoint at the same step, through torch's API
        model_state, optim_state = get_state_dict(plain_model, plain_optimizer, options=FLAT)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=saved_plain, no_dist=True)
        out["files"] = _written(saved_flat, saved_plain)
    del pipe, optimizer
    dist.barrier()

    # layout B: 1f1b on 4 pipeline ranks, no replicas
    pipe = Pipeline(layers(1), schedule="1f1b", microbatches=4, loss_fn=token_loss, timeout=60)
    out["1f1b p4 from flat"] = resumed(pipe, saved_flat, True, losses[SAVED_AT], expected)
    del pipe

    # layout C: two 2-rank pipelines on sub-groups, other schedules and partitions, the nested dict
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = halves[rank // 2]
    if rank < 2:
        options = {"schedule": "1f1b", "partition": [3]}
    else:
        options = {"schedule": "interleaved-1f1b", "chunks": 2, "partition": [1, 2, 6]}
    pipe = Pipeline(layers(2), microbatches=4, loss_fn=token_loss, group=group, timeout=60, **options)
    name = f"{options['schedule']} p2 {options['partition']} from nested"
    out[name] = resumed(pipe, saved_nested, False, losses[SAVED_AT], expected, group=group)
    del pipe

    # the unpipelined model loads the pipeline's flat checkpoint with torch's own functions
    if rank == 0:
        model = nn.Sequential(*layers(3))
        plain = adamw(model.parameters())
        model_state, optim_state = get_state_dict(model, plain, options=FLAT)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=saved_flat, no_dist=True)
        set_state_dict(
            model, plain, model_state_dict=state["model"], optim_state_dict=state["optim"], options=FLAT
        )
        loss = plain_step(model, plain, SAVED_AT)
        out["unpipelined from flat"] = {
            "loss": abs(loss - losses[SAVED_AT]),
            "params": distance(model.state_dict(), expected),
        }
    dist.barrier()

    # and a Pipeline (zb-v on 4 ranks: one layer per chunk) loads the unpipelined model's checkpoint
    pipe = Pipeline(layers(4), schedule="zb-v", microbatches=4, loss_fn=token_loss, timeout=60)
    out["zb-v p4 from unpipelined"] = resumed(pipe, saved_plain, True, losses[SAVED_AT], expected)
    del pipe
    out.update(_sharded_cases(root, rank))
    return out


def _sharded_cases(root: str, rank: int) -> dict:
    """An untied model under FSDP on a (dp 2, pp 2) mesh: saved (DTensor shards) and loaded into 1f1b
    on 4 ranks; a checkpoint of the unpipelined model loaded into FSDP shards."""
    from torch.distributed.device_mesh import init_device_mesh

    from zerobubble import Pipeline

    saved, saved_plain = str(Path(root) / "fsdp"), str(Path(root) / "fsdp-plain")
    losses, expected, plain_model, plain_optimizer = reference(tied=False)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    options = {"loss_fn": token_loss, "timeout": 60, "mesh": mesh, "data_parallel": "fsdp"}
    pipe = Pipeline(layers(0, tied=False), schedule="zb-h1", microbatches=2, **options)
    optimizer = adamw(pipe.parameters())
    for step in range(SAVED_AT):
        pipeline_step(pipe, optimizer, step)
    state = {"model": pipe.state_dict(), "optim": pipe.optimizer_state_dict(optimizer, flatten=True)}
    out = {"sharded": all(hasattr(v, "placements") for v in state["optim"].values() if getattr(v, "ndim", 0))}
    dcp.save(state, checkpoint_id=saved)
    if rank == 0:
        model_state, optim_state = get_state_dict(plain_model, plain_optimizer, options=FLAT)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=saved_plain, no_dist=True)
    del pipe, optimizer, state
    dist.barrier()
    pipe = Pipeline(layers(5, tied=False), schedule="1f1b", microbatches=4, loss_fn=token_loss, timeout=60)
    out["1f1b p4 from fsdp"] = resumed(pipe, saved, True, losses[SAVED_AT], expected, tied=False)
    del pipe
    pipe = Pipeline(layers(6, tied=False), schedule="1f1b", microbatches=2, **options)
    out["fsdp 1f1b from unpipelined"] = resumed(
        pipe, saved_plain, True, losses[SAVED_AT], expected, tied=False
    )
    return out


def _written(pipelined: str, unpipelined: str) -> dict:
    """Bytes of the data files of the 4 ranks' save and of the one process' save of the same entries,
    and the keys of the former."""
    sizes = [sum(path.stat().st_size for path in Path(d).glob("*.distcp")) for d in (pipelined, unpipelined)]
    metadata = dcp.FileSystemReader(pipelined).read_metadata()
    plain = dcp.FileSystemReader(unpipelined).read_metadata()
    return {
        "data bytes": sizes[0],
        "unpipelined bytes": sizes[1],
        "keys": sorted(metadata.state_dict_metadata),
        "same keys": set(metadata.state_dict_metadata) == set(plain.state_dict_metadata),
    }
