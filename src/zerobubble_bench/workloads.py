"""Benchmarks of the runtime: library code behind ``benchmarks/*.py`` and ``zerobubble bench``.

* :func:`compare_pipelines` — our schedules against ``torch.distributed.pipelining``'s on the same
  model, split, batch and microbatches, on real ranks; also the single-process step.
* :func:`wgrad_split_cost` — ``T_B + T_W`` of the B/W split against the fused backward of one stage.
* :func:`emulated_pipelines` — the real runtime with emulated compute (:mod:`.runtime.emulate`) on
  ``p`` ranks: measured against predicted iteration time for every schedule.

Every benchmark measures its configurations side by side in one run, round by round in rotating
order (so machine drift and other load hit all of them alike) and reports medians and ratios.
Each returns a :class:`Table`; :meth:`Table.markdown` renders it for the README together with the
machine it ran on (:func:`machine_description`).
"""

from __future__ import annotations

import ctypes
import gc
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .models import Block, GPTConfig, MarkovCorpus, gpt_layers, lm_loss
from .runtime.launch import init_distributed, launch
from .runtime.pipeline import Pipeline, even_partition
from .schedule import REGISTRY, CostModel, build_schedule, simulate


@dataclass
class Table:
    """A titled table of benchmark results (cells already formatted) and notes below it."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        """The table as GitHub Markdown."""
        lines = [
            f"### {self.title}",
            "",
            "| " + " | ".join(self.columns) + " |",
            "|" + "|".join("---" for _ in self.columns) + "|",
        ]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        if self.notes:
            lines += ["", *self.notes]
        return "\n".join(lines)


def machine_description() -> str:
    """One line naming the machine, for the tables: CPU model, cores, load, torch version."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    except OSError:
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return (
        f"{cpu}, {os.cpu_count()} cores, load average {load} at start, torch {torch.__version__}, "
        f"Python {platform.python_version()}"
    )


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


# -- models ------------------------------------------------------------------------------------------


def mlp_layers(count: int = 8, width: int = 1024, seed: int = 0) -> list[nn.Module]:
    """``count`` × (Linear(width) + ReLU), one layer per list entry."""
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(count)]


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
    corpus = MarkovCorpus(config.vocab, config.seq_len, seed=1)

    def layers() -> list[nn.Module]:
        torch.manual_seed(0)
        return gpt_layers(config)

    label = f"GPT {config.n_layers}×block d={config.dim} seq={config.seq_len}"
    return Workload(label, layers, lm_loss, corpus.batch(microbatches * rows))


def bench_partition(model: str, count: int, chunks: int) -> list[int]:
    """Where chunks 1..chunks−1 start: for the GPT an equal number of blocks per chunk (the light
    embedding rides with the first, the head with the last), so every rank of a V gets equal work;
    for the MLP an even split."""
    if model != "gpt":
        return even_partition(count, chunks)
    blocks = count - 2
    return [1 + cut for cut in even_partition(blocks, chunks)]


# -- 1. our schedules against torch.distributed.pipelining ------------------------------------------

OUR_SCHEDULES = ("1f1b", "zb-h1", "zb-2p", "zb-v")
TORCH_SCHEDULES = ("Schedule1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble")


def compare_pipelines(
    models: Sequence[str] = ("mlp", "gpt"),
    microbatches: int = 8,
    rows: dict[str, int] | None = None,
    rounds: int = 5,
    steps_per_round: int = 2,
    warmup: int = 2,
) -> list[Table]:
    """Step time of our schedules, torch's and the single-process step on 2 CPU ranks (gloo, 1 thread).

    ``rows`` per model is the microbatch size (MLP rows, GPT sequences).  One table per model.
    """
    rows = rows or {"mlp": 32, "gpt": 4}
    results = launch(
        _compare_rank, 2, (tuple(models), microbatches, rows, rounds, steps_per_round, warmup), threads=1
    )[0]
    return [_comparison_table(model, microbatches, rows[model], times) for model, times in results.items()]


def _compare_rank(
    models, microbatches, rows, rounds, steps_per_round, warmup
) -> dict[str, dict[str, list[float]]]:
    init_distributed(backend="gloo", timeout=300)
    results = {}
    for model in models:
        load = workload(model, microbatches, rows[model])
        runners = _pipeline_runners(model, load, microbatches)
        results[model] = _interleaved(runners, rounds, steps_per_round, warmup)
    return results


def _pipeline_runners(model: str, load: Workload, m: int) -> dict[str, Callable[[], None]]:
    """One zero-argument step function per configuration, all on the same model, split and batch."""
    count = len(load.make_layers())
    runners: dict[str, Callable[[], None]] = {"single process": _single_runner(load, m)}
    for name in OUR_SCHEDULES:
        chunks = 4 if name == "zb-v" else 2
        pipe = Pipeline(
            load.make_layers(),
            schedule=name,
            microbatches=m,
            loss_fn=load.loss_fn,
            partition=bench_partition(model, count, chunks),
            timeout=300,
        )
        runners[f"ours {name}"] = _our_step(pipe, load.batch)
    for name in TORCH_SCHEDULES:
        runners[f"torch {name}"] = _torch_runner(name, model, load, m)
    return runners


def _our_step(pipe, batch) -> Callable[[], None]:
    def step() -> None:
        pipe.step(*batch)
        pipe.zero_grad()

    return step


def _single_runner(load: Workload, m: int) -> Callable[[], None]:
    """The whole model in this process, microbatch by microbatch (same matmul shapes), gradients summed."""
    model = nn.Sequential(*load.make_layers())
    inputs, targets = (t.chunk(m) for t in load.batch)

    def step() -> None:
        for x, y in zip(inputs, targets):
            (load.loss_fn(model(x), y) / m).backward()
        model.zero_grad(set_to_none=True)

    return step


def _torch_runner(name: str, model: str, load: Workload, m: int) -> Callable[[], None]:
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


def _interleaved(
    runners: dict[str, Callable[[], None]], rounds: int, steps: int, warmup: int
) -> dict[str, list[float]]:
    """Per configuration, the step times (barrier to barrier) of ``rounds`` rotating rounds."""
    names = list(runners)
    for name in names:
        for _ in range(warmup):
            _timed(runners[name])
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            for _ in range(steps):
                times[name].append(_timed(runners[name]))
    return times


def _timed(step: Callable[[], None]) -> float:
    dist.barrier()
    started = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - started


def _comparison_table(model: str, m: int, rows: int, times: dict[str, list[float]]) -> Table:
    single = _median(times["single process"])
    limit = single / 2
    reference = _median(times["torch Schedule1F1B"])
    table = Table(
        f"{workload(model, m, rows).name}: step time on 2 CPU ranks, {m} microbatches of {rows} "
        f"{'rows' if model == 'mlp' else 'sequences'}",
        ["configuration", "median step (ms)", "× 2-rank limit", "× torch 1F1B", "steps"],
    )
    for name, values in times.items():
        median = _median(values)
        table.rows.append(
            [
                name,
                f"{median * 1e3:.1f}",
                f"{median / limit:.3f}",
                f"{median / reference:.3f}",
                str(len(values)),
            ]
        )
    table.notes.append(
        "2-rank limit = half the single-process step (same microbatches, one thread). "
        "Step = barrier to barrier, backward and zero_grad included, no optimizer. "
        "Configurations measured in rotating rounds."
    )
    return table


# -- 2. the cost of the B/W split --------------------------------------------------------------------


def wgrad_split_cost(
    rows_list: Sequence[int] = (8, 32, 128, 512),
    repeats: int = 15,
    threads: int = 1,
    accumulate: bool = True,
    device: str = "cpu",
    modes: Sequence[str] = ("fast paths", "generic only", "torch pipelining"),
) -> Table:
    """``T_B + T_W`` of the B/W split against the fused backward, per stage, split and microbatch size.

    Stages: 4 × (Linear(1024) + ReLU) of the MLP, one GPT block (width 256, ``rows`` tokens) and two
    Conv2d(32, 3×3) + BatchNorm2d + ReLU blocks (``rows`` images of 8×8).  Splits: ``fast paths``
    (the default registry), ``generic only`` (an empty registry: every module through the generic
    split) and ``torch pipelining`` (``stage_backward_input``/``stage_backward_weight`` of
    ``torch.distributed.pipelining``, for reference).  Fused and split backwards alternate within
    each repeat; medians are reported.  With ``accumulate`` gradients add into existing ``.grad``
    tensors (every microbatch of a step but the first); without, ``.grad`` is reset before each
    repeat (a step's first microbatch).
    """
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda needs a CUDA GPU, and torch.cuda.is_available() is False here")
    torch.set_num_threads(threads)
    if device == "cpu":
        _keep_freed_memory()
    regime = "accumulating into .grad" if accumulate else "fresh .grad (first microbatch)"
    where = f"{threads} thread" if device == "cpu" else device
    table = Table(
        f"B/W split cost (single process, {where}, {regime})",
        ["stage", "split", "rows", "fused backward (ms)", "T_B (ms)", "T_W (ms)", "(T_B+T_W)/fused"],
    )
    for label, make, shape in _split_stages():
        for mode in modes:
            for rows in rows_list:
                fused, split_b, split_w, ratio = _split_times(
                    make, shape(rows), repeats, accumulate, mode, torch.device(device)
                )
                table.rows.append(
                    [
                        label,
                        mode,
                        str(rows),
                        f"{fused * 1e3:.3f}",
                        f"{split_b * 1e3:.3f}",
                        f"{split_w * 1e3:.3f}",
                        f"{ratio:.3f}",
                    ]
                )
    table.notes.append(
        f"Medians of {repeats} repeats after one warm-up; the ratio is the median of each repeat's "
        "ratio (fused and split measured back to back). CPU: thread CPU time (load from other "
        "processes does not count), glibc keeps freed memory as a caching allocator would. Goals at "
        "≥ 32 rows: ≤ 1.05 for fast paths, ≤ 1.15 for the generic split. Conv rows are 8×8 images."
    )
    return table


def _keep_freed_memory() -> None:
    """Tell glibc's malloc to keep freed memory for reuse, as a caching allocator (CUDA's) does.

    Otherwise whether a fresh ``.grad`` costs page faults depends on which backward happened to
    free or trim memory last, and that order differs between the fused and the split backward.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: do not return the heap's top to the system
    libc.mallopt(-3, 1 << 25)  # M_MMAP_THRESHOLD (its maximum): serve tensors below 32 MiB from the heap


def _split_stages():
    def mlp() -> nn.Module:
        return nn.Sequential(*mlp_layers(4))

    def block() -> nn.Module:
        torch.manual_seed(0)
        return Block(GPTConfig(vocab=16, seq_len=512, dim=256, heads=4, n_layers=1))

    def conv() -> nn.Module:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(2):
            layers += [nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU()]
        return nn.Sequential(*layers)

    return [
        ("MLP 4×Linear(1024)", mlp, lambda rows: (rows, 1024)),
        ("GPT block d=256", block, lambda rows: (1, rows, 256)),
        ("2×(Conv2d+BatchNorm2d) c=32", conv, lambda rows: (rows, 32, 8, 8)),
    ]


class _SplitBackward:
    """One way of running a split backward: ``input_pass(out, grad)`` then ``weight_pass()``."""

    def __init__(self, module: nn.Module, mode: str, x: torch.Tensor):
        from .runtime.wgrad import FastPaths, WeightGradStore, install_deferral

        self.module, self.mode, self.x = module, mode, x
        self.store = WeightGradStore()
        self._groups: Any = None
        if mode != "torch pipelining":
            install_deferral([module], self.store, None if mode == "fast paths" else FastPaths())

    def input_pass(self, out: torch.Tensor, grad: torch.Tensor) -> None:
        if self.mode == "torch pipelining":
            from torch.distributed.pipelining._backward import stage_backward_input

            _, self._groups = stage_backward_input([out], [grad], [self.x], self.module.parameters())
            return
        self.store.begin((0, 0), True)
        out.backward(grad)
        self.store.end()

    def weight_pass(self) -> None:
        if self.mode == "torch pipelining":
            from torch.distributed.pipelining._backward import stage_backward_weight

            stage_backward_weight(self.module.parameters(), self._groups)
            return
        self.store.flush((0, 0))


def _split_times(
    make: Callable[[], nn.Module],
    shape: tuple[int, ...],
    repeats: int,
    accumulate: bool,
    mode: str,
    device: torch.device,
) -> tuple[float, float, float, float]:
    """Medians of the fused backward, T_B and T_W (seconds) and of the per-repeat (T_B+T_W)/fused."""
    fused_module, split_module = make().to(device), make().to(device)
    x = torch.randn(*shape, device=device, requires_grad=True)
    split = _SplitBackward(split_module, mode, x)
    # CPU: the thread's CPU time (the torch ops of one thread run on it, backward included), which
    # other processes on a shared machine do not inflate; CUDA: wall time around synchronisations
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock = time.perf_counter if device.type == "cuda" else time.thread_time
    fused, split_b, split_w = [], [], []
    for repeat in range(repeats + 1):
        out = fused_module(x)
        grad = torch.ones_like(out)
        sync()
        started = clock()
        out.backward(grad)
        sync()
        elapsed_fused = clock() - started
        out = split_module(x)
        sync()
        started = clock()
        split.input_pass(out, grad)
        sync()
        middle = clock()
        split.weight_pass()
        sync()
        ended = clock()
        if repeat:  # the first repeat warms up (and creates the .grad tensors later repeats accumulate into)
            fused.append(elapsed_fused)
            split_b.append(middle - started)
            split_w.append(ended - middle)
        if not accumulate:
            fused_module.zero_grad(set_to_none=True)
            split_module.zero_grad(set_to_none=True)
        x.grad = None
    # the ratio of each repeat's adjacent measurements: drift in the machine's speed cancels out
    ratios = [(b + w) / f for f, b, w in zip(fused, split_b, split_w)]
    return _median(fused), _median(split_b), _median(split_w), _median(ratios)


# -- 2b. real models through the split: the share of W in each stage's backward -------------------

SPLIT_MODELS = ("gpt2", "llama", "convnet", "checkpointed")
"""Models the B/W split is checked on: transformers GPT-2 and Llama, a BatchNorm conv net, and
transformer blocks under activation checkpointing (``use_reentrant=False``)."""


@dataclass
class SplitModel:
    """Layers of a model, its loss and one batch (inputs, targets) to pipeline."""

    layers: list[nn.Module]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    inputs: torch.Tensor
    targets: torch.Tensor


def split_model(name: str, width: int = 16, batch: int = 8, seq: int = 8, seed: int = 0) -> SplitModel:
    """``name`` (one of :data:`SPLIT_MODELS`) with random weights (``seed``) and a random batch.

    Two blocks between an embedding and a head (4 layers, enough for 2 ranks × 2 chunks); ``width``
    is the hidden size (channels for the conv net), ``seq`` the sequence length (image side).
    GPT-2 and Llama need ``transformers`` (random configs: nothing is downloaded).
    """
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    vocab = 32
    tokens = torch.randint(vocab, (batch, seq), generator=generator)
    targets = torch.randint(vocab, (batch, seq), generator=generator)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        from .hf import gpt2_layers

        gpt2 = GPT2Config(
            vocab_size=vocab, n_positions=seq, n_embd=width, n_layer=2, n_head=2, tie_word_embeddings=False,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return SplitModel(gpt2_layers(GPT2LMHeadModel(gpt2)), lm_loss, tokens, targets)
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        from .hf import llama_layers

        llama = LlamaConfig(
            vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=seq,
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
        return SplitModel(llama_layers(LlamaForCausalLM(llama)), lm_loss, tokens, targets)
    if name == "convnet":
        images = torch.randn(batch, 3, seq, seq, generator=generator)
        labels = torch.randint(10, (batch,), generator=generator)
        layers = [_conv_bn(3, width), _conv_bn(width, width), _conv_bn(width, width), _ConvHead(width, 10)]
        return SplitModel(layers, F.cross_entropy, images, labels)
    if name == "checkpointed":
        config = GPTConfig(vocab=vocab, seq_len=seq, dim=width, heads=2, n_layers=2)
        embedding, *blocks, head = gpt_layers(config)
        return SplitModel([embedding, *(_Checkpointed(b) for b in blocks), head], lm_loss, tokens, targets)
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(SPLIT_MODELS)}")


def _conv_bn(channels_in: int, channels_out: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(channels_in, channels_out, 3, padding=1), nn.BatchNorm2d(channels_out), nn.ReLU()
    )


class _ConvHead(nn.Module):
    """Global average pooling, a learned per-channel scale and a linear classifier.

    The scale is the head's own parameter, so the head takes the generic split (around its
    fast-path ``fc``): the real-model tests cover that path too.
    """

    def __init__(self, channels: int, classes: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(channels))
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)) * self.scale)


class _Checkpointed(nn.Module):
    """A block whose activations are recomputed in the backward (``use_reentrant=False``)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, use_reentrant=False)


def w_shares(
    models: Sequence[str] = SPLIT_MODELS,
    width: int = 256,
    seq: int = 64,
    microbatches: int = 8,
    steps: int = 5,
    schedule: str = "zb-h1",
) -> Table:
    """Measured ``T_W / (T_B + T_W)`` per stage of each model on 2 ranks.

    A stage whose parameters all get their gradients in B shows a share near 0; a Linear-dominated
    stage near 0.5 (W is as many FLOPs as the input gradient).  Two measurements: the op times of
    ``Pipeline(trace=True)`` (wall clock), and the same ops timed by each rank's thread CPU time,
    which load from other processes does not inflate.
    """
    arguments = (list(models), width, seq, microbatches, steps, schedule)
    results = launch(_w_share_rank, 2, arguments, threads=1)[0]
    table = Table(
        f"W share of the backward per stage: {schedule}, 2 CPU ranks, {microbatches} microbatches, "
        f"width {width}, sequence {seq}",
        [
            "model",
            "stage 0 (trace=True)",
            "stage 1 (trace=True)",
            "stage 0 (CPU time)",
            "stage 1 (CPU time)",
            "T_B + T_W per microbatch, stage 0 / 1 (ms)",
        ],
    )
    for name, (shares, totals, cpu_shares) in results.items():
        table.rows.append(
            [
                name,
                *(f"{share:.3f}" for share in shares),
                *(f"{share:.3f}" for share in cpu_shares),
                " / ".join(f"{t * 1e3:.1f}" for t in totals),
            ]
        )
    table.notes.append(
        f"W share = sum of W op times / sum of B and W op times of the stage over steps 2..{steps}, "
        "1 thread per rank. trace=True: wall-clock op times recorded by Pipeline(trace=True), which "
        f"load from other processes on a shared machine makes noisy; CPU time: {steps - 1} more steps "
        "with each op timed by its rank's thread CPU time."
    )
    return table


class _CpuTimeRecorder:
    """A Pipeline recorder timing each op by the rank's thread CPU time, summed per (stage, kind)."""

    clock = staticmethod(time.thread_time)

    def __init__(self) -> None:
        self.totals: dict[tuple[int, Any], float] = {}

    def op(self, op: Any, start: float, end: float) -> None:
        key = (op.stage, op.kind)
        self.totals[key] = self.totals.get(key, 0.0) + end - start

    def wait(self, key: Any, start: float, end: float) -> None:
        """Transfer waits are not compute: ignored."""


def _w_share_rank(
    models: list[str], width: int, seq: int, microbatches: int, steps: int, schedule: str
) -> dict[str, Any]:
    from .schedule.ir import Kind

    init_distributed(backend="gloo", timeout=120)
    shares = {}
    for name in models:
        side = min(seq, 16)  # conv net images: 16×16 (at 64×64 a microbatch takes half a second)
        model = split_model(name, width=width, batch=2 * microbatches, seq=side if name == "convnet" else seq)
        pipe = Pipeline(
            model.layers, schedule=schedule, microbatches=microbatches, loss_fn=model.loss_fn, trace=True
        )
        for _ in range(steps):
            pipe.step(model.inputs, model.targets)
            pipe.zero_grad()
        timelines = pipe.measured_timelines()
        cpu = _CpuTimeRecorder()
        pipe.recorder = cpu
        for _ in range(steps - 1):
            pipe.step(model.inputs, model.targets)
            pipe.zero_grad()
        local = [(cpu.totals.get((s, Kind.B), 0.0), cpu.totals.get((s, Kind.W), 0.0)) for s in pipe.stages]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        if timelines is not None:
            cpu_shares = [w / (b + w) if b + w else 0.0 for rank in gathered for b, w in rank]
            shares[name] = (*_stage_w_share(timelines[1:] or timelines, microbatches), cpu_shares)
    return shares


def _stage_w_share(timelines: Sequence[Any], microbatches: int) -> tuple[list[float], list[float]]:
    """Per stage: W share, and ``(T_B + T_W)`` per microbatch, summed over measured steps."""
    from .schedule.ir import Kind

    times: dict[int, dict[Kind, float]] = {}
    for timeline in timelines:
        for rank, program in enumerate(timeline.schedule.programs):
            for op, start, end in zip(program, timeline.start[rank], timeline.end[rank]):
                per_kind = times.setdefault(op.stage, {})
                per_kind[op.kind] = per_kind.get(op.kind, 0.0) + end - start
    stages = sorted(times)
    backward = [times[s].get(Kind.B, 0.0) + times[s].get(Kind.W, 0.0) for s in stages]
    shares = [times[s].get(Kind.W, 0.0) / total if total else 0.0 for s, total in zip(stages, backward)]
    return shares, [total / (microbatches * len(timelines)) for total in backward]


# -- 3. emulated pipelines ---------------------------------------------------------------------------

EMULATED_COSTS = CostModel(f=10.0, b=10.0, w=7.0)
"""Milliseconds per rank-stage for the emulated pipelines (W a bit cheaper than F and B, as in the paper)."""


def emulated_schedules() -> list[str]:
    """Every registry schedule the emulation benchmark runs (the ILP is left out: it needs a solver run)."""
    return [name for name in REGISTRY if name not in ("zb-ilp", "zb-auto")]


def emulated_pipelines(
    ranks: int,
    microbatches: int | None = None,
    costs: CostModel = EMULATED_COSTS,
    steps: int = 4,
    schedules: Sequence[str] | None = None,
) -> Table:
    """Measured (emulated compute) against predicted iteration time of every schedule on ``ranks`` ranks."""
    m = microbatches or 2 * ranks
    names = list(schedules or emulated_schedules())
    results = launch(_emulate_rank, ranks, (names, m, costs, steps), threads=1)[0]
    table = Table(
        f"Emulated compute on {ranks} ranks, {m} microbatches, "
        f"F/B/W = {costs.f}/{costs.b}/{costs.w} ms per rank-stage",
        [
            "schedule",
            "predicted (ms)",
            "measured (ms)",
            "measured / predicted",
            "predicted with measured T_comm (ms)",
            "measured / that",
            "predicted bubble",
            "measured bubble",
        ],
    )
    latencies = []
    for name in names:
        outcome = results[name]
        if isinstance(outcome, str):
            table.rows.append([name, "—", "—", outcome, "—", "—", "—", "—"])
            continue
        predicted, measured, with_comm, latency, predicted_bubble, measured_bubble = outcome
        latencies.append(latency)
        table.rows.append(
            [
                name,
                f"{predicted * 1e3:.1f}",
                f"{measured * 1e3:.1f}",
                f"{measured / predicted:.4f}",
                f"{with_comm * 1e3:.1f}",
                f"{measured / with_comm:.4f}",
                f"{predicted_bubble:.1%}",
                f"{measured_bubble:.1%}",
            ]
        )
    table.notes.append(
        f"Measured = median over {steps} steps (after one warm-up step) of the recorded iteration time "
        "(max over ranks of first-op start to last-op end); predicted = simulate(schedule, costs) with "
        "T_comm = 0, and again with T_comm = the median measured transfer latency of that schedule's run "
        "(producer's end to the waiting consumer's wake-up; median over schedules "
        f"{_median(latencies) * 1e3:.2f} ms). Real 8-wide tensors cross real gloo channels; each op sleeps "
        "to its modelled duration."
    )
    return table


def _emulate_rank(names: list[str], m: int, costs: CostModel, steps: int) -> dict[str, Any]:
    from .runtime.emulate import tiny_layers
    from .runtime.trace import median_timeline, transfer_latencies

    init_distributed(backend="gloo", timeout=300)
    ranks = dist.get_world_size()
    generator = torch.Generator().manual_seed(0)
    batch = (torch.randn(m * 2, 8, generator=generator), torch.randn(m * 2, 8, generator=generator))
    results: dict[str, Any] = {}
    for name in names:
        try:
            schedule = build_schedule(
                name, ranks, m, costs=costs, chunks=2 if name == "interleaved-1f1b" else None
            )
        except Exception as error:
            results[name] = f"not built: {error}"[:60]
            continue
        pipe = Pipeline(
            tiny_layers(ranks * schedule.chunks),
            schedule=schedule,
            loss_fn=F.mse_loss,
            timeout=300,
            trace=True,
            emulate=costs,
        )
        for _ in range(steps + 1):
            pipe.step(*batch)
            pipe.zero_grad()
        timelines = pipe.measured_timelines()
        if timelines is not None:
            measured = median_timeline(timelines[1:])
            predicted = simulate(schedule, costs)
            latency = _median([x for t in timelines[1:] for x in transfer_latencies(t)] or [0.0])
            with_comm = simulate(schedule, costs.replace(comm=latency * 1e3))
            results[name] = (
                predicted.iteration_time / 1e3,
                measured.iteration_time,
                with_comm.iteration_time / 1e3,
                latency,
                predicted.bubble_rate,
                1.0 - predicted.ideal / 1e3 / measured.iteration_time,
            )
    return results


# -- schedulers --------------------------------------------------------------------------------------

#: The builders ``zerobubble bench schedulers`` times by default.
BENCH_SCHEDULERS = ("zb-1p", "zb-2p", "zb-v", "v-half", "v-min")


def scheduler_build_times(
    stages: int = 32,
    microbatches: int = 256,
    rounds: int = 3,
    schedules: Sequence[str] = BENCH_SCHEDULERS,
    costs: CostModel | None = None,
) -> Table:
    """Wall time of building each schedule (median over ``rounds``, rotating order), and of
    validating it, with the iteration time and bubble rate of what was built.

    ``costs`` defaults to the paper's profiled 28.3B costs (Table 5), the setup of the speed goal.
    """
    from .schedule import validate_schedule
    from .schedule.paper import paper_setup

    if costs is None:
        costs = paper_setup("28.3B").costs
    build: dict[str, list[float]] = {name: [] for name in schedules}
    check: dict[str, list[float]] = {name: [] for name in schedules}
    results: dict[str, tuple[float, float, str]] = {}
    for round_index in range(rounds):
        shift = round_index % len(schedules)
        for name in [*schedules[shift:], *schedules[:shift]]:
            gc.collect()  # the previous schedule's garbage is not this one's cost
            started = time.perf_counter()
            schedule = build_schedule(name, stages, microbatches, costs, validate=False)
            build[name].append(time.perf_counter() - started)
            started = time.perf_counter()
            timeline = validate_schedule(schedule, REGISTRY[name].resolve_costs(costs, stages))
            check[name].append(time.perf_counter() - started)
            variant = str(schedule.meta.get("variant", ""))
            results[name] = (timeline.iteration_time, timeline.bubble_rate, variant)
            del schedule, timeline
    table = Table(
        f"Build time of the schedulers, p = {stages}, m = {microbatches}",
        ["schedule", "build (s, median)", "validate (s, median)", "iteration time", "bubble", "winner"],
    )
    for name in schedules:
        iteration_time, bubble_rate, variant = results[name]
        table.rows.append(
            [
                name,
                f"{_median(build[name]):.3f}",
                f"{_median(check[name]):.3f}",
                f"{iteration_time:.6g}",
                f"{bubble_rate:.4f}",
                variant,
            ]
        )
    table.notes.append(
        f"{rounds} rounds in rotating order; build = `build_schedule(..., validate=False)`; "
        "validate = `validate_schedule` of the result."
    )
    return table


def schedulers_against_authors() -> Table:
    """Our zb-v, v-half and v-min against the authors' own schedulers on the paper's Table 5
    setups: iteration time over theirs (< 1 is faster) and both bubble rates."""
    from .schedule.paper import authors_reference, paper_rows

    names = ("zb-v", "v-half", "v-min")
    references = {name: authors_reference(name) for name in names}
    columns = ["setup"]
    for name in names:
        columns += [f"{name} ours / theirs", f"{name} bubble ours (theirs)"]
    table = Table("Our V schedules against the authors' on the paper's Table 5 setups", columns)
    for row in paper_rows():
        p, m, costs = row.stages, row.microbatches, row.costs
        cells = [f"{row.model} p{p} m{m}"]
        for name in names:
            timeline = simulate(build_schedule(name, p, m, costs), costs)
            theirs = references[name][(row.model, m)]
            ideal = timeline.ideal
            cells += [
                f"{timeline.iteration_time / theirs:.4f}",
                f"{timeline.bubble_rate:.4f} ({1 - ideal / theirs:.4f})",
            ]
        table.rows.append(cells)
    table.notes.append(
        "Theirs: the authors' public ZB-V heuristic, and their V-Half / V-Min orders timed by our "
        "simulator, under the same costs and memory limits (`src/zerobubble/data/authors_*.json`)."
    )
    return table


# -- 4. schedule="auto" against hand-picked schedules -------------------------------------------------


def uneven_lm_config() -> GPTConfig:
    """The uneven language model of ``bench plan``: a 16k-token vocabulary, six blocks of width 256."""
    return GPTConfig(vocab=16384, seq_len=64, dim=256, heads=4, n_layers=6)


def uneven_lm_workload(microbatches: int, rows: int) -> Workload:
    """The uneven LM with a batch of ``microbatches · rows`` sequences."""
    config = uneven_lm_config()
    corpus = MarkovCorpus(config.vocab, config.seq_len, seed=1)

    def layers() -> list[nn.Module]:
        torch.manual_seed(0)
        return gpt_layers(config)

    label = f"LM vocab {config.vocab}, {config.n_layers}×block d={config.dim} seq={config.seq_len}"
    return Workload(label, layers, lm_loss, corpus.batch(microbatches * rows))


def plan_benchmark(
    ranks: Sequence[int] = (2, 4),
    microbatches: int = 8,
    rows: int = 2,
    mlp_rows: int = 32,
    rounds: int = 5,
    steps_per_round: int = 2,
    warmup: int = 2,
) -> list[Table]:
    """``schedule="auto"`` against zb-v on the even split and torch's ZBV on the uneven LM, per rank count;
    and against our hand-picked schedules on the balanced MLP of ``bench pipelines`` (2 ranks).

    Every configuration runs in the same spawned ranks, in rotating rounds; the tables give medians,
    ratios to auto, and each configuration's step time predicted by the simulator from auto's profile.
    """
    tables = []
    for count in ranks:
        lm = launch(
            _plan_rank, count, ("lm", microbatches, rows, rounds, steps_per_round, warmup), threads=1
        )[0]
        tables.append(_plan_table(uneven_lm_workload(microbatches, rows).name, count, microbatches, rows, lm))
    mlp = launch(_plan_rank, 2, ("mlp", microbatches, mlp_rows, rounds, steps_per_round, warmup), threads=1)[
        0
    ]
    tables.append(_plan_table(workload("mlp", microbatches, mlp_rows).name, 2, microbatches, mlp_rows, mlp))
    return tables


def _plan_rank(model: str, m: int, rows: int, rounds: int, steps: int, warmup: int) -> dict[str, Any]:
    from .schedule.plan import stage_costs

    init_distributed(backend="gloo", timeout=300)
    world = dist.get_world_size()
    load = uneven_lm_workload(m, rows) if model == "lm" else workload("mlp", m, rows)
    # the measured step is barrier to barrier without an optimizer step: plan for the makespan ("sync")
    auto = Pipeline(
        load.make_layers(),
        schedule="auto",
        microbatches=m,
        loss_fn=load.loss_fn,
        example=load.batch,
        post_validation=False,
        timeout=300,
    )
    pipes = {f"auto ({auto.schedule.name}, cuts {list(auto.plan.partition)})": auto}
    count = len(load.make_layers())
    names = ("zb-v",) if model == "lm" else OUR_SCHEDULES
    for name in names:
        chunks = 2 * world if name == "zb-v" else world
        partition = even_partition(count, chunks) if model == "lm" else bench_partition(model, count, chunks)
        label = f"zb-v, even split {partition}" if model == "lm" else f"ours {name}"
        pipes[label] = Pipeline(
            load.make_layers(),
            schedule=name,
            microbatches=m,
            loss_fn=load.loss_fn,
            partition=partition,
            timeout=300,
        )
    runners = {label: _our_step(pipe, load.batch) for label, pipe in pipes.items()}
    if model == "lm":
        runners["torch ScheduleZBVZeroBubble, even split"] = _torch_runner(
            "ScheduleZBVZeroBubble", model, load, m
        )
    times = _interleaved(runners, rounds, steps, warmup)
    predicted = {}
    for label, pipe in pipes.items():
        bounds = pipe.layer_bounds
        costs = stage_costs(
            auto.profile, bounds[1:-1], len(bounds) - 1, fused=not pipe.schedule.splits_backward
        )
        predicted[label] = simulate(pipe.schedule, costs).makespan
    return {"times": times, "predicted": predicted, "reason": auto.plan.reason}


def _plan_table(label: str, ranks: int, m: int, rows: int, result: dict[str, Any]) -> Table:
    times, predicted = result["times"], result["predicted"]
    auto = next(name for name in times if name.startswith("auto"))
    reference = _median(times[auto])
    table = Table(
        f"{label}: step time on {ranks} CPU ranks, {m} microbatches of {rows} "
        f"{'sequences' if 'LM' in label else 'rows'}",
        ["configuration", "median step (ms)", "× auto", "predicted (ms)", "measured / predicted", "steps"],
    )
    for name, values in times.items():
        median = _median(values)
        guess = predicted.get(name)
        table.rows.append(
            [
                name,
                f"{median * 1e3:.1f}",
                f"{median / reference:.3f}",
                f"{guess * 1e3:.1f}" if guess else "—",
                f"{median / guess:.3f}" if guess else "—",
                str(len(values)),
            ]
        )
    table.notes.append(
        f"auto chose: {result['reason']}. Predicted = the simulator's makespan for that configuration's "
        "schedule and partition under auto's per-layer profile (every rank profiling at once before the "
        "run, median over ranks). "
        "Step = barrier to barrier, backward and zero_grad included, no optimizer; configurations "
        "measured in rotating rounds."
    )
    return table
