"""Train the built-in GPT on the synthetic Markov corpus with any pipeline schedule.

:func:`run_training` is what ``zerobubble train`` calls.  Under ``torchrun`` (``RANK`` and
``WORLD_SIZE`` set) it runs this process's rank; otherwise it spawns ``config.ranks`` local ranks
itself.  ``config.ranks = p · data_parallel``: ``data_parallel`` replicas of a ``p``-rank pipeline,
each training on its equal shard of the global batch of ``batch_size`` sequences.  The optimizer
step clips the gradient norm to ``max_norm`` and skips steps with Inf/NaN gradients, with optimizer
post-validation (no global synchronisation per step) unless ``post_validation=False``.  The rank
computing the loss (of the first replica) shows a progress bar with the loss and tokens/s; the
result is a :class:`TrainSummary` (first and last loss, time per step, the simulator's predicted
bubble, how many optimizer steps were clipped, skipped or rolled back).

``zerobubble train --schedule zb-v --ranks 2`` runs it from a shell;
``torchrun --nproc-per-node 2 -m zerobubble train ...`` runs it under torchrun (CUDA + NCCL when
available, one device per local rank).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from zerobubble.schedule import Schedule, build_schedule, transformer_costs
from zerobubble.schedule.modelplan import DATA_PARALLEL_MODES, parse_bytes

from . import ConfigError
from .checkpoint import check_checkpoint, load_checkpoint, save_checkpoint
from .models import GPTConfig, MarkovCorpus, gpt_layers, lm_loss, tensor_parallel
from .profiling import profile_lines, step_profiler


@dataclass(frozen=True)
class TrainConfig:
    """What to train and how: schedule, ranks, steps, batch split, model size, optimiser, runtime.

    ``ranks`` counts every process: ``data_parallel`` pipelines of ``ranks / data_parallel`` ranks.
    ``mesh`` (``"pp=2,dp=2,tp=2"``, dimensions in mesh order) lays the ranks out on a ``DeviceMesh``
    instead — ``ranks`` is then the product of its sizes (None: 2 without a mesh; under torchrun,
    ``WORLD_SIZE``, which a mesh or a given ``ranks`` must match: :func:`launched_config`),
    ``data_parallel`` ``"replicate"`` (the default) or ``"fsdp"`` along its ``dp`` dimension, or
    ``"hsdp"`` along ``dp_replicate`` × ``dp_shard``; a ``tp`` dimension splits each block
    Megatron-style (:func:`~.models.tensor_parallel`, the blocks then with separate q, k, v).
    ``batch_size`` is the global batch, split equally over the replicas and then into
    ``microbatches``.  ``max_norm`` clips the global gradient norm (None: no clipping).
    ``partition`` is ``"even"`` (layers split evenly by count) or ``"profile"`` (a named schedule's
    layers cut where a profile of them says, ``Pipeline(partition="profile")``).  ``profile`` is a
    directory for ``torch.profiler`` traces of a few steps after warm-up, one Chrome trace JSON per
    rank (:func:`profile_window`); None: no profiler.  ``compile`` is a ``torch.compile`` backend
    (``"inductor"``, ``"aot_eager"``, ...) every block is compiled with, ``Pipeline(compile=...)``;
    None: eager.
    """

    schedule: str = "zb-v"
    ranks: int | None = None
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
    max_norm: float | None = 1.0
    post_validation: bool = True
    data_parallel: int | str = 1
    mesh: str | None = None
    backend: str | None = None
    timeout: float = 120.0
    progress: bool = True
    trace: str | None = None
    memory_limit: str | None = None
    partition: str = "even"
    save: str | None = None
    resume: str | None = None
    profile: str | None = None
    compile: str | None = None

    @property
    def mesh_shape(self) -> dict[str, int]:
        """The mesh's dimensions and sizes in order (``{"pp": 2, "dp": 2}``), empty without a mesh."""
        if self.mesh is None:
            return {}
        shape = {}
        for part in self.mesh.split(","):
            name, _, size = part.partition("=")
            if not name.strip() or not size.strip().isdigit() or int(size) < 1 or name.strip() in shape:
                raise ConfigError(
                    f"mesh {self.mesh!r}: write each dimension once as name=size, e.g. pp=2,dp=2"
                )
            shape[name.strip()] = int(size)
        if "pp" not in shape:
            raise ConfigError(f"mesh {self.mesh!r} has no pp dimension (the pipeline's)")
        return shape

    @property
    def world(self) -> int:
        """Every process: the mesh's ranks, or ``ranks`` (2 when not given)."""
        shape = self.mesh_shape
        if shape:
            return math.prod(shape.values())
        return 2 if self.ranks is None else self.ranks

    @property
    def replicas(self) -> int:
        """Data-parallel replicas of the pipeline (``D``)."""
        if self.mesh is not None:
            shape = self.mesh_shape
            return shape.get("dp", 1) * shape.get("dp_replicate", 1) * shape.get("dp_shard", 1)
        return self.data_parallel if isinstance(self.data_parallel, int) else 1

    @property
    def pipeline_ranks(self) -> int:
        """Ranks of one pipeline replica (``p``)."""
        if self.mesh is not None:
            return self.mesh_shape["pp"]
        return self.world // self.replicas

    @property
    def model(self) -> GPTConfig:
        """The GPT size these knobs describe."""
        return GPTConfig(
            vocab=self.vocab,
            seq_len=self.seq_len,
            dim=self.dim,
            heads=self.heads,
            n_layers=self.layers,
            fused_qkv="tp" not in self.mesh_shape,
        )


@dataclass(frozen=True)
class TrainSummary:
    """The outcome of a training run, as rank 0 saw it.

    ``step_time`` is the mean wall time of a step after the first (which includes warm-up);
    ``predicted_bubble`` is the simulator's bubble rate for this schedule under the paper's
    transformer cost formulas for this model size.  ``steps_clipped`` / ``steps_skipped`` count
    optimizer steps whose gradients were clipped / not finite; ``steps_rolled_back`` is the largest
    number of optimistic steps any one rank had to roll back (post-validation).
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
    data_parallel: int = 1
    mesh: str | None = None
    steps_clipped: int = 0
    steps_skipped: int = 0
    steps_rolled_back: int = 0
    trace_lines: tuple[str, ...] = ()
    first_step: int = 0  # steps the run resumed from (--resume) had taken before it

    def lines(self) -> list[str]:
        """A short human-readable report."""
        layout = f" ({self.data_parallel} data-parallel replicas)" if self.data_parallel > 1 else ""
        if self.mesh is not None:
            layout = f" (mesh {self.mesh})"
        return [
            f"schedule {self.schedule} on {self.ranks} ranks{layout}, {self.microbatches} microbatches, "
            f"{self.steps} steps" + (f" (resumed after step {self.first_step})" if self.first_step else ""),
            f"loss {self.first_loss:.3f} -> {self.last_loss:.3f} (floor {self.entropy_floor:.3f})",
            f"{self.step_time * 1e3:.1f} ms/step, {self.tokens_per_second:,.0f} tokens/s",
            f"predicted bubble rate {self.predicted_bubble:.1%}",
            f"optimizer steps clipped {self.steps_clipped}, skipped (Inf/NaN) {self.steps_skipped}, "
            f"rolled back {self.steps_rolled_back}",
            *self.trace_lines,
        ]


def _check_compile_backend(backend: str | None) -> None:
    if backend is None:
        return
    from torch._dynamo import list_backends

    known = list_backends(exclude_tags=())
    if backend not in known:
        raise ConfigError(f"compile backend {backend!r} is not one of torch.compile's: {', '.join(known)}")


def check_config(config: TrainConfig) -> Schedule | None:
    """Raise a one-line :class:`ConfigError` for any setting that cannot train, before a rank starts.

    Counts must be positive, the data-parallel degree must divide the ranks, the batch must split
    into replicas × microbatches, the model size must be valid and the schedule must build for
    this many pipeline ranks and microbatches (with enough layers for its chunks).  Returns that
    schedule (the spawned ranks run it rather than building it again), or None for ``auto``, which
    the Pipeline plans from a profile on the ranks.
    """
    _check_counts(config)
    _check_mesh(config)
    _check_positive(config)
    if config.world % config.replicas:
        raise ConfigError(
            f"data-parallel {config.data_parallel} does not divide ranks={config.world}; ranks counts every "
            "process (pipeline ranks × data-parallel)"
        )
    split = config.microbatches * config.replicas
    if config.batch_size % split:
        raise ConfigError(
            f"batch size {config.batch_size} does not split into {config.replicas} replicas × "
            f"{config.microbatches} microbatches; use a multiple of {split}"
        )
    model = config.model  # validates the model size
    if config.resume is not None:
        _check_resume(config.resume, model)
    _check_compile_backend(config.compile)
    if config.partition not in ("even", "profile"):
        raise ConfigError(f"partition must be even or profile, got {config.partition!r}")
    if config.schedule == "auto":
        if config.memory_limit is not None and not str(config.memory_limit).strip().endswith("%"):
            parse_bytes(config.memory_limit)  # a malformed budget is an error before any rank starts
        return None
    ranks, costs = config.pipeline_ranks, _costs(config)
    schedule = build_schedule(config.schedule, ranks, config.microbatches, costs=costs, chunks=config.chunks)
    if model.n_layers + 2 < schedule.num_stages:
        raise ConfigError(
            f"{config.schedule} on {config.pipeline_ranks} ranks needs {schedule.num_stages} chunks but the "
            f"model has {model.n_layers + 2} layers (blocks + embedding + head); use --layers "
            f"{schedule.num_stages - 2} or more"
        )
    return schedule


def _check_counts(config: TrainConfig) -> None:
    """Every count a positive integer (``ranks`` may be unset; on a mesh its dp dimension counts the
    replicas, and a data-parallel mode without a mesh is refused)."""
    for name in ("ranks", "steps", "microbatches", "batch_size", "data_parallel"):
        value = getattr(config, name)
        if (name == "ranks" and value is None) or (name == "data_parallel" and config.mesh is not None):
            continue
        if name == "data_parallel" and value in ("replicate", "fsdp"):
            raise ConfigError(
                f"data-parallel {value} is a mode of a mesh's dp dimension: add --mesh pp=P,dp=D"
            )
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}")


def _check_positive(config: TrainConfig) -> None:
    """The timeout, the learning rate and the clipping norm (when set) positive."""
    if not config.timeout > 0:
        raise ConfigError(f"timeout must be positive (seconds), got {config.timeout!r}")
    if not config.lr > 0:
        raise ConfigError(f"lr must be positive, got {config.lr!r}")
    if config.max_norm is not None and not config.max_norm > 0:
        raise ConfigError(f"max-norm must be positive, got {config.max_norm!r}")


def _check_resume(directory: str, model: GPTConfig) -> None:
    """``directory`` a checkpoint whose files and shapes fit ``model``, checked before any rank starts."""
    if not os.path.isfile(os.path.join(directory, ".metadata")):
        raise ConfigError(
            f"resume {directory!r} is not a checkpoint directory (no .metadata in it); write one "
            "with --save DIR"
        )
    check_checkpoint(directory, model)  # its files and the model's shapes


def _check_mesh(config: TrainConfig) -> None:
    """With a mesh: known dimensions, a matching ``ranks``, ``data_parallel`` a mode of the ``dp`` one."""
    shape = config.mesh_shape
    if not shape:
        return
    from zerobubble.runtime.parallel.mesh import ROLES

    unknown = sorted(set(shape) - set(ROLES))  # the dimensions the Pipeline knows by role
    if unknown:
        raise ConfigError(f"mesh {config.mesh!r}: unknown dimensions {unknown}; use {', '.join(ROLES)}")
    if config.ranks is not None and config.ranks != config.world:
        raise ConfigError(f"ranks={config.ranks} but the mesh {config.mesh!r} has {config.world} ranks")
    if config.data_parallel != 1 and config.data_parallel not in DATA_PARALLEL_MODES:
        raise ConfigError(
            f"data-parallel {config.data_parallel!r} with a mesh: replicate, fsdp (along dp) or hsdp "
            "(along dp_replicate × dp_shard)"
        )
    if config.data_parallel == "fsdp" and "dp" not in shape:
        raise ConfigError(
            f"data-parallel fsdp shards along the mesh's dp dimension; {config.mesh!r} has none"
        )
    if config.data_parallel == "hsdp" and not {"dp_replicate", "dp_shard"} <= set(shape):
        raise ConfigError(
            f"data-parallel hsdp shards along dp_shard and replicates along dp_replicate; {config.mesh!r} "
            "lacks them (e.g. pp=2,dp_replicate=2,dp_shard=2)"
        )
    tp = shape.get("tp", 1)
    if config.heads % tp or config.dim % tp:
        raise ConfigError(
            f"mesh {config.mesh!r}: tp={tp} must divide the heads ({config.heads}) and the width "
            f"({config.dim}) so that each rank holds whole heads"
        )


def run_training(config: TrainConfig) -> TrainSummary:
    """Train as ``config`` says and return rank 0's summary (spawning local ranks if needed).

    The settings are checked first (:func:`check_config`), so a bad one is a one-line error.
    """
    from zerobubble.runtime import PipelineError
    from zerobubble.runtime.launch import RankFailure, launch, under_launcher

    if under_launcher():
        config = launched_config(config)
    schedule = check_config(config)
    if under_launcher():
        joined = dist.is_initialized()
        try:
            return _train_rank(config, schedule)
        finally:
            if not joined and dist.is_initialized():  # this call created the group: it destroys it
                dist.destroy_process_group()
    threads = max(1, (os.cpu_count() or 1) // config.world)
    try:
        return launch(_train_rank, config.world, (config, schedule), threads=threads)[0]
    except RankFailure as failure:
        # every rank refused the same way (a plan that fits nothing, a damaged checkpoint): that
        # one line, not each rank's traceback; anything else keeps them
        error = failure.common_error((ConfigError, PipelineError))
        if error is None:
            raise
        raise error from None


def launched_config(config: TrainConfig) -> TrainConfig:
    """Under torchrun, the processes it started are the run's ranks: ``ranks`` defaults to
    ``WORLD_SIZE``, and a mesh or a ``ranks`` of another size is a :class:`ConfigError` up front."""
    from dataclasses import replace

    started = int(os.environ["WORLD_SIZE"])
    if config.mesh is None and config.ranks is None:
        return replace(config, ranks=started)
    if config.world != started:
        wants = (
            f"the mesh {config.mesh!r} has {config.world} ranks" if config.mesh else f"ranks={config.ranks}"
        )
        raise ConfigError(
            f"torchrun started {started} processes (WORLD_SIZE={started}) but {wants}; start "
            f"{config.world} (--nproc-per-node × --nnodes)"
            + (" or change the mesh" if config.mesh else " or leave --ranks out (it is then WORLD_SIZE)")
        )
    return config


def _pipeline(config: TrainConfig, schedule: Schedule | None, backend: str, example: Any) -> Any:
    """This rank's Pipeline of the demo GPT as ``config`` says (``schedule``: the checked named
    schedule, None for ``auto``; ``example``: the batch ``auto`` and ``partition="profile"`` profile)."""
    from zerobubble import Pipeline

    profiled = schedule is not None and config.partition == "profile"
    return Pipeline(
        gpt_layers(config.model),
        # partition="profile" plans the cut for the schedule's name (with the profile's costs)
        schedule=config.schedule if profiled or schedule is None else schedule,
        microbatches=config.microbatches if profiled or schedule is None else None,
        chunks=config.chunks if profiled else None,
        partition="profile" if profiled else None,
        loss_fn=lm_loss,
        costs=_costs(config),
        timeout=config.timeout,
        **_parallelism(config, backend),
        post_validation=config.post_validation,
        trace=config.trace is not None,
        memory_limit=config.memory_limit,
        example=example if schedule is None or profiled else None,
        compile={"backend": config.compile} if config.compile is not None else False,
    )


def _train_rank(config: TrainConfig, schedule: Schedule | None) -> TrainSummary:
    from zerobubble.runtime.launch import init_distributed

    backend = init_distributed(config.backend, config.timeout)
    torch.manual_seed(config.seed)
    shard_size = config.batch_size // config.replicas
    # schedule="auto" profiles on an example batch: from a corpus of its own, so training data is unchanged
    example = MarkovCorpus(config.vocab, config.seq_len, seed=config.seed + 7).batch(shard_size)
    pipe = _pipeline(config, schedule, backend, example)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=config.lr)
    corpus = MarkovCorpus(config.vocab, config.seq_len, seed=config.seed)
    start = _resume(config, pipe, optimizer, corpus)
    shard = slice(pipe.layout.grid.dp_index * shard_size, (pipe.layout.grid.dp_index + 1) * shard_size)
    # one rank reports: the loss holder of replica 0, at tensor-parallel coordinate 0
    reports_loss = pipe.holds_loss and pipe.layout.grid.dp_index == 0 and _tp_index(pipe.layout.mesh) == 0
    losses, times = _train_steps(config, pipe, optimizer, corpus, shard, reports_loss, backend)
    pipe.synchronize()
    if config.save is not None:
        save_checkpoint(pipe, optimizer, config.save, start + config.steps)
    report = pipe.write_trace(config.trace) if config.trace is not None else None
    losses = _share_losses(losses if reports_loss else None, config.steps, pipe.device)
    clipped, skipped, rolled_back = _most_over_ranks(pipe, pipe.device)
    step_time = sum(times[1:]) / max(1, len(times) - 1) if len(times) > 1 else times[0]
    return TrainSummary(
        schedule=pipe.schedule.name,
        ranks=dist.get_world_size(),
        microbatches=config.microbatches,
        steps=config.steps,
        first_loss=losses[0],
        last_loss=losses[-1],
        step_time=step_time,
        tokens_per_second=config.batch_size * config.seq_len / step_time,
        predicted_bubble=pipe.timeline.bubble_rate,
        entropy_floor=corpus.entropy,
        losses=losses,
        data_parallel=config.replicas,
        mesh=_describe_mesh(config),
        steps_clipped=clipped,
        steps_skipped=skipped,
        steps_rolled_back=rolled_back,
        trace_lines=(
            *_plan_lines(pipe),
            *(report.lines() if report is not None else ()),
            *profile_lines(config.profile, config.steps),
        ),
        first_step=start,
    )


def _resume(config: TrainConfig, pipe: Any, optimizer: torch.optim.Optimizer, corpus: MarkovCorpus) -> int:
    """Load ``config.resume`` (if set) into ``pipe`` and ``optimizer``, and draw the batches the saved
    run drew, so that the corpus continues where it stopped; the step to start from."""
    if config.resume is None:
        return 0
    start = load_checkpoint(pipe, optimizer, config.resume)
    for _ in range(start):
        corpus.batch(config.batch_size)
    return start


def _train_steps(
    config: TrainConfig,
    pipe: Any,
    optimizer: torch.optim.Optimizer,
    corpus: MarkovCorpus,
    shard: slice,
    reports_loss: bool,
    backend: str,
) -> tuple[list[float], list[float]]:
    """Train ``config.steps`` steps on this replica's ``shard`` of each global batch: the reported
    losses (on the reporting rank, else none) and every step's seconds."""
    losses: list[float] = []
    times: list[float] = []
    profiler = step_profiler(config.profile, config.steps, dist.get_rank(), backend)
    with _progress(config.progress and reports_loss, config.steps) as advance, profiler:
        for _ in range(config.steps):
            inputs, targets = corpus.batch(config.batch_size)  # the same global batch on every rank
            started = time.perf_counter()
            loss = pipe.step(inputs[shard], targets[shard])
            pipe.optimizer_step(optimizer, config.max_norm)
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - started)
            if reports_loss and loss is not None:  # the last stage's rank reports
                losses.append(float(loss))
                advance(losses[-1], config.batch_size * config.seq_len / times[-1])
            profiler.step()
    return losses, times


def _parallelism(config: TrainConfig, backend: str) -> dict[str, Any]:
    """The Pipeline's layout arguments: a mesh of ``config.mesh`` or a replica count."""
    shape = config.mesh_shape
    if not shape:
        return {"data_parallel": config.data_parallel}
    from torch.distributed.device_mesh import init_device_mesh

    device_type = "cuda" if backend == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))
    mode = "replicate" if config.data_parallel == 1 else config.data_parallel
    data = any(name in shape for name in ("dp", "dp_replicate", "dp_shard"))
    parallelize = tensor_parallel if "tp" in shape else None
    return {"mesh": mesh, "data_parallel": mode if data else None, "parallelize": parallelize}


def _tp_index(mesh: Any) -> int:
    """This rank's coordinate along the mesh's ``tp`` dimension (0 without a mesh or the dimension)."""
    if mesh is None or "tp" not in mesh.mesh_dim_names:
        return 0
    return mesh.get_local_rank("tp")


def _describe_mesh(config: TrainConfig) -> str | None:
    """``"pp 2 × dp 2, fsdp"``: the mesh's sizes and how its dp dimension holds the parameters."""
    shape = config.mesh_shape
    if not shape:
        return None
    sizes = " × ".join(f"{name} {size}" for name, size in shape.items())
    mode = "replicate" if config.data_parallel == 1 else config.data_parallel
    data = any(name in shape for name in ("dp", "dp_replicate", "dp_shard"))
    return f"{sizes}, {mode}" if data else sizes


def _plan_lines(pipe) -> tuple[str, ...]:
    """What schedule="auto" (or partition="profile") chose and why, and its calibration from the
    recorded steps (nothing for a named schedule split evenly)."""
    if pipe.plan is None:
        return ()
    calibration = pipe.plan.calibration
    return (
        f"auto plan: {pipe.plan.reason}",
        *((f"auto plan {calibration.describe()}",) if calibration is not None else ()),
    )


def _costs(config: TrainConfig):
    micro_batch = max(1, config.batch_size // (config.microbatches * config.replicas))
    pipeline_ranks = max(1, config.pipeline_ranks)
    return transformer_costs(
        config.dim, config.heads, config.seq_len, micro_batch, max(config.layers, 1) / pipeline_ranks
    )


def _share_losses(losses: list[float] | None, steps: int, device: torch.device) -> list[float]:
    """Every rank learns the per-step losses from the rank that reported them (one collective, at the end).

    Sharing once at the end instead of after every step keeps the training loop free of global
    synchronisation, which optimizer post-validation relies on for overlapping consecutive steps.
    """
    values = torch.zeros(steps, dtype=torch.float64, device=device)
    if losses is not None:
        values += torch.tensor(losses, dtype=torch.float64, device=device)
    dist.all_reduce(values)
    return values.tolist()


def _most_over_ranks(pipe, device: torch.device) -> tuple[int, int, int]:
    """Clipped, skipped and rolled-back optimizer steps, the largest count of any rank."""
    stats = pipe.optimizer_stats
    counts = torch.tensor([stats.clipped, stats.skipped, stats.rolled_back], dtype=torch.int64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    clipped, skipped, rolled_back = (int(c) for c in counts.tolist())
    return clipped, skipped, rolled_back


class _progress:
    """A rich progress bar with loss and tokens/s on rank 0; a no-op elsewhere."""

    def __init__(self, enabled: bool, steps: int):
        self.enabled, self.steps = enabled, steps
        self._bar: Any = None

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.3f}"),
                TextColumn("{task.fields[rate]:,.0f} tok/s"),
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
    """Print the summary once: on rank 0, or in the launching process (the process group is left alone)."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        from rich.console import Console

        Console().print("\n".join(summary.lines()))
