"""The commands that run the runtime: ``train`` (the demo GPT) and ``bench`` (each benchmark of
``zerobubble_bench`` declares its own options; this module only registers them)."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

from .base import Parser, non_negative_int, positive_float, positive_int

_TRAIN_OPTIONS = (
    ("--schedule", str, "schedule name, or auto to plan from measurement (default zb-v)"),
    ("--ranks", positive_int, "local ranks to start (default 2; under torchrun, WORLD_SIZE)"),
    ("--steps", positive_int, "training steps (default 50)"),
    ("--microbatches", positive_int, "microbatches per step (default 4)"),
    ("--batch-size", positive_int, "sequences per step (default 16)"),
    ("--seq-len", positive_int, "tokens per sequence (default 32)"),
    ("--vocab", positive_int, "vocabulary size (default 64)"),
    ("--dim", positive_int, "model width (default 64)"),
    ("--heads", positive_int, "attention heads (default 4)"),
    ("--layers", non_negative_int, "transformer blocks (default 4)"),
    ("--chunks", positive_int, "chunks per rank for interleaved-1f1b"),
    ("--seed", int, "random seed (default 0)"),
    ("--lr", positive_float, "AdamW learning rate (default 3e-3)"),
    ("--backend", str, "gloo or nccl (default: nccl with CUDA, else gloo)"),
    ("--timeout", positive_float, "seconds before a stuck rank is an error (default 120)"),
    ("--max-norm", positive_float, "gradient clipping norm (default 1.0)"),
    (
        "--data-parallel",
        "_data_parallel",
        "pipeline replicas D (--ranks counts all p·D processes; default 1); with --mesh: replicate "
        "(default), fsdp along its dp dimension, or hsdp along dp_replicate × dp_shard",
    ),
    (
        "--mesh",
        str,
        "a DeviceMesh as name=size in order, e.g. pp=2,dp=2,tp=2 (dimensions pp, dp or "
        "dp_replicate and dp_shard, tp)",
    ),
    ("--memory-limit", str, "per-rank byte budget for --schedule auto, e.g. 24GiB or 80%% (GPU)"),
    ("--partition", str, "even (default): layers split evenly by count; profile: where a profile says"),
    ("--save", str, "write the model, optimizer state and step count to this directory at the end (DCP)"),
    ("--resume", str, "continue from a directory written by --save (any layout, the same model size)"),
)


def _data_parallel(text: str) -> int | str:
    """``--data-parallel``: a replica count, or how a mesh's dp dimension holds the parameters."""
    if text in ("replicate", "fsdp", "hsdp"):
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a replica count (a positive integer), replicate, fsdp or hsdp"
        ) from None


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, kind, helptext in _TRAIN_OPTIONS:
        parser.add_argument(flag, type=_data_parallel if kind == "_data_parallel" else kind, help=helptext)
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", default=None, help="no progress bar"
    )
    parser.add_argument(
        "--trace", metavar="DIR", help="record the steps and write the measured timeline to DIR"
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="torch.profiler traces of a few steps after warm-up: DIR/rank<r>.pt.trace.json per rank",
    )
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        metavar="BACKEND",
        help="compile every block with torch.compile (backend: inductor, or e.g. aot_eager); "
        "the linears keep the B/W split",
    )
    parser.add_argument(
        "--no-post-validation",
        dest="post_validation",
        action="store_false",
        default=None,
        help="synchronous optimizer step (all-reduce before it) instead of post-validation",
    )


def _cmd_train(args: argparse.Namespace) -> int:
    from zerobubble_demo.train import TrainConfig, print_summary, run_training

    given = {key: value for key, value in vars(args).items() if value is not None}
    config = TrainConfig(**{key: given[key] for key in TrainConfig.__dataclass_fields__ if key in given})
    print_summary(run_training(config))
    return 0


def _cmd_bench(benchmark: Any, args: argparse.Namespace) -> int:
    """Run one ``zerobubble bench`` command (a ``zerobubble_bench.Benchmark``) and print its tables."""
    from zerobubble_bench.tables import machine_description

    if benchmark.check is not None:
        benchmark.check(args)
    print(f"Machine: {machine_description()}\n")
    for table in benchmark.run(args):
        print(table.markdown() + "\n")
    return 0


def add_bench_commands(parser: argparse.ArgumentParser) -> None:
    """One subcommand per benchmark: each declares its own options (``zerobubble_bench.COMMANDS``)."""
    from zerobubble_bench import benchmarks

    kinds = parser.add_subparsers(dest="benchmark", required=True, parser_class=Parser)
    for benchmark in benchmarks():
        command = kinds.add_parser(benchmark.name, help=benchmark.help)
        benchmark.add_arguments(command)
        command.set_defaults(run=functools.partial(_cmd_bench, benchmark))


COMMANDS: tuple[
    tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]], ...
] = (
    ("train", "train the built-in GPT on local ranks (or under torchrun)", _add_train_arguments, _cmd_train),
)
"""(name, help, add_arguments, run) of each command here, in ``zerobubble --help`` order."""
