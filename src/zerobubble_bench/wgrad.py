"""``bench wgrad``: the cost of the B/W split against the fused backward of one stage.

``T_B + T_W`` against the fused backward for an MLP stage, a GPT block and a conv/BatchNorm stage,
per split (our fast paths, the generic split only, torch pipelining's) and microbatch size.
On CPU the command (``zerobubble bench wgrad``, ``benchmarks/wgrad_split.py``) asks for
``keep_freed_memory=True``: glibc's malloc then keeps freed memory, as a caching allocator does.
That is a process-wide allocator setting, so library callers and tests leave it off.
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from zerobubble.errors import UsageError
from zerobubble_demo.models import Block, GPTConfig
from zerobubble_demo.split_models import REFERENCE_MODELS, SPLIT_MODELS, AttentionBlock, RawBlock

from . import Benchmark
from .split_models import w_shares
from .tables import Table, median, preserved_torch_state
from .workloads import mlp_layers


def wgrad_split_cost(
    rows_list: Sequence[int] = (8, 32, 128, 512),
    repeats: int = 15,
    threads: int = 1,
    accumulate: bool = True,
    device: str = "cpu",
    modes: Sequence[str] = ("fast paths", "generic only", "torch pipelining"),
    keep_freed_memory: bool = False,
    stages: Sequence[str] | None = None,
) -> Table:
    """``T_B + T_W`` of the B/W split against the fused backward, per stage, split and microbatch size.

    Stages (``stages``: names from :data:`SPLIT_STAGES`, default all): 4 × (Linear(1024) + ReLU) of
    the MLP, one GPT block (width 256, ``rows`` tokens), two Conv2d(32, 3×3) + BatchNorm2d + ReLU
    blocks (``rows`` images of 8×8), one ``nn.MultiheadAttention`` block (width 256, 4 heads,
    ``rows`` tokens; its projections are ``F.linear`` calls on parameters) and one transformer block
    on raw parameters (:class:`~zerobubble_demo.split_models.RawBlock`: no fast path; its products,
    bias and norms are routed).  Splits:
    ``fast paths`` (the default registry), ``generic only`` (an empty registry: every module through
    the generic split) and ``torch pipelining`` (``stage_backward_input``/``stage_backward_weight`` of
    ``torch.distributed.pipelining``, for reference).  Fused and split backwards alternate within
    each repeat; medians are reported.  With ``accumulate`` gradients add into existing ``.grad``
    tensors (every microbatch of a step but the first); without, ``.grad`` is reset before each
    repeat (a step's first microbatch).  ``threads`` holds during the run only.
    ``keep_freed_memory`` (CPU) tunes glibc's malloc for the rest of the process
    (:func:`retain_freed_memory`): only for a process that runs nothing else, like the bench command.
    """
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda needs a CUDA GPU, and torch.cuda.is_available() is False here")
    tuned = keep_freed_memory and device == "cpu"
    if tuned:
        retain_freed_memory()
    with preserved_torch_state():
        torch.set_num_threads(threads)
        return _wgrad_table(rows_list, repeats, threads, accumulate, device, modes, tuned, stages)


def _wgrad_table(
    rows_list: Sequence[int],
    repeats: int,
    threads: int,
    accumulate: bool,
    device: str,
    modes: Sequence[str],
    tuned: bool,
    stages: Sequence[str] | None,
) -> Table:
    regime = "accumulating into .grad" if accumulate else "fresh .grad (first microbatch)"
    where = f"{threads} thread" if device == "cpu" else device
    table = Table(
        f"B/W split cost (single process, {where}, {regime})",
        ["stage", "split", "rows", "fused backward (ms)", "T_B (ms)", "T_W (ms)", "(T_B+T_W)/fused"],
    )
    for label, make, shape in split_stages(stages):
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
    allocator = ", glibc keeps freed memory as a caching allocator would" if tuned else ""
    table.notes.append(
        f"Medians of {repeats} repeats over {INSTANCES} module pairs, after one warm-up each; the ratio "
        "is the median of each repeat's ratio (fused and split back to back, which runs first "
        "alternating). CPU: thread CPU time (load from other "
        f"processes does not count){allocator}. "
        "Goals at "
        "≥ 32 rows: ≤ 1.05 for fast paths, ≤ 1.15 for the generic split. Conv rows are 8×8 images."
    )
    return table


def retain_freed_memory() -> None:
    """Tell glibc's malloc to keep freed memory for reuse, as a caching allocator (CUDA's) does.

    Process-wide and not undone (glibc cannot report the settings it replaces), hence opt-in.
    Otherwise whether a fresh ``.grad`` costs page faults depends on which backward happened to
    free or trim memory last, and that order differs between the fused and the split backward.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: do not return the heap's top to the system
    libc.mallopt(-3, 1 << 25)  # M_MMAP_THRESHOLD (its maximum): serve tensors below 32 MiB from the heap


SPLIT_STAGES = ("mlp", "gpt", "conv", "mha", "raw")
"""Names of the stages ``bench wgrad`` measures (``--stages``)."""


def split_stages(names: Sequence[str] | None = None):
    """``(label, make, shape of rows)`` of the stages ``names`` (default: all), in table order."""

    def seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
        """``build`` with the same initial weights at every call, the caller's RNG state left as it was."""

        def make() -> nn.Module:
            with preserved_torch_state():
                torch.manual_seed(0)
                return build()

        return make

    def mlp() -> nn.Module:
        return nn.Sequential(*mlp_layers(4))

    def conv() -> nn.Module:
        layers: list[nn.Module] = []
        for _ in range(2):
            layers += [nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU()]
        return nn.Sequential(*layers)

    block = seeded(lambda: Block(GPTConfig(vocab=16, seq_len=512, dim=256, heads=4, n_layers=1)))
    attention = seeded(lambda: AttentionBlock(256, heads=4))
    raw = seeded(lambda: RawBlock(256, heads=4))
    stages = {
        "mlp": ("MLP 4×Linear(1024)", mlp, lambda rows: (rows, 1024)),
        "gpt": ("GPT block d=256", block, lambda rows: (1, rows, 256)),
        "conv": ("2×(Conv2d+BatchNorm2d) c=32", seeded(conv), lambda rows: (rows, 32, 8, 8)),
        "mha": ("MultiheadAttention block d=256", attention, lambda rows: (1, rows, 256)),
        "raw": ("raw-parameter block d=256", raw, lambda rows: (1, rows, 256)),
    }
    return [stages[name] for name in (SPLIT_STAGES if names is None else names)]


class _SplitBackward:
    """One way of running a split backward: ``input_pass(out, grad)`` then ``weight_pass()``."""

    def __init__(self, module: nn.Module, mode: str, x: torch.Tensor):
        from zerobubble.runtime.wgrad import FastPaths, WeightGradStore, install_deferral

        self.module, self.mode, self.x = module, mode, x
        self.store = WeightGradStore()
        self._groups: Any = None
        if mode != "torch pipelining":
            install_deferral([module], self.store, None if mode == "fast paths" else FastPaths())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The split module's forward, as the executor runs it (its backward follows)."""
        if self.mode == "torch pipelining":
            return self.module(x)
        with self.store.keyed_forward((0, 0)):
            return self.module(x)

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


INSTANCES = 3
"""Module pairs per measurement: identical modules built anew (same weights, other memory) gave
(T_B + T_W) / fused ratios up to 0.06 apart in one process, so repeats cycle through several."""


def _split_times(
    make: Callable[[], nn.Module],
    shape: tuple[int, ...],
    repeats: int,
    accumulate: bool,
    mode: str,
    device: torch.device,
) -> tuple[float, float, float, float]:
    """Medians of the fused backward, T_B and T_W (seconds) and of the per-repeat (T_B+T_W)/fused.

    Repeats cycle through :data:`INSTANCES` pairs of a fused and a split module; each pair's first
    use warms up (and creates the ``.grad`` tensors later repeats accumulate into), and which of the
    two runs first alternates from one round of pairs to the next.
    """
    x = torch.randn(*shape, device=device, requires_grad=True)
    pairs = []
    for _ in range(INSTANCES):
        split_module = make().to(device)
        pairs.append((make().to(device), split_module, _SplitBackward(split_module, mode, x)))
    # CPU: the thread's CPU time (the torch ops of one thread run on it, backward included), which
    # other processes on a shared machine do not inflate; CUDA: wall time around synchronisations
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock = time.perf_counter if device.type == "cuda" else time.thread_time
    fused, split_b, split_w = [], [], []
    for repeat in range(repeats + INSTANCES):
        fused_module, split_module, split = pairs[repeat % INSTANCES]
        fused_first = (repeat // INSTANCES) % 2 == 0
        times: dict[str, float] = {}
        for side in ("fused", "split") if fused_first else ("split", "fused"):
            out = fused_module(x) if side == "fused" else split.forward(x)
            grad = torch.ones_like(out)
            sync()
            started = clock()
            if side == "fused":
                out.backward(grad)
                sync()
                times["fused"] = clock() - started
            else:
                split.input_pass(out, grad)
                sync()
                middle = clock()
                split.weight_pass()
                sync()
                times["b"], times["w"] = middle - started, clock() - middle
            x.grad = None  # neither side adds into the other's input gradient
        if repeat >= INSTANCES:  # each pair's first use warms up
            fused.append(times["fused"])
            split_b.append(times["b"])
            split_w.append(times["w"])
        if not accumulate:
            fused_module.zero_grad(set_to_none=True)
            split_module.zero_grad(set_to_none=True)
    # the ratio of each repeat's adjacent measurements: drift in the machine's speed cancels out
    ratios = [(b + w) / f for f, b, w in zip(fused, split_b, split_w)]
    return median(fused), median(split_b), median(split_w), median(ratios)


# ---- the ``zerobubble bench wgrad`` command ----


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``zerobubble bench wgrad``."""
    parser.add_argument("--rows", nargs="+", type=int, default=[8, 32, 128, 512], help="microbatch rows")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (needs a GPU)")
    parser.add_argument(
        "--splits",
        nargs="+",
        default=["fast paths", "generic only", "torch pipelining"],
        choices=["fast paths", "generic only", "torch pipelining"],
        help="which splits to measure",
    )
    parser.add_argument(
        "--stages",
        nargs="+",
        default=list(SPLIT_STAGES),
        choices=list(SPLIT_STAGES),
        help="which stages to measure (mha: nn.MultiheadAttention blocks; raw: a transformer block on "
        "raw parameters: no fast path, its products, bias and norms routed)",
    )
    parser.add_argument(
        "--models",
        nargs="*",
        choices=[*SPLIT_MODELS, *REFERENCE_MODELS],
        help="also measure the W share per stage of these models on 2 ranks (gpt2, llama need transformers; "
        "blocks: checkpointed's blocks without checkpointing)",
    )
    parser.add_argument(
        "--shares-only", action="store_true", help="skip the cost tables: only the W shares of --models"
    )
    parser.add_argument("--width", type=int, default=256, help="hidden size of --models")
    parser.add_argument("--seq", type=int, default=64, help="sequence length (image side) of --models")
    parser.add_argument(
        "--blocks", type=int, default=2, help="transformer blocks of the checkpointed and blocks models"
    )


def check(args: argparse.Namespace) -> None:
    """``--device cuda`` needs a GPU: a user error, before the machine line."""
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda needs a CUDA GPU, and torch.cuda.is_available() is False here")


def run(args: argparse.Namespace) -> list[Table]:
    """``zerobubble bench wgrad``: with and without accumulation, then ``--models``' W shares."""
    if args.shares_only:
        return [w_shares(args.models or ["checkpointed", "blocks"], args.width, args.seq, blocks=args.blocks)]
    # this command's process runs nothing else: it may tune glibc's malloc (``keep_freed_memory``)
    results = [
        wgrad_split_cost(
            args.rows,
            args.repeats,
            args.threads,
            accumulate,
            args.device,
            args.splits,
            keep_freed_memory=True,
            stages=args.stages,
        )
        for accumulate in (True, False)
    ]
    if args.models:
        results.append(w_shares(args.models, args.width, args.seq, blocks=args.blocks))
    return results


BENCHMARK = Benchmark(
    "wgrad", "T_B + T_W of the B/W split against the fused backward", add_arguments, run, check
)
