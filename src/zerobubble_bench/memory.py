"""``benchmarks/memory.py``: each schedule's measured activation peak against the simulator's bound.

:func:`peak_memory` (a rank worker) measures the live activation bytes of every
``(schedule, microbatches)`` with :class:`zerobubble.runtime.observe.memory.ActivationMeter` on
Linear–GELU–Linear blocks; :func:`memory_table` runs it on local ranks and renders the ratios
(``tests/runtime/observe/test_runtime_memory.py`` checks the runtime against the bound the same way).
"""

from __future__ import annotations

import ctypes
import gc
import os
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from zerobubble import Pipeline
from zerobubble.runtime.launch import init_distributed, launch
from zerobubble.runtime.observe.memory import ActivationMeter, tensors_in

from .tables import Table, median, preserved_torch_state


def _load_libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: no trimming, no tuning
        return None


_LIBC = _load_libc()

WIDTH, ROWS, BLOCKS = 16, 4, 8


def mlp_blocks(seed: int) -> list[nn.Module]:
    """``BLOCKS`` Linear–GELU–Linear blocks (a transformer MLP without the residual)."""
    with preserved_torch_state():
        torch.manual_seed(seed)
        return [
            nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
            for _ in range(BLOCKS)
        ]


def peak_memory(cases: list[tuple[str, int]]) -> dict:
    """Peak live activation bytes of each ``(schedule, microbatches)`` on this rank (second step)."""
    init_distributed(backend="gloo", timeout=60)
    results = {}
    for name, m in cases:
        pipe = Pipeline(mlp_blocks(0), schedule=name, microbatches=m, loss_fn=F.mse_loss, timeout=60)
        inputs = torch.randn(ROWS * m, WIDTH)
        targets = torch.randn(ROWS * m, WIDTH)
        meter = ActivationMeter(pipe, (inputs, targets))
        pipe.step(inputs, targets)  # first step: shapes and headers
        pipe.recorder = meter
        with meter.hooks():
            pipe.step(inputs, targets)
        stages = pipe.schedule.num_stages
        predicted = pipe.timeline.peak_memory[pipe.rank]
        results[(name, m)] = {"peak": meter.peak, "predicted": predicted, "blocks_per_stage": BLOCKS / stages}
    return results


def memory_table(schedules: Sequence[str], counts: Sequence[int] = (8, 16, 32), ranks: int = 2) -> list[str]:
    """Markdown table: each schedule's measured peak per rank over the simulator's bound, per m.

    The bound is the simulated peak (units of M_B) times the bytes of one M_B, taken from 1F1B's
    measured peak on rank 0 at the smallest m.
    """
    cases = [("1f1b", counts[0])] + [(name, m) for name in schedules for m in counts]
    per_rank = launch(peak_memory, ranks, (cases,), threads=1)
    first = per_rank[0][("1f1b", counts[0])]
    unit = first["peak"] / first["predicted"]
    header = "| schedule | " + " | ".join(f"m = {m}: peak / bound per rank" for m in counts) + " |"
    lines = [header, "|---" * (len(counts) + 1) + "|"]
    for name in schedules:
        cells = []
        for m in counts:
            ratios = [r[(name, m)]["peak"] / (r[(name, m)]["predicted"] * unit) for r in per_rank]
            cells.append(" ".join(f"{ratio:.3f}" for ratio in ratios))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


# -- process memory: RSS and every live tensor, against 1F1B ------------------------------------------

RSS_WIDTH, RSS_ROWS, RSS_MICROBATCHES = 256, 64, 16
RSS_SCHEDULES = ("1f1b", "zb-h1", "v-half", "zb-v")
CATEGORIES = ("activations", "kept sends", "posted receives", "kept losses", "other")
"""Where :class:`AllocationMeter` files the live bytes at a peak: what :class:`ActivationMeter`
counts (autograd's saved tensors, kept stage inputs and outputs, hand-overs, the W stores), sends the
channels still hold, receive buffers posted ahead, the losses a step returns, and the rest (the
running op's temporaries, input gradients in flight)."""


def dropout_blocks(seed: int) -> list[nn.Module]:
    """``BLOCKS`` Linear–GELU–Dropout–Linear blocks of width ``RSS_WIDTH`` (hidden 4×)."""
    with preserved_torch_state():
        torch.manual_seed(seed)
        return [
            nn.Sequential(
                nn.Linear(RSS_WIDTH, 4 * RSS_WIDTH),
                nn.GELU(),
                nn.Dropout(0.1),
                nn.Linear(4 * RSS_WIDTH, RSS_WIDTH),
            )
            for _ in range(BLOCKS)
        ]


class AllocationMeter(TorchDispatchMode):
    """Peak bytes of the live tensor storages that aten ops return inside the mode.

    A CPU stand-in for ``torch.cuda.max_memory_allocated``: every storage an op returns is tracked
    through a weak reference until it dies, and after every op the live total is summed (storages of
    ``excluded`` tensors — parameters, gradients, the batch — are left out).  At each new peak
    ``classify()`` (optional) gives the data pointers of named holders, and :attr:`where` files the
    peak's bytes by the first holder containing them, the rest under ``"other"``.  Slow: a
    measuring tool.
    """

    def __init__(self, excluded: Sequence[torch.Tensor] = (), classify=None):
        super().__init__()
        self.excluded = {t.untyped_storage().data_ptr() for t in excluded}
        self.classify = classify
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0
        self.where: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self._track(value.untyped_storage())
        self._sample()
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        pointer = storage.data_ptr()
        if not pointer or pointer in self.excluded:
            return
        known = self.storages.get(pointer)
        if known is None or known[0].expired():  # new, or a dead storage's address reused
            self.storages[pointer] = (StorageWeakRef(storage), storage.nbytes())

    def _sample(self) -> None:
        dead = [pointer for pointer, (ref, _) in self.storages.items() if ref.expired()]
        for pointer in dead:
            del self.storages[pointer]
        live = sum(size for _, size in self.storages.values())
        if live > self.peak:
            self.peak = live
            if self.classify is not None:
                self.where = self._file(self.classify())

    def _file(self, holders: dict[str, set[int]]) -> dict[str, int]:
        where = dict.fromkeys([*holders, "other"], 0)
        for pointer, (_, size) in self.storages.items():
            holder = next((name for name, pointers in holders.items() if pointer in pointers), "other")
            where[holder] += size
        return where


def _holders(pipe, meter: ActivationMeter) -> Callable[[], dict[str, set[int]]]:
    """The data pointers of what holds tensors in a step of ``pipe``, by :data:`CATEGORIES`."""
    executor = pipe._executor

    def pointers(tensors) -> set[int]:
        return {t.untyped_storage().data_ptr() for t in tensors}

    def classify() -> dict[str, set[int]]:
        comm = executor.comm
        activations = [held.tensor for held in list(meter.held)] + tensors_in(executor._handoff)
        for state in executor.stages.values():
            activations += tensors_in(state.saved) + state.store.held_tensors()
        return {
            "activations": pointers(activations),
            "kept sends": pointers(tensors_in(comm._sends)),
            "posted receives": pointers(tensors_in(comm._posted)),
            "kept losses": pointers(executor._losses),
        }

    return classify


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _RssRecorder:
    """A Pipeline recorder keeping the largest RSS seen after an op."""

    def __init__(self) -> None:
        self.peak = 0

    def op(self, op, start, end) -> None:
        self.peak = max(self.peak, _rss())

    def wait(self, key, start, end) -> None:
        """Transfer waits allocate nothing."""


def _trim() -> None:
    """Collect garbage and hand glibc's free memory back, for an RSS baseline."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def process_memory(schedules: Sequence[str], repeats: int, tame: bool) -> dict:
    """Rank worker: per schedule and repeat, the step's peaks on this rank, in bytes.

    ``"activations"``: :class:`ActivationMeter`; ``"tensors"``: :class:`AllocationMeter` (with its
    breakdown, ``"where"``); ``"rss"``: RSS after every op over RSS before the step (garbage collected
    and trimmed).  ``tame``: glibc serves every buffer of 64 KiB and more by ``mmap``, so that freeing
    a tensor returns its pages at once and RSS follows the live bytes (process-wide, for good).
    """
    if tame and _LIBC is not None:
        _LIBC.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: fixed, which also stops glibc raising it
        _LIBC.mallopt(-1, 1 << 16)  # M_TRIM_THRESHOLD: trim the heap's top early
    init_distributed(backend="gloo", timeout=60)
    m = RSS_MICROBATCHES
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(RSS_ROWS * m, RSS_WIDTH, generator=generator)
    targets = torch.randn(RSS_ROWS * m, RSS_WIDTH, generator=generator)
    results: dict[str, list[dict]] = {name: [] for name in schedules}
    for repeat in range(repeats):
        turn = repeat % len(schedules)
        for name in [*schedules[turn:], *schedules[:turn]]:
            pipe = Pipeline(dropout_blocks(0), schedule=name, microbatches=m, loss_fn=F.mse_loss, timeout=60)
            for _ in range(2):  # shapes, headers, .grad allocated
                pipe.step(inputs, targets)
            results[name].append(_measure_step(pipe, inputs, targets))
            del pipe
            _trim()
    return results


def _measure_step(pipe, inputs: torch.Tensor, targets: torch.Tensor) -> dict:
    meter = ActivationMeter(pipe, (inputs, targets))
    gradients = [p.grad for p in pipe.parameters() if p.grad is not None]
    tensors = AllocationMeter([*pipe.parameters(), *gradients, inputs, targets], _holders(pipe, meter))
    pipe.recorder = meter
    with meter.hooks(), tensors:
        pipe.step(inputs, targets)
    rss = _RssRecorder()
    pipe.recorder = rss
    _trim()
    before = _rss()
    pipe.step(inputs, targets)
    pipe.recorder = None
    return {
        "activations": meter.peak,
        "tensors": tensors.peak,
        "where": tensors.where,
        "rss": rss.peak - before,
    }


def process_memory_table(
    schedules: Sequence[str] = RSS_SCHEDULES, repeats: int = 5, ranks: int = 2, tame: bool = False
) -> Table:
    """Each schedule's peak memory over 1F1B's, three ways, on ``ranks`` local gloo ranks.

    A pipeline's peak is its busiest rank's: each ratio is the maximum over ranks of a repeat's peak
    over 1F1B's, median (and range) over the repeats.
    """
    if schedules[0] != "1f1b":
        schedules = ["1f1b", *[name for name in schedules if name != "1f1b"]]
    per_rank = launch(process_memory, ranks, (list(schedules), repeats, tame), threads=1)
    allocator = "glibc tamed (mmap from 64 KiB)" if tame else "glibc defaults"
    table = Table(
        f"Peak memory over 1F1B's: {ranks} gloo ranks, {BLOCKS} Linear–GELU–Dropout–Linear blocks "
        f"(width {RSS_WIDTH}, {RSS_ROWS} rows), m = {RSS_MICROBATCHES}, default plan, {allocator}",
        [
            "schedule",
            "activation meter",
            "live tensors",
            "RSS growth",
            "live tensors at the peak rank's peak, MiB: " + ", ".join(CATEGORIES),
        ],
    )
    for name in schedules:
        cells = [name]
        for measure in ("activations", "tensors", "rss"):
            ratios = [
                _peak_over_ranks(per_rank, name, measure, r) / _peak_over_ranks(per_rank, "1f1b", measure, r)
                for r in range(repeats)
            ]
            cells.append(f"{median(ratios):.3f} ({min(ratios):.2f}–{max(ratios):.2f})")
        busiest = max(range(ranks), key=lambda rank: per_rank[rank][name][0]["tensors"])
        where = per_rank[busiest][name][0]["where"]
        cells.append(", ".join(f"{where.get(category, 0) / 2**20:.2f}" for category in CATEGORIES))
        table.rows.append(cells)
    absolute = {
        measure: median([_peak_over_ranks(per_rank, "1f1b", measure, r) for r in range(repeats)]) / 2**20
        for measure in ("activations", "tensors", "rss")
    }
    table.notes.append(
        f"Ratios: median (min–max) over {repeats} repeats (schedules in rotating order, a fresh Pipeline "
        "each, measured on its third step) of the busiest rank's peak over 1F1B's busiest rank's. "
        "Activation meter: ActivationMeter (autograd's saved tensors, kept stage inputs/outputs, the W "
        "stores); live tensors: every storage aten ops returned and still alive (AllocationMeter, "
        "parameters, gradients and the batch left out); RSS growth: largest RSS after an op over RSS "
        f"before the step (after gc and malloc_trim), a fourth step. 1F1B's medians: "
        + ", ".join(f"{measure} {value:.2f} MiB" for measure, value in absolute.items())
        + ". Breakdown: the first repeat's live tensors at its peak."
    )
    return table


def _peak_over_ranks(per_rank: list[dict], name: str, measure: str, repeat: int) -> float:
    return max(rank[name][repeat][measure] for rank in per_rank)
