"""Rank worker of tests/runtime/test_training_equivalence.py: a drawn Pipeline trained for several optimizer
steps beside the unsharded model trained in one process, in float64.

A :class:`Case` names everything that can change the arithmetic of a training loop: the schedule and
microbatches, plain or vocabulary-parallel ends (tied or not), activation checkpointing inside the
blocks, the optimizer and whether clipping triggers, post-validation, the loop's order (``zero_grad``
before ``step``, or after ``optimizer_step``), and the layout (a pipeline alone, replicas, or a
``DeviceMesh`` with replicated or FSDP2 data parallelism).  :func:`train_case` runs it on every rank
of a pool and returns, per rank, the worst relative error of the losses, the gradients before each
optimizer step and the parameters after the last one (settled), and the optimizer's counters.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

WIDTH, SEQ, VOCAB, ROWS = 6, 4, 11, 2  # ROWS: sequences per microbatch
#: a pipeline of every rank; two replicas; a mesh with replicated or FSDP2 data parallelism; a mesh with
#: tensor parallelism inside the stages; two pipelines of two ranks on sub-groups of the world
LAYOUTS = ("pp", "replicas", "mesh-replicate", "mesh-fsdp", "mesh-tp", "groups")
OPTIMIZERS = ("sgd", "adam", "adamw")
#: ``zero_grad`` before ``step``; after ``optimizer_step``; or ``pipe.zero_grad(set_to_none=False)`` then
LOOPS = ("zero-first", "zero-after", "zero-in-place")


@dataclass(frozen=True)
class Case:
    """One drawn training configuration (see the module docstring)."""

    schedule: str
    microbatches: int
    blocks: int
    vocab_parallel: bool
    tied: bool
    checkpointing: bool
    optimizer: str
    lr: float
    max_norm: float | None
    post_validation: bool
    loop: str
    layout: str = "pp"
    static_shapes: bool = True
    steps: int = 3
    seed: int = 0
    chunks: int | None = None
    partition: tuple[int, ...] | None = None
    costs: tuple[float, float, float] | None = None  # a CostModel's f, b, w for the builder
    emulate: bool = False  # each op stretched to a tiny modelled duration (milliseconds)
    trace: bool = False
    verify: bool | str = True
    check_calls: bool = True
    renamed_dims: bool = False  # the mesh's dimensions named otherwise, mapped with mesh_dims=
    memory_limit: str | None = None  # schedule="auto" only
    calibrate: int = 3  # schedule="auto" only
    compile: bool = False  # every layer compiled with inductor
    # data_parallel="fsdp" only: FSDPOptions(units, reshard_after_forward, reshard_after_backward,
    # prefetch); None: the once-per-step chunk
    fsdp: tuple[str | int, bool, bool | None, int] | None = None
    # replicated layouts only: FSDPOptions(bucket_bytes=...), the all-reduce's bucket size; None: one a chunk
    bucket_bytes: float | None = None
    overlap: str | None = None  # dualpipe-v only: a user's run of each overlapped F&B pair (OVERLAPS)


class Block(nn.Module):
    """Pre-norm causal mixing and an MLP; optionally under activation checkpointing."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        self.checkpointed = checkpointed
        self.norm = nn.LayerNorm(WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def _body(self, hidden: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(1, hidden.shape[1] + 1, dtype=hidden.dtype).view(1, -1, 1)
        hidden = hidden + self.mix(self.norm(hidden)).cumsum(1) / steps
        return hidden + self.down(torch.tanh(self.up(hidden)))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return checkpoint(self._body, hidden, use_reentrant=False)
        return self._body(hidden)


class Embed(nn.Module):
    """Plain token embedding (the first layer of a model with plain ends)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens)


class Head(nn.Module):
    """Final norm and output projection, its weight tied to the embedding's or its own."""

    def __init__(self, embed: Embed, tied: bool):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        weight = embed.embed.weight
        self.weight = weight if tied else nn.Parameter(weight.detach().clone() * 2.0)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(hidden), self.weight)


def backward_first(pair: Any) -> None:
    """An overlap hook running the backward half first."""
    pair.backward()
    pair.forward()


def by_phases(pair: Any) -> None:
    """An overlap hook interleaving the halves' phases: both receive, F computes, B computes, both send."""
    forward, backward = pair.forward, pair.backward
    backward.receive()
    forward.receive()
    forward.compute()
    backward.compute()
    backward.send()
    forward.send()


#: ``Pipeline(overlap=...)`` by name: the default run of each pair, or a user's hook
OVERLAPS = {None: None, "reversed": backward_first, "phases": by_phases, "threads": "threads"}


def plain_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token-mean cross-entropy of one microbatch (the plain head's ``loss_fn``)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build_model(case: Case) -> dict[str, Any]:
    """``{"layers", "embedding", "head"}`` of the case's model in float64 (ends None when plain)."""
    from zerobubble.runtime.vocab.layers import VocabParallelEmbedding, VocabParallelHead

    torch.manual_seed(case.seed)
    blocks = [Block(case.checkpointing).double() for _ in range(case.blocks)]
    if not case.vocab_parallel:
        embed = Embed().double()
        return {"layers": [embed, *blocks, Head(embed, case.tied).double()], "embedding": None, "head": None}
    embedding = VocabParallelEmbedding(VOCAB, WIDTH, dtype=torch.float64)
    if case.tied:
        head = VocabParallelHead(embedding.weight)
    else:
        head = VocabParallelHead(WIDTH, VOCAB, dtype=torch.float64)
        with torch.no_grad():
            head.weight.mul_(3.0)  # a wide spread of logits
    return {"layers": blocks, "embedding": embedding, "head": head}


def _optimizer(case: Case, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if case.optimizer == "sgd":
        return torch.optim.SGD(params, lr=case.lr, momentum=0.9, weight_decay=0.01)
    if case.optimizer == "adam":
        return torch.optim.Adam(params, lr=case.lr)
    return torch.optim.AdamW(params, lr=case.lr, weight_decay=0.1)


def _batch(case: Case, step: int, replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * case.seed + step)
    size = replicas * case.microbatches * ROWS
    tokens = torch.randint(VOCAB, (size, SEQ), generator=generator)
    labels = torch.randint(VOCAB, (size, SEQ), generator=generator)
    labels[torch.rand(size, SEQ, generator=generator) < 0.15] = -100  # ignored positions
    return tokens, labels


def _unique(modules: list[nn.Module]) -> list[nn.Parameter]:
    return list({id(p): p for m in modules for p in m.parameters()}.values())


class Reference:
    """The unsharded model trained in this process: ``clip_grad_norm_`` + ``step`` on the whole."""

    def __init__(self, case: Case, model: dict[str, Any]):
        self.case, self.model = case, model
        self.modules = [m for m in (model["embedding"], *model["layers"], model["head"]) if m is not None]
        self.params = _unique(self.modules)
        self.optimizer = _optimizer(case, self.params)

    def _loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = tokens if self.model["embedding"] is None else self.model["embedding"](tokens)
        for layer in self.model["layers"]:
            hidden = layer(hidden)
        if self.model["head"] is None:
            return plain_loss(hidden, labels)
        return self.model["head"](hidden, labels)

    def step(self, tokens: torch.Tensor, labels: torch.Tensor, chunks: int) -> float:
        """One training step on the global batch (the mean of ``chunks`` microbatch losses); the
        gradients stay in the parameters until :meth:`update`."""
        losses = [self._loss(t, y) for t, y in zip(tokens.chunk(chunks), labels.chunk(chunks))]
        loss = torch.stack(losses).mean()
        loss.backward()
        return loss.item()

    def update(self) -> None:
        if self.case.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.case.max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


#: Below this norm a tensor's error is measured in its units, not relative to it: a gradient that has
#: vanished (a saturated tanh's, ~1e-14) holds only rounding noise, whose relative error means nothing.
NORM_FLOOR = 1e-6


def _error(actual: torch.Tensor | None, expected: torch.Tensor | None) -> float:
    if actual is None or expected is None:
        return 0.0 if actual is None and expected is None else float("inf")
    actual, expected = _full(actual).detach(), expected.detach()
    return ((actual - expected).norm() / expected.norm().clamp_min(NORM_FLOOR)).item()


def _pairs(pipe: Any, reference: dict[str, Any]) -> list[tuple[Any, Any, slice]]:
    """(pipeline parameter, reference parameter, rows) of every parameter this rank holds."""
    from zerobubble.runtime.vocab.runner import plain_model

    layers = [layer for _, layer in pipe.resolution.layers]  # the layers as the Pipeline cut them
    expected = reference["layers"]
    if len(layers) != len(expected):  # schedule="auto" chose the plain ends: the same model as this
        expected = plain_model(reference["head"], reference["embedding"], expected)[0]
    pairs = []
    for stage in pipe.stages:
        for i in range(pipe.layer_bounds[stage], pipe.layer_bounds[stage + 1]):
            mine = dict(layers[i].named_parameters())
            theirs = dict(expected[i].named_parameters())
            pairs += [(mine[name], theirs[name], slice(None)) for name in mine]
    for end in ("embedding", "head"):
        layer = getattr(pipe.module, f"vocab_{end}", None)
        if layer is not None:
            rows = slice(layer.vocab_start, layer.vocab_stop)
            pairs.append((layer.weight, reference[end].weight, rows))
    return pairs


def _worst(pairs: list[tuple[Any, Any, slice]], grads: bool) -> float:
    worst = 0.0
    for mine, theirs, rows in pairs:
        if grads:
            expected = None if theirs.grad is None else theirs.grad[rows]
            worst = max(worst, _error(mine.grad, expected))
        else:
            worst = max(worst, _error(mine, theirs[rows]))
    return worst


def parallelize(layer: nn.Module, mesh: Any) -> nn.Module:
    """The ``parallelize=`` of the "mesh-tp" layout: each block's MLP Megatron-style on "tp"."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if not isinstance(layer, Block):
        return layer
    tp = "tp" if "tp" in mesh.mesh_dim_names else "inner"  # the renamed dims' name (``renamed_dims``)
    return parallelize_module(layer, mesh[tp], {"up": ColwiseParallel(), "down": RowwiseParallel()})


def _layout_options(case: Case) -> dict[str, Any]:
    """The Pipeline's layout arguments of ``case.layout`` (collective: meshes and sub-groups)."""
    if case.bucket_bytes is not None:
        from zerobubble import FSDPOptions

        bucketed = {"fsdp": FSDPOptions(bucket_bytes=case.bucket_bytes)}
    else:
        bucketed = {}
    if case.layout == "replicas":
        return {"data_parallel": 2, **bucketed}
    if case.layout == "groups":
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both
        return {"group": groups[dist.get_rank() // 2]}
    if not case.layout.startswith("mesh"):
        return {}
    from torch.distributed.device_mesh import init_device_mesh

    second = "tp" if case.layout == "mesh-tp" else "dp"
    names = {"pp": "pipe", second: "inner"} if case.renamed_dims else {"pp": "pp", second: second}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=(names[second], names["pp"]))
    options: dict[str, Any] = {"mesh": mesh, **bucketed}
    if case.renamed_dims:
        options["mesh_dims"] = names
    if case.layout == "mesh-tp":
        options["parallelize"] = parallelize
    else:
        options["data_parallel"] = case.layout.removeprefix("mesh-")
    if case.fsdp is not None:
        from zerobubble import FSDPOptions

        units, after_forward, after_backward, prefetch = case.fsdp
        options["fsdp"] = FSDPOptions(
            units=units,
            reshard_after_forward=after_forward,
            reshard_after_backward=after_backward,
            prefetch=prefetch,
        )
    return options


def _schedule_options(case: Case) -> dict[str, Any]:
    """The arguments that choose and build the schedule."""
    from zerobubble import CostModel

    options: dict[str, Any] = {"schedule": case.schedule, "microbatches": case.microbatches}
    if case.schedule == "auto":
        tokens, labels = _batch(case, 0, 1)
        options.update(example=(tokens, labels), memory_limit=case.memory_limit, calibrate=case.calibrate)
    options.update(chunks=case.chunks, partition=list(case.partition) if case.partition else None)
    if case.costs is not None:
        f, b, w = case.costs
        options["costs"] = CostModel(f=f, b=b, w=w)
    if case.emulate:
        options["emulate"] = CostModel(f=0.2, b=0.2, w=0.1, vocab_s=0.1, vocab_t=0.1)
    return options


def _pipeline(case: Case, model: dict[str, Any]) -> Any:
    from zerobubble import Pipeline

    return Pipeline(
        model["layers"], loss_fn=None if case.vocab_parallel else plain_loss, head=model["head"],
        embedding=model["embedding"], post_validation=case.post_validation,
        static_shapes=case.static_shapes, timeout=300 if case.compile else 60, seed=case.seed,
        trace=case.trace, overlap=OVERLAPS[case.overlap],
        verify=case.verify, check_calls=case.check_calls, compile=case.compile,
        **_schedule_options(case), **_layout_options(case),
    )  # fmt: skip


def train_case(case: Case) -> dict[str, Any]:
    """Train ``case`` on this rank and beside it the reference; the worst errors (module docstring)."""
    model = build_model(case)
    reference = Reference(case, copy.deepcopy(model))
    pipe = _pipeline(case, model)
    pairs = _pairs(pipe, reference.model)
    optimizer = _optimizer(case, list(pipe.parameters()))
    replicas, replica = pipe.layout.grid.dp, pipe.layout.grid.dp_index
    worst = {"loss": 0.0, "grads": 0.0, "params": 0.0}
    for step in range(case.steps):
        tokens, labels = _batch(case, step, replicas)
        expected = reference.step(tokens, labels, replicas * case.microbatches)
        if case.loop == "zero-first":
            optimizer.zero_grad()
        mine = (tokens.chunk(replicas)[replica], labels.chunk(replicas)[replica])
        loss = pipe.step(*mine)
        if loss is not None:
            worst["loss"] = max(worst["loss"], abs(loss.item() - expected) / abs(expected))
        worst["grads"] = max(worst["grads"], _worst(pairs, grads=True))
        pipe.optimizer_step(optimizer, max_norm=case.max_norm)
        if case.loop == "zero-after":
            optimizer.zero_grad()
        elif case.loop == "zero-in-place":  # the pending step's gradients: settled first
            pipe.zero_grad(set_to_none=False)
        reference.update()
    pipe.synchronize()
    worst["params"] = _worst(pairs, grads=False)
    stats = pipe.optimizer_stats
    worst.update(clipped=stats.clipped, rolled_back=stats.rolled_back, steps=stats.steps)
    dist.barrier()  # the next case builds its groups only once every rank is done with these
    return worst


def refusal(case: Case) -> str:
    """The message of the error the Pipeline raises for ``case`` on this rank ("accepted" if none)."""
    from zerobubble.runtime import PipelineError

    try:
        _pipeline(case, build_model(case))
    except PipelineError as error:
        return str(error)
    finally:
        dist.barrier()
    return "accepted"


def zeroed_in_place(case: Case) -> str:
    """Train ``case`` zeroing the gradients in place through the optimizer while a clipped step is
    pending: the error this rank raises (the settle cannot undo a step whose gradients changed).
    Run it on ranks of its own: after a failed step the process groups are not reused."""
    from zerobubble.runtime.launch import init_distributed

    init_distributed(backend="gloo", timeout=60)
    model = build_model(case)
    pipe = _pipeline(case, model)
    optimizer = _optimizer(case, list(pipe.parameters()))
    try:
        for step in range(case.steps):
            pipe.step(*_batch(case, step, 1))
            pipe.optimizer_step(optimizer, max_norm=case.max_norm)
            optimizer.zero_grad(set_to_none=False)
        return "no error"
    except Exception as error:
        return f"{type(error).__name__}: {error}"
