"""What every benchmark shares: the result :class:`Table`, the machine line, medians, and a guard.

Every benchmark measures its configurations side by side in one run, round by round in rotating
order (so machine drift and other load hit all of them alike), and reports medians and ratios in a
:class:`Table`; :meth:`Table.markdown` renders it for the README beside :func:`machine_description`.
:func:`preserved_torch_state` (the demo's, :mod:`zerobubble_demo.split_models`) lets a benchmark seed
its models and set its thread count without changing the caller's global RNG or thread count.
"""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from zerobubble_demo.split_models import preserved_torch_state

__all__ = ["Table", "machine_description", "median", "preserved_torch_state"]


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


def median(values: Sequence[float]) -> float:
    """The median, or NaN for no values (a configuration that never ran)."""
    return statistics.median(values) if values else float("nan")
