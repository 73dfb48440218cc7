"""The models, batches and step runners the benchmarks share.

A :class:`Workload` is a model (rebuilt afresh, same seed, by ``make_layers``) and one batch: the
MLP and GPT of ``bench pipelines`` (:func:`workload`), the uneven language model of ``bench plan``
(:func:`uneven_lm_workload`) and the tiny layers of the emulated pipelines (:func:`tiny_layers`).
The runners turn a configuration into a zero-argument step: ours (:func:`our_step`), the whole
model in one process (:func:`single_runner`) and a ``torch.distributed.pipelining`` schedule over
the same split (:func:`torch_runner`); :func:`interleaved` times them in rotating rounds.
Building a model seeds torch under :func:`.tables.preserved_torch_state`: the caller's RNG is left as it was.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zerobubble.schedule.partition import even_partition
from zerobubble_demo.models import GPTConfig, MarkovCorpus, gpt_layers, lm_loss

from .tables import preserved_torch_state


def mlp_layers(count: int = 8, width: int = 1024, seed: int = 0) -> list[nn.Module]:
    """``count`` × (Linear(width) + ReLU), one layer per list entry."""
    with preserved_torch_state():
        torch.manual_seed(seed)
        return [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(count)]


def gelu_blocks(count: int, width: int, seed: int = 0) -> list[nn.Module]:
    """``count`` × (Linear(width, 4·width) + GELU + Linear(4·width, width)): a transformer's MLP
    without the residual, one block per list entry (the data-parallel benchmarks' model)."""
    with preserved_torch_state():
        torch.manual_seed(seed)
        return [
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(count)
        ]


def gelu_block_bytes(width: int) -> int:
    """The parameter bytes of one :func:`gelu_blocks` block (float32)."""
    return sum(p.numel() * p.element_size() for p in gelu_blocks(1, width)[0].parameters())


def bench_gpt_config() -> GPTConfig:
    """The GPT of the pipeline comparison: 8 blocks of width 128 on sequences of 64 tokens."""
    return GPTConfig(vocab=256, seq_len=64, dim=128, heads=4, n_layers=8)


@dataclass(frozen=True)
class Workload:
    """A model and one batch: ``make_layers()`` builds it afresh (same seed), ``batch`` feeds it."""

    name: str
    make_layers: Callable[[], list[nn.Module]]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    batch: tuple[torch.Tensor, torch.Tensor]


def workload(name: str, microbatches: int, rows: int) -> Workload:
    """``mlp`` (rows of width 1024 per microbatch) or ``gpt`` (rows = sequences per microbatch)."""
    generator = torch.Generator().manual_seed(1)
    if name == "mlp":
        batch = (
            torch.randn(microbatches * rows, 1024, generator=generator),
            torch.randn(microbatches * rows, 1024, generator=generator),
        )
        return Workload("MLP 8×Linear(1024)+ReLU", mlp_layers, F.mse_loss, batch)
    config = bench_gpt_config()
    return _gpt_workload(
        f"GPT {config.n_layers}×block d={config.dim} seq={config.seq_len}", config, microbatches * rows
    )


def _gpt_workload(label: str, config: GPTConfig, sequences: int) -> Workload:
    """A GPT (weights from seed 0) and a batch of ``sequences`` from the Markov corpus (seed 1)."""
    corpus = MarkovCorpus(config.vocab, config.seq_len, seed=1)

    def layers() -> list[nn.Module]:
        with preserved_torch_state():
            torch.manual_seed(0)
            return gpt_layers(config)

    return Workload(label, layers, lm_loss, corpus.batch(sequences))


def bench_partition(model: str, count: int, chunks: int) -> list[int]:
    """Where chunks 1..chunks−1 start: for the GPT an equal number of blocks per chunk (the light
    embedding rides with the first, the head with the last), so every rank of a V gets equal work;
    for the MLP an even split."""
    if model != "gpt":
        return even_partition(count, chunks)
    blocks = count - 2
    return [1 + cut for cut in even_partition(blocks, chunks)]


def uneven_lm_config() -> GPTConfig:
    """The uneven language model of ``bench plan``: a 16k-token vocabulary, six blocks of width 256."""
    return GPTConfig(vocab=16384, seq_len=64, dim=256, heads=4, n_layers=6)


def uneven_lm_workload(microbatches: int, rows: int) -> Workload:
    """The uneven LM with a batch of ``microbatches · rows`` sequences."""
    config = uneven_lm_config()
    label = f"LM vocab {config.vocab}, {config.n_layers}×block d={config.dim} seq={config.seq_len}"
    return _gpt_workload(label, config, microbatches * rows)


def tiny_layers(count: int, width: int = 8) -> list[nn.Module]:
    """``count`` small Linear + Tanh layers: real tensors to pass around at negligible compute cost."""
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(count)]


# -- runners: one zero-argument step function per configuration -------------------------------------

OUR_SCHEDULES = ("1f1b", "zb-h1", "zb-2p", "zb-v")
TORCH_SCHEDULES = ("Schedule1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble")


def our_step(pipe, batch) -> Callable[[], None]:
    def step() -> None:
        pipe.step(*batch)
        pipe.zero_grad()

    return step


def single_runner(load: Workload, m: int) -> Callable[[], None]:
    """The whole model in this process, microbatch by microbatch (same matmul shapes), gradients summed."""
    model = nn.Sequential(*load.make_layers())
    inputs, targets = (t.chunk(m) for t in load.batch)

    def step() -> None:
        for x, y in zip(inputs, targets):
            (load.loss_fn(model(x), y) / m).backward()
        model.zero_grad(set_to_none=True)

    return step


def halves_runner(model: str, load: Workload, m: int) -> Callable[[], None]:
    """This rank's layers under zb-v's placement (chunks ``r`` and ``2·world−1−r``) run forward and
    backward on its own microbatches, no transfers: both ranks at once, the machine's own floor.

    The layers, rows and gradients are the pipeline's: the first chunk's input needs no gradient,
    the rank holding the last chunk computes the loss, the other backpropagates a random gradient.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    layers = load.make_layers()
    bounds = [0, *bench_partition(model, len(layers), 2 * world), len(layers)]
    chunks = [rank, 2 * world - 1 - rank]
    half = nn.Sequential(*(layer for c in chunks for layer in layers[bounds[c] : bounds[c + 1]]))
    inputs, targets = (t.chunk(m) for t in load.batch)
    holds_last = 2 * world - 1 in chunks
    hidden: list[torch.Tensor] = []  # a middle rank's inputs: hidden states of the model
    if not holds_last:
        with torch.no_grad():
            hidden = [layers[0](x) for x in inputs]
    grads = [torch.randn_like(h) for h in hidden]

    def step() -> None:
        if holds_last:
            for x, y in zip(inputs, targets):
                (load.loss_fn(half(x), y) / m).backward()
        else:
            for h, g in zip(hidden, grads):
                half(h.detach().requires_grad_()).backward(g)
        half.zero_grad(set_to_none=True)

    return step


def torch_runner(name: str, model: str, load: Workload, m: int) -> Callable[[], None]:
    """A torch.distributed.pipelining schedule over the same split as ours (V order for ZBV)."""
    from torch.distributed.pipelining import PipelineStage, schedules

    rank, world = dist.get_rank(), dist.get_world_size()
    layers = load.make_layers()
    chunks = 2 * world if name == "ScheduleZBVZeroBubble" else world
    bounds = [0, *bench_partition(model, len(layers), chunks), len(layers)]
    if name == "ScheduleZBVZeroBubble":
        indices = [rank, 2 * world - 1 - rank]
    else:
        indices = [rank]
    stages = [
        PipelineStage(nn.Sequential(*layers[bounds[i] : bounds[i + 1]]), i, chunks, torch.device("cpu"))
        for i in indices
    ]
    schedule_class = getattr(schedules, name)
    schedule = schedule_class(
        stages if len(stages) > 1 or name != "Schedule1F1B" else stages[0],
        n_microbatches=m,
        loss_fn=load.loss_fn,
    )
    holds_first = 0 in indices
    holds_last = chunks - 1 in indices
    inputs, targets = load.batch
    modules = [stage.submod for stage in stages]

    def step() -> None:
        args = (inputs,) if holds_first else ()
        kwargs = {"target": targets, "losses": []} if holds_last else {}
        schedule.step(*args, **kwargs)
        for module in modules:
            module.zero_grad(set_to_none=True)

    return step


def interleaved(
    runners: dict[str, Callable[[], None]], rounds: int, steps: int, warmup: int, settle: int = 1
) -> dict[str, list[float]]:
    """Per configuration, the step times (barrier to barrier) of ``rounds`` rotating rounds.

    Each configuration first runs ``warmup`` untimed steps; then, in every round, ``settle`` untimed
    steps before its ``steps`` timed ones.  Why settle: the configurations share each rank's caches
    and allocator, so the first step after switching from another configuration finds none of its
    own weights cached (a training job runs one configuration all along: its steps are warm).
    """
    names = list(runners)
    for name in names:
        for _ in range(warmup):
            _timed(runners[name])
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            for _ in range(settle):
                _timed(runners[name])
            for _ in range(steps):
                times[name].append(_timed(runners[name]))
    return times


def _timed(step: Callable[[], None]) -> float:
    dist.barrier()
    started = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - started
