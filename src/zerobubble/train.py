"""Train the built-in GPT on the synthetic Markov corpus with any pipeline schedule.

:func:`run_training` is what ``zerobubble train`` calls.  Under ``torchrun`` (``RANK`` and
``WORLD_SIZE`` set) it runs this process's rank; otherwise it spawns ``config.ranks`` local ranks
itself.  Rank 0 shows a progress bar with the loss and tokens/s; the result is a
:class:`TrainSummary` (first and last loss, time per step, the simulator's predicted bubble).

``python -m zerobubble.train --schedule zb-v --ranks 2`` runs it from a shell;
``torchrun --nproc-per-node 2 -m zerobubble.train ...`` runs it under torchrun (CUDA + NCCL when
available, one device per local rank).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist

from .models import GPTConfig, MarkovCorpus, gpt_layers, lm_loss
from .schedule import transformer_costs


@dataclass(frozen=True)
class TrainConfig:
    """What to train and how: schedule, ranks, steps, batch split, model size, optimiser, runtime."""

    schedule: str = "zb-v"
    ranks: int = 2
    steps: int = 50
    microbatches: int = 4
    batch_size: int = 16
    seq_len: int = 32
    vocab: int = 64
    dim: int = 64
    heads: int = 4
    layers: int = 4
    chunks: int | None = None
    seed: int = 0
    lr: float = 3e-3
    backend: str | None = None
    timeout: float = 120.0
    progress: bool = True

    @property
    def model(self) -> GPTConfig:
        """The GPT size these knobs describe."""
        return GPTConfig(vocab=self.vocab, seq_len=self.seq_len, dim=self.dim, heads=self.heads, n_layers=self.layers)


@dataclass(frozen=True)
class TrainSummary:
    """The outcome of a training run, as rank 0 saw it.

    ``step_time`` is the mean wall time of a step after the first (which includes warm-up);
    ``predicted_bubble`` is the simulator's bubble rate for this schedule under the paper's
    transformer cost formulas for this model size.
    """

    schedule: str
    ranks: int
    microbatches: int
    steps: int
    first_loss: float
    last_loss: float
    step_time: float
    tokens_per_second: float
    predicted_bubble: float
    entropy_floor: float
    losses: list[float] = field(default_factory=list)

    def lines(self) -> list[str]:
        """A short human-readable report."""
        return [
            f"schedule {self.schedule} on {self.ranks} ranks, {self.microbatches} microbatches, {self.steps} steps",
            f"loss {self.first_loss:.3f} -> {self.last_loss:.3f} (floor {self.entropy_floor:.3f})",
            f"{self.step_time * 1e3:.1f} ms/step, {self.tokens_per_second:,.0f} tokens/s",
            f"predicted bubble rate {self.predicted_bubble:.1%}",
        ]


def run_training(config: TrainConfig) -> TrainSummary:
    """Train as ``config`` says and return rank 0's summary (spawning local ranks if needed)."""
    from .runtime import PipelineError
    from .runtime.launch import launch, under_launcher

    if config.batch_size % config.microbatches:
        raise PipelineError(
            f"batch size {config.batch_size} does not split into {config.microbatches} microbatches; "
            "use a multiple of the microbatch count"
        )
    _ = config.model  # validates the model size before any rank starts
    if under_launcher():
        return _train_rank(config)
    threads = max(1, (os.cpu_count() or 1) // config.ranks)
    return launch(_train_rank, config.ranks, (config,), threads=threads)[0]


def _train_rank(config: TrainConfig) -> TrainSummary:
    from .runtime.launch import init_distributed
    from .runtime.pipeline import Pipeline

    init_distributed(config.backend, config.timeout)
    torch.manual_seed(config.seed)
    ranks = dist.get_world_size()
    pipe = Pipeline(
        gpt_layers(config.model), schedule=config.schedule, microbatches=config.microbatches, loss_fn=lm_loss,
        chunks=config.chunks, costs=_costs(config, ranks), timeout=config.timeout,
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=config.lr)
    corpus = MarkovCorpus(config.vocab, config.seq_len, seed=config.seed)
    losses, times = [], []
    with _progress(config.progress and dist.get_rank() == 0, config.steps) as advance:
        for _ in range(config.steps):
            inputs, targets = corpus.batch(config.batch_size)
            started = time.perf_counter()
            loss = pipe.step(inputs, targets)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(_share_loss(loss, pipe.device))
            times.append(time.perf_counter() - started)
            advance(losses[-1], config.batch_size * config.seq_len / times[-1])
    step_time = sum(times[1:]) / max(1, len(times) - 1) if len(times) > 1 else times[0]
    return TrainSummary(
        schedule=pipe.schedule.name, ranks=ranks, microbatches=config.microbatches, steps=config.steps,
        first_loss=losses[0], last_loss=losses[-1], step_time=step_time,
        tokens_per_second=config.batch_size * config.seq_len / step_time,
        predicted_bubble=pipe.timeline.bubble_rate, entropy_floor=corpus.entropy, losses=losses,
    )


def _costs(config: TrainConfig, ranks: int):
    micro_batch = max(1, config.batch_size // config.microbatches)
    return transformer_costs(config.dim, config.heads, config.seq_len, micro_batch, max(config.layers, 1) / ranks)


def _share_loss(loss: torch.Tensor | None, device: torch.device) -> float:
    """Every rank learns the loss from the rank holding the last stage (one small all-reduce)."""
    value = torch.zeros((), device=device) if loss is None else loss.detach().to(device)
    dist.all_reduce(value)
    return float(value)


class _progress:
    """A rich progress bar with loss and tokens/s on rank 0; a no-op elsewhere."""

    def __init__(self, enabled: bool, steps: int):
        self.enabled, self.steps = enabled, steps
        self._bar = None

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.3f}"), TextColumn("{task.fields[rate]:,.0f} tok/s"),
                TimeRemainingColumn(),
            )
            self._bar.start()
            self._task = self._bar.add_task("train", total=self.steps, loss=float("nan"), rate=0.0)
        return self.advance

    def advance(self, loss: float, rate: float) -> None:
        if self._bar is not None:
            self._bar.update(self._task, advance=1, loss=loss, rate=rate)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()


def print_summary(summary: TrainSummary) -> None:
    """Print the summary once: on rank 0, or in the launching process."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        from rich.console import Console

        Console().print("\n".join(summary.lines()))
    if dist.is_initialized():
        dist.destroy_process_group()
