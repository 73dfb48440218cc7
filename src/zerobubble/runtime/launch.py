"""Starting the ranks of a pipeline on this machine.

Under ``torchrun`` every process already knows its rank from the environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and :func:`init_distributed` just
joins the process group.  Otherwise :func:`launch` spawns one process per rank on a free loopback
port, runs a function in each and returns the per-rank results to the caller.

How the ranks start: ``"spawn"`` (the default) starts a fresh interpreter per rank, as ``torchrun``
does — each imports torch (about 2.4 s of CPU here) and gets its own hash seed.  ``"forkserver"``
forks each rank from one server process that imported torch and the runtime once, so a group of
ranks starts in a fraction of a second; its ranks share the server's hash seed, so it cannot show a
bug where ranks iterate a set in different orders.  The test suite uses it
(``ZEROBUBBLE_START_METHOD=forkserver``) and keeps its consistency tests on ``"spawn"``.
"""

from __future__ import annotations

import math
import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import PipelineError, RankFailure

__all__ = [
    "START_METHODS",
    "RankFailure",
    "init_distributed",
    "launch",
    "start_context",
    "under_launcher",
]


def under_launcher() -> bool:
    """True when the environment names this process's rank (torchrun or :func:`launch`)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def default_backend() -> str:
    """``nccl`` when CUDA devices are available, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def local_device(backend: str) -> torch.device:
    """The device this rank computes on: ``cuda:LOCAL_RANK`` for NCCL, else the CPU."""
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def check_timeout(timeout: float) -> None:
    """Raise :class:`PipelineError` unless ``timeout`` (seconds a wait may take) is finite and > 0."""
    number = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
    if not (number and math.isfinite(timeout) and timeout > 0):
        raise PipelineError(f"timeout must be a positive number of seconds, got {timeout!r}")


def init_distributed(backend: str | None = None, timeout: float = 300.0) -> str:
    """Join the default process group from the environment unless already joined; returns the backend."""
    check_timeout(timeout)
    if dist.is_initialized():
        return dist.get_backend()
    if not under_launcher():
        raise PipelineError(
            "torch.distributed is not initialised and RANK/WORLD_SIZE are not set: run the script under "
            "torchrun, or start the ranks with zerobubble.runtime.launch.launch"
        )
    backend = backend or default_backend()
    local_device(backend)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    return backend


def free_port() -> int:
    """A TCP port on the loopback interface that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


#: What a forkserver imports once, before it forks the ranks (``symbolic_shapes``, and sympy with
#: it, is what ``torch.autograd.grad`` imports the first time it is given output gradients).
FORKSERVER_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.fx.experimental.symbolic_shapes",
    "zerobubble.runtime",
)
START_METHODS = ("spawn", "forkserver")


def start_context(start_method: str | None = None) -> Any:
    """The multiprocessing context ranks start from: ``start_method``, else the environment's
    ``ZEROBUBBLE_START_METHOD``, else ``"spawn"`` (module docstring)."""
    method = start_method or os.environ.get("ZEROBUBBLE_START_METHOD") or "spawn"
    if method not in START_METHODS:
        raise PipelineError(f"start method {method!r} is not one of {', '.join(START_METHODS)}")
    if method == "forkserver" and method not in mp.get_all_start_methods():
        method = "spawn"  # Windows has no forkserver
    context = mp.get_context(method)
    if method == "forkserver":  # takes effect when the server first starts
        context.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return context


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    threads: int | None = 1,
    timeout: float | None = None,
    *,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` in ``nprocs`` new ranks and return their results in rank order.

    Each rank gets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and a free loopback ``MASTER_PORT`` in
    its environment (so :func:`init_distributed` works inside ``fn``), and ``threads`` intra-op
    threads.  ``fn`` must be importable (a module-level function).  A rank that raises or dies makes
    this raise :class:`RankFailure` with its traceback once every rank has stopped; ``timeout``
    (seconds) bounds the whole run.  ``start_method``: :func:`start_context`.
    """
    context = start_context(start_method)
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(
            target=_rank_entry, args=(rank, nprocs, port, threads, fn, tuple(args), results), daemon=True
        )
        for rank in range(nprocs)
    ]
    for process in processes:
        process.start()
    outcomes = _collect(processes, results, timeout)
    failed = {rank: payload for rank, (ok, payload) in sorted(outcomes.items()) if not ok}
    if failed:
        succeeded = {rank: result for rank, (ok, result) in outcomes.items() if ok}
        tracebacks = "\n".join(f"rank {rank}:\n{text}" for rank, (text, _) in failed.items())
        errors = {rank: error for rank, (_, error) in failed.items()}
        raise RankFailure("a spawned rank failed\n" + tracebacks, succeeded, errors)
    return [outcomes[rank][1] for rank in range(nprocs)]


def _collect(processes, results, timeout: float | None) -> dict[int, tuple[bool, Any]]:
    """Each rank's ``(True, result)`` or ``(False, (traceback text, the exception or None))``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    outcomes: dict[int, tuple[bool, Any]] = {}
    while len(outcomes) < len(processes):
        try:
            rank, ok, payload = results.get(timeout=0.1)
            outcomes[rank] = (
                (True, pickle.loads(payload)) if ok else (False, (payload[0], _unpickled(payload[1])))
            )
            continue
        except queue_module.Empty:
            pass
        if all(not p.is_alive() for p in processes) and results.empty():
            for rank, process in enumerate(processes):
                died = f"exited with code {process.exitcode} without a result"
                outcomes.setdefault(rank, (False, (died, None)))
        if deadline is not None and time.monotonic() > deadline:
            for process in processes:
                if process.is_alive():
                    process.kill()
            for rank in range(len(processes)):
                killed = f"still running after the {timeout} s limit; killed"
                outcomes.setdefault(rank, (False, (killed, None)))
    for process in processes:
        process.join(timeout=5)
    return outcomes


def _rank_entry(rank: int, world: int, port: int, threads: int | None, fn, args, results) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        payload = pickle.dumps(fn(*args))
        results.put((rank, True, payload))
    except BaseException as error:
        results.put((rank, False, (traceback.format_exc(), _pickled(error))))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _pickled(error: BaseException) -> bytes | None:
    """``error`` pickled for the launching process, or None when it does not survive the round trip."""
    try:
        payload = pickle.dumps(error)
        pickle.loads(payload)
    except Exception:
        return None
    return payload


def _unpickled(payload: bytes | None) -> BaseException | None:
    try:
        return None if payload is None else pickle.loads(payload)
    except Exception:
        return None
