"""Rank worker for tests/runtime/vocab/test_vocab_dcp.py: vocabulary-parallel checkpoints through DCP
(issue 45, item 3).

One spawn of four gloo ranks.  Two 2-rank zb-h1 pipelines on sub-groups train a float64 model with a
vocabulary-parallel embedding and head — untied (V=1001) on ranks 0-1, tied (V=13) on ranks 2-3 —
for ``SAVED_AT`` clipped AdamW steps and save it with DCP as docs/guide.md says; ranks 0 and 2 save
the unpipelined model at the same step with torch's ``get_state_dict``.  The checkpoints then load
into zb-v on 2 ranks, 1f1b and zb-h1 on 4 ranks (other partitions; the rows cut elsewhere: 251 250
250 250 and 4 3 3 3, not ``torch.chunk``'s 251 251 251 248 and 4 4 4 1), the unpipelined model
(``set_state_dict``), and the unpipelined model's checkpoint into 1f1b on 2 ranks.  Every loaded
layout takes ``MORE`` steps; the worker returns how far its losses and parameters are from a
single-process run that was never interrupted.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dcp import distance
from _vocab_models import batch, model
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from zerobubble.runtime.launch import init_distributed

VOCAB = {False: 1001, True: 13}  # untied, tied
BLOCKS, BATCH = 6, 8
SAVED_AT, MORE = 2, 2  # steps before the checkpoint, and after it in every layout
MAX_NORM = 0.3  # small enough to clip every step (the reference's norms are returned)
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
VOCAB_KEYS = ("vocab_embedding.weight", "vocab_head.weight")


class Unpipelined(nn.Module):
    """The model the Pipeline cuts, under the Pipeline's state-dict keys: ``vocab_embedding``, the
    blocks ``"0"`` … ``"5"``, ``vocab_head`` (the embedding registered first: a tied weight's first
    name, the one its optimizer state is keyed by, is ``vocab_embedding.weight``)."""

    def __init__(self, parts):
        super().__init__()
        embedding, layers, head = parts
        self.vocab_embedding = embedding
        for index, layer in enumerate(layers):
            self.add_module(str(index), layer)
        self.vocab_head = head
        self.count = len(layers)

    def forward(self, tokens, labels):
        hidden = self.vocab_embedding(tokens)
        for index in range(self.count):
            hidden = getattr(self, str(index))(hidden)
        return self.vocab_head(hidden, labels)


def parts(seed: int, tied: bool):
    return model(seed, vocab=VOCAB[tied], blocks=BLOCKS, tied=tied)


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def data(step: int, tied: bool):
    return batch(BATCH, VOCAB[tied], seed=1000 + step)


def plain_step(net: Unpipelined, optimizer, step: int, tied: bool) -> tuple[float, float]:
    """One step of the unpipelined model: its loss and its gradients' norm before clipping."""
    tokens, labels = data(step, tied)
    loss = net(tokens, labels)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item(), norm.item()


def reference(tied: bool) -> dict:
    """The uninterrupted run: every step's loss and norm, the state dict at the end, and the model
    and optimizer as they were at the checkpoint."""
    net = Unpipelined(parts(0, tied))
    optimizer = adamw(net.parameters())
    steps = [plain_step(net, optimizer, step, tied) for step in range(SAVED_AT)]
    saved = Unpipelined(parts(0, tied))
    saved_optimizer = adamw(saved.parameters())
    saved.load_state_dict(net.state_dict())
    saved_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    steps += [plain_step(net, optimizer, step, tied) for step in range(SAVED_AT, SAVED_AT + MORE)]
    return {
        "losses": [loss for loss, _ in steps],
        "norms": [norm for _, norm in steps],
        "final": {k: v.detach().clone() for k, v in net.state_dict().items()},
        "saved": (saved, saved_optimizer),
    }


def pipeline_step(pipe, optimizer, step: int, tied: bool) -> float | None:
    tokens, labels = data(step, tied)
    loss = pipe.step(tokens, labels)
    pipe.optimizer_step(optimizer, MAX_NORM)
    optimizer.zero_grad(set_to_none=True)
    return None if loss is None else float(loss)


def resumed(pipe, directory: str, tied: bool, expected: dict, group=None) -> dict:
    """The guide's recipe: ``pipe``'s own dicts as templates, ``dcp.load`` into them, loaded; then
    ``MORE`` steps against the uninterrupted run."""
    optimizer = adamw(pipe.parameters())
    state = {"model": pipe.state_dict(), "optim": pipe.optimizer_state_dict(optimizer, flatten=True)}
    dcp.load(state, checkpoint_id=directory, process_group=group)
    loaded = pipe.load_state_dict(state["model"])
    missing = pipe.load_optimizer_state_dict(optimizer, state["optim"])
    losses = [pipeline_step(pipe, optimizer, step, tied) for step in range(SAVED_AT, SAVED_AT + MORE)]
    full = pipe.full_state_dict()
    errors = [abs(a - b) for a, b in zip(losses, expected["losses"][SAVED_AT:]) if a is not None]
    return {
        "loss": max(errors) if errors else None,
        "params": distance(full, expected["final"]),
        "strict": (list(loaded.missing_keys), list(loaded.unexpected_keys), missing),
        "tied": bool(torch.equal(full[VOCAB_KEYS[0]], full[VOCAB_KEYS[1]])) == tied,
        "rows": [pipe.module.vocab_head.vocab_start, pipe.module.vocab_head.vocab_stop],
    }


def cases(root: str) -> dict:
    init_distributed(backend="gloo", timeout=120)
    from zerobubble import Pipeline

    rank = int(os.environ["RANK"])
    paths = {name: str(Path(root) / name) for name in ("untied", "tied", "plain-untied", "plain-tied")}
    expected = {tied: reference(tied) for tied in (False, True)}
    out: dict = {"norms": {tied: expected[tied]["norms"] for tied in (False, True)}}
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group, tied = halves[rank // 2], rank >= 2

    def build(seed: int, is_tied: bool, schedule: str, microbatches: int, **options):
        embedding, layers, head = parts(seed, is_tied)
        return Pipeline(
            layers, schedule=schedule, microbatches=microbatches, embedding=embedding, head=head,
            timeout=60, **options,
        )  # fmt: skip

    # saved: zb-h1 on each half (untied on ranks 0-1, tied on 2-3), SAVED_AT steps
    pipe = build(0, tied, "zb-h1", 2, group=group, partition=[4])
    optimizer = adamw(pipe.parameters())
    trained = [pipeline_step(pipe, optimizer, step, tied) for step in range(SAVED_AT)]
    if trained[0] is not None:
        out["trained"] = max(abs(a - b) for a, b in zip(trained, expected[tied]["losses"]))  # type: ignore[operator]
    state = {"model": pipe.state_dict(), "optim": pipe.optimizer_state_dict(optimizer, flatten=True)}
    entries = {**state["model"], **state["optim"]}
    out["shards"] = sorted(key for key, value in entries.items() if hasattr(value, "placements"))
    dcp.save(state, checkpoint_id=paths["tied" if tied else "untied"], process_group=group)
    if rank in (0, 2):  # the unpipelined model's checkpoint at the same step, with torch's functions
        net, net_optimizer = expected[tied]["saved"]
        model_state, optim_state = get_state_dict(net, net_optimizer, options=FLAT)
        plain = paths["plain-tied" if tied else "plain-untied"]
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=plain, no_dist=True)
        out["files"] = _written(paths["tied" if tied else "untied"], plain)
    del pipe, optimizer, state
    dist.barrier()

    # zb-v on each half, the other model: each checkpoint into another schedule and partition
    pipe = build(1, not tied, "zb-v", 4, group=group)
    out["zb-v p2"] = resumed(pipe, paths["untied" if tied else "tied"], not tied, expected[not tied], group)
    del pipe
    # 1f1b and zb-h1 on all four ranks: the rows cut in four
    pipe = build(2, False, "1f1b", 4, partition=[2, 3, 5])
    out["1f1b p4"] = resumed(pipe, paths["untied"], False, expected[False])
    del pipe
    pipe = build(3, True, "zb-h1", 4)
    out["zb-h1 p4"] = resumed(pipe, paths["tied"], True, expected[True])
    out["refused"] = _refusals(pipe)
    del pipe
    if rank < 2:  # the unpipelined model loads a pipeline's checkpoint (rank 0 untied, rank 1 tied)
        which = bool(rank)
        out["unpipelined"] = _unpipelined(paths["tied" if which else "untied"], which, expected[which])
    dist.barrier()
    # and a Pipeline loads the unpipelined model's checkpoint: 1f1b on each half
    pipe = build(4, tied, "1f1b", 2, group=group, partition=[2])
    out["1f1b p2 from unpipelined"] = resumed(
        pipe, paths["plain-tied" if tied else "plain-untied"], tied, expected[tied], group
    )
    return out


def _refusals(pipe) -> list[str]:
    """The messages of loads refused: a shard of other rows, a tensor that is neither the full weight
    nor a shard, full weights beside a key of no layer (strict); whether the state is unchanged."""
    from zerobubble.runtime import PipelineError
    from zerobubble.runtime.vocab.state import row_shard

    state = pipe.state_dict()
    before = pipe.full_state_dict()
    head = pipe.module.vocab_head
    other = (head.vocab_start + 1) % head.vocab_size
    wrong = row_shard(torch.zeros_like(head.weight), other, head.vocab_size, state[VOCAB_KEYS[1]].device_mesh)
    messages = []
    full = torch.zeros(head.vocab_size, head.dim, dtype=torch.float64)
    for value, extra in ((wrong, {}), (full[1:], {}), (full, {"no.such.key": full})):
        try:
            pipe.load_state_dict({**state, VOCAB_KEYS[0]: value, VOCAB_KEYS[1]: value, **extra})
            messages.append("loaded")
        except PipelineError as error:
            messages.append(str(error))
    unchanged = distance(pipe.full_state_dict(), before) == 0.0
    return [*messages, "unchanged" if unchanged else "changed"]


def _unpipelined(directory: str, tied: bool, expected: dict) -> dict:
    """torch's get_state_dict / dcp.load / set_state_dict on the unpipelined model, then ``MORE`` steps."""
    net = Unpipelined(parts(5, tied))
    optimizer = adamw(net.parameters())
    model_state, optim_state = get_state_dict(net, optimizer, options=FLAT)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=directory, no_dist=True)
    set_state_dict(
        net, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=FLAT
    )
    losses = [plain_step(net, optimizer, step, tied)[0] for step in range(SAVED_AT, SAVED_AT + MORE)]
    return {
        "loss": max(abs(a - b) for a, b in zip(losses, expected["losses"][SAVED_AT:])),
        "params": distance(net.state_dict(), expected["final"]),
    }


def _written(pipelined: str, unpipelined: str) -> dict:
    """Bytes of the data files of the pipeline's save and of the unpipelined model's, their keys, and
    the row offsets the pipeline's save wrote the head's weight at."""
    sizes = [sum(path.stat().st_size for path in Path(d).glob("*.distcp")) for d in (pipelined, unpipelined)]
    metadata = dcp.FileSystemReader(pipelined).read_metadata().state_dict_metadata
    plain = dcp.FileSystemReader(unpipelined).read_metadata().state_dict_metadata
    return {
        "data bytes": sizes[0],
        "unpipelined bytes": sizes[1],
        "same keys": set(metadata) == set(plain),
        "keys": sorted(k for k in metadata if "vocab" in k and k.startswith(("model.", "optim.state."))),
        "head chunks": sorted(
            (tuple(c.offsets), tuple(c.sizes)) for c in metadata["model.vocab_head.weight"].chunks
        ),
    }
