"""Benchmarks of zerobubble: the code behind ``zerobubble bench`` and ``benchmarks/*.py``.

Not part of the library (``zerobubble``), and a user of its public modules only (``docs/architecture.md``,
"The public surface"); its tests live in ``tests/bench/``.  One module per benchmark — :mod:`.pipelines`,
:mod:`.wgrad`, :mod:`.split_models`, :mod:`.emulate`, :mod:`.schedulers`, :mod:`.plan`,
:mod:`.memory`, :mod:`.vocab` — over the shared models and runners of :mod:`.workloads` and the result
:class:`~.tables.Table` of :mod:`.tables`.  Every benchmark measures its configurations side by
side in one run and reports medians and ratios.  :mod:`.doc_tables` (not a benchmark) regenerates and
checks the README's and the docs' blocks that are a deterministic command's output.

Each module behind a ``zerobubble bench NAME`` command declares it as ``BENCHMARK``, a
:class:`Benchmark` (its arguments and its run); :data:`COMMANDS` lists those modules and
:func:`benchmarks` loads them for the library's CLI, which only registers them.  This module
imports neither torch nor the benchmark modules.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .tables import Table


@dataclass(frozen=True)
class Benchmark:
    """One ``zerobubble bench NAME`` command.

    ``add_arguments`` declares its options on its subparser; ``check`` (optional) raises the user
    errors argparse cannot see (as ``zerobubble.errors.UsageError``) before anything is printed or run;
    ``run`` measures and returns the tables, which the CLI prints under the machine line.
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], list[Table]]
    check: Callable[[argparse.Namespace], None] | None = None


# the modules that declare a ``BENCHMARK``, in ``zerobubble bench --help`` order; each command is
# named after its module
COMMANDS = ("pipelines", "schedulers", "plan", "wgrad", "emulate", "fsdp", "vocab")


def benchmarks() -> list[Benchmark]:
    """Every ``zerobubble bench`` command, in :data:`COMMANDS` order (this imports them, and torch)."""
    found = [importlib.import_module(f"{__name__}.{name}").BENCHMARK for name in COMMANDS]
    assert [benchmark.name for benchmark in found] == list(COMMANDS), "a command is named after its module"
    return found


def add_round_arguments(parser: argparse.ArgumentParser, *, rounds: int, steps_per_round: int) -> None:
    """The options of a benchmark that times its configurations in interleaved rounds:
    ``--microbatches``, ``--rounds``, ``--steps-per-round`` and ``--settle``."""
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=rounds, help="rounds of interleaved measurements")
    parser.add_argument("--steps-per-round", type=int, default=steps_per_round)
    parser.add_argument(
        "--settle", type=int, default=1, help="untimed steps before each configuration's turn in a round"
    )
