"""A group of gloo ranks that stays up across many calls: one start, then a function per call.

Hypothesis draws one example at a time, and starting a group of ranks for each would cost more than
the example itself.  :class:`RankPool` starts the ranks once (:func:`zerobubble.runtime.launch.launch`
in a background thread) and sends each call's function and argument to every rank through a queue;
each rank returns its result or its traceback, and serves the next call.  A call that fails on a rank
raises :class:`PoolCallFailed` with every failing rank's traceback.  A call that outlasts its timeout
raises too, with every rank's Python stacks at the deadline (``faulthandler``, so a rank stuck in a
collective still says where); the stuck ranks are killed and the next call starts fresh ones, so
hypothesis can go on shrinking to the smallest case that hangs.

The ranks are also restarted every :data:`CALLS_PER_START` calls: each Pipeline's process groups
live as long as its process (``docs/runtime.md``, "Process groups"), and an idle gloo group still
costs a little CPU, so a long-lived rank that built 150 Pipelines (about 3,000 threads) slowed every
later call by ten times and more on a 2-core machine.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import queue as queue_module
import signal
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from zerobubble.runtime.launch import init_distributed, launch, start_context

#: seconds between a call's deadline and the ranks' own stack dump, so the dump is written first
DUMP_AHEAD = 3.0
#: calls a set of ranks serves before the pool replaces it (module docstring)
CALLS_PER_START = 20


class PoolCallFailed(RuntimeError):
    """A call raised on some ranks, or did not come back in time."""


def _serve(inboxes: list[Any], outbox: Any, dump_folder: str) -> None:
    """A rank's loop: run each ``(fn, argument, budget)`` from its inbox until it receives None."""
    rank = int(os.environ["RANK"])
    # inductor compiles in worker processes of its own unless told not to: with every rank of a
    # pool compiling at once, they swamp a 2-core machine
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    outbox.put((rank, None, os.getpid()))
    init_distributed(backend="gloo", timeout=120)
    with open(Path(dump_folder) / f"rank{rank}.txt", "w") as dump:
        while True:
            item = inboxes[rank].get()
            if item is None:
                return
            fn, argument, budget = item
            dump.seek(0)
            dump.truncate()
            faulthandler.dump_traceback_later(max(budget - DUMP_AHEAD, 1.0), file=dump)
            try:
                outbox.put((rank, True, pickle.dumps(fn(argument))))
            except BaseException:
                outbox.put((rank, False, traceback.format_exc()))
            finally:
                faulthandler.cancel_dump_traceback_later()


class RankPool:
    """``world_size`` ranks serving calls (see the module docstring); :meth:`close` ends them."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._dump_folder = tempfile.TemporaryDirectory(prefix="zb-rank-pool-")
        self._thread: threading.Thread | None = None
        self._start()

    def _start(self) -> None:
        context = start_context()
        self._inboxes = [context.Queue() for _ in range(self.world_size)]
        self._outbox = context.Queue()
        self._pids: dict[int, int] = {}
        self._ended: BaseException | None = None
        self._closed = False
        self._calls = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        arguments = (self._inboxes, self._outbox, self._dump_folder.name)
        try:
            launch(_serve, self.world_size, arguments, threads=1, timeout=None)
        except BaseException as error:  # reported by the call waiting for results
            self._ended = error

    def call(self, fn: Any, argument: Any, *, timeout: float = 120.0) -> list[Any]:
        """``fn(argument)`` on every rank; the per-rank results in rank order."""
        if not self._closed and self._calls >= CALLS_PER_START:
            self._stop()
        if self._closed:
            self._start()
        self._calls += 1
        for inbox in self._inboxes:
            inbox.put((fn, argument, timeout))
        deadline = time.monotonic() + timeout
        outcomes: dict[int, tuple[bool, Any]] = {}
        while len(outcomes) < self.world_size:
            try:
                rank, ok, payload = self._outbox.get(timeout=0.2)
            except queue_module.Empty:
                if self._ended is not None or time.monotonic() > deadline:
                    why = f"the ranks ended: {self._ended}" if self._ended else self._stuck(timeout)
                    raise PoolCallFailed(f"{fn.__name__}({argument!r}): {why}") from None
                continue
            if ok is None:  # a rank's start-up message: its process id
                self._pids[rank] = payload
                continue
            outcomes[rank] = (ok, pickle.loads(payload) if ok else payload)
        failures = [f"rank {r}:\n{value}" for r, (ok, value) in sorted(outcomes.items()) if not ok]
        if failures:
            raise PoolCallFailed(f"{fn.__name__}({argument!r}) failed\n" + "\n".join(failures))
        return [outcomes[rank][1] for rank in range(self.world_size)]

    def _stuck(self, timeout: float) -> str:
        """Kill the ranks of a call past its deadline; what they were doing (their stack dumps)."""
        stacks = []
        for rank in range(self.world_size):
            path = Path(self._dump_folder.name) / f"rank{rank}.txt"
            text = path.read_text() if path.exists() else ""
            stacks.append(f"rank {rank}:\n{text.strip() or '(no stack dump)'}")
        self._kill()
        return f"over {timeout} s; the ranks' stacks at the deadline:\n" + "\n".join(stacks)

    def _kill(self) -> None:
        for pid in self._pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._closed = True
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _stop(self) -> None:
        """Let the ranks leave their loop, and wait a little for them."""
        if not self._closed:
            self._closed = True
            for inbox in self._inboxes:
                inbox.put(None)
            if self._thread is not None:
                self._thread.join(timeout=30)

    def close(self) -> None:
        """Stop the ranks for good."""
        self._stop()
        self._dump_folder.cleanup()
