"""A group of gloo ranks that stays up across many calls: one start, then a function per call.

Hypothesis draws one example at a time, and starting a group of ranks for each would cost more than
the example itself.  :class:`RankPool` starts the ranks once (:func:`zerobubble.runtime.launch.launch`
in a background thread) and sends each call's function and argument to every rank through a queue;
each rank returns its result or its traceback, and serves the next call.  A call that fails on a rank
raises :class:`PoolCallFailed` with every failing rank's traceback; a call that outlasts its timeout
raises too, and the pool is closed (its ranks may be stuck in a collective).
"""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import threading
import time
import traceback
from typing import Any

from zerobubble.runtime.launch import init_distributed, launch, start_context


class PoolCallFailed(RuntimeError):
    """A call raised on some ranks, or did not come back in time."""


def _serve(inboxes: list[Any], outbox: Any) -> None:
    """A rank's loop: run each ``(fn, argument)`` from its inbox until it receives None."""
    rank = int(os.environ["RANK"])
    # inductor compiles in worker processes of its own unless told not to: with every rank of a
    # pool compiling at once, they swamp a 2-core machine
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    init_distributed(backend="gloo", timeout=120)
    while True:
        item = inboxes[rank].get()
        if item is None:
            return
        fn, argument = item
        try:
            outbox.put((rank, True, pickle.dumps(fn(argument))))
        except BaseException:
            outbox.put((rank, False, traceback.format_exc()))


class RankPool:
    """``world_size`` ranks serving calls (see the module docstring); :meth:`close` ends them."""

    def __init__(self, world_size: int):
        context = start_context()
        self.world_size = world_size
        self._inboxes = [context.Queue() for _ in range(world_size)]
        self._outbox = context.Queue()
        self._ended: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            launch(_serve, self.world_size, (self._inboxes, self._outbox), threads=1, timeout=None)
        except BaseException as error:  # reported by the call waiting for results
            self._ended = error

    def call(self, fn: Any, argument: Any, *, timeout: float = 120.0) -> list[Any]:
        """``fn(argument)`` on every rank; the per-rank results in rank order."""
        if self._closed:
            raise PoolCallFailed("the rank pool is closed (an earlier call timed out)")
        for inbox in self._inboxes:
            inbox.put((fn, argument))
        deadline = time.monotonic() + timeout
        outcomes: dict[int, tuple[bool, Any]] = {}
        while len(outcomes) < self.world_size:
            try:
                rank, ok, payload = self._outbox.get(timeout=0.2)
            except queue_module.Empty:
                if self._ended is not None or time.monotonic() > deadline:
                    self.close()
                    why = f"the ranks ended: {self._ended}" if self._ended else f"over {timeout} s"
                    raise PoolCallFailed(f"{fn.__name__}({argument!r}): {why}") from None
                continue
            outcomes[rank] = (ok, pickle.loads(payload) if ok else payload)
        failures = [f"rank {r}:\n{value}" for r, (ok, value) in sorted(outcomes.items()) if not ok]
        if failures:
            raise PoolCallFailed(f"{fn.__name__}({argument!r}) failed\n" + "\n".join(failures))
        return [outcomes[rank][1] for rank in range(self.world_size)]

    def close(self) -> None:
        """Stop the ranks (they leave their loop) and wait a little for them."""
        if self._closed:
            return
        self._closed = True
        for inbox in self._inboxes:
            inbox.put(None)
        self._thread.join(timeout=30)
