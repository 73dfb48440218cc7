"""How one rank's failure reaches the others: error notices and waits that poll with a deadline.

gloo cannot cancel a posted transfer (a ``wait(timeout)`` that expires closes the channel for
good) and its point-to-point works only report completion from inside ``wait()``, so a rank blocked
in ``work.wait()`` would sit there until the timeout even when the peer it waits for has already
failed and will never send.  Instead every wait of the runtime goes through
:meth:`PeerMonitor.wait`: a helper thread of the monitor makes the blocking ``wait()`` call while
the calling thread waits for it with a deadline and, every :data:`CHECK_INTERVAL` seconds, looks for
an *error notice* in the store every rank shares (the ``torch.distributed`` rendezvous store).
Handing the wait to the thread costs a few microseconds, well below a gloo round trip (measured:
0.39–0.49 ms per round trip either way).  A rank whose step fails posts one notice — its rank,
the op it was running and the original exception text — before re-raising, so its peers raise
:class:`PeerFailure` within a fraction of a second whether or not the failing process lives on.  A
process that dies closes its sockets, which gloo reports at once.  Past the deadline (the
Pipeline's ``timeout``) a wait raises a :class:`~zerobubble.runtime.PipelineError` naming what it
waited for.  See ``docs/failure-semantics.md``.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from . import PipelineError

CHECK_INTERVAL = 0.02
"""Seconds between two looks at the shared store while a wait is not complete."""


class PeerFailure(PipelineError):
    """Another rank of the pipeline failed; the message carries its rank, its op and its error."""


class PeerMonitor:
    """Posts this rank's error notice and watches for the others' while waiting.

    ``key`` names the pipeline in the shared store (the same on every rank of one Pipeline, and
    new for every Pipeline); ``rank`` is this rank's pipeline rank; ``timeout`` bounds every
    :meth:`wait`.  With ``key=None``, or without a store (a process group created without one),
    notices are not exchanged and waits only time out.
    """

    def __init__(self, key: str | None, rank: int, timeout: float):
        self.key = f"zerobubble/{key}/error"
        self.rank = rank
        self.timeout = timeout
        self._store = _shared_store() if key is not None else None
        self.failure: str | None = None  # set once this rank has failed or learnt of a failure
        self._waiter: _Waiter | None = None

    def post(self, message: str) -> None:
        """Tell every peer that this rank failed (first notice wins); remember it locally."""
        self.failure = self.failure or message
        if self._store is None:
            return
        try:
            if not self._store.check([self.key]):
                self._store.set(self.key, message)
        except RuntimeError:  # the store's host died: the peers learn it from their sockets
            pass

    def check(self) -> None:
        """Raise :class:`PeerFailure` if a peer has posted an error notice."""
        if self._store is None:
            return
        try:
            if not self._store.check([self.key]):
                return
            message = self._store.get(self.key).decode(errors="replace")
        except RuntimeError:
            return
        self.failure = self.failure or message
        raise PeerFailure(f"rank {self.rank} stopped because {message}")

    def explain(self) -> None:
        """Raise :class:`PeerFailure` if a peer posted a notice, now or within a moment.

        Called when a channel fails: a peer that gave up on a wait closes its channels right away
        and posts its notice just after, so a closed channel is blamed on a dead peer only when no
        notice follows within :data:`CHECK_INTERVAL` · 3.
        """
        self.check()
        time.sleep(3 * CHECK_INTERVAL)
        self.check()

    def wait(self, work: Any, what: str | Callable[[], str]) -> None:
        """Wait for ``work`` until it completes, a peer posts an error, or the timeout expires."""
        if self._waiter is None:
            self._waiter = _Waiter()
            weakref.finalize(self, self._waiter.close)  # the thread ends with its monitor
        done, errors = self._waiter.submit(work)
        deadline = time.monotonic() + self.timeout
        while not done.wait(CHECK_INTERVAL):
            try:
                self.check()
                if time.monotonic() >= deadline:
                    raise PipelineError(
                        f"rank {self.rank}: waiting for {_text(what)} failed (timeout {self.timeout:g} s) — "
                        "the peer is stalled or stopped without an error notice"
                    )
            except PipelineError:
                _abandon(work, done)
                raise
        if errors:
            self.explain()
            error = errors[0]
            raise PipelineError(
                f"rank {self.rank}: waiting for {_text(what)} failed — a peer rank probably died "
                f"({type(error).__name__}: {error})"
            ) from error


class _Waiter:
    """A daemon thread making the blocking ``work.wait()`` calls, one at a time, in order.

    A wait abandoned by its caller (a peer failed) keeps the thread until gloo's own timeout ends
    it; the Pipeline is unusable by then and a new one gets a new monitor and thread.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Any, threading.Event, list[BaseException]] | None] = (
            queue.SimpleQueue()
        )
        threading.Thread(target=self._run, name="zerobubble-wait", daemon=True).start()

    def close(self) -> None:
        """Let the thread end once the waits queued before are over."""
        self._jobs.put(None)

    def submit(self, work: Any) -> tuple[threading.Event, list[BaseException]]:
        """Queue ``work``; the event is set once its ``wait()`` returned (errors in the list)."""
        done, errors = threading.Event(), []  # type: ignore[var-annotated]
        self._jobs.put((work, done, errors))
        return done, errors

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            work, done, errors = job
            try:
                work.wait()
            except BaseException as error:  # handed to the caller
                errors.append(error)
            # hold no Work while idle: one outliving its process group aborts the process at exit
            job = work = None
            done.set()


def _abandon(work: Any, done: threading.Event) -> None:
    """Release the helper thread from a wait nobody needs any more.

    A second ``wait`` with a tiny timeout makes gloo close the channel, which ends the helper's
    blocking ``wait`` with an error; the channel is dead, but so is the failed step.  A thread
    left inside ``wait`` would abort the process when it exits (the Work outlives its group).
    """
    with contextlib.suppress(RuntimeError):
        work.wait(timedelta(milliseconds=1))
    done.wait(1.0)


def _text(what: str | Callable[[], str]) -> str:
    return what if isinstance(what, str) else what()


def _shared_store() -> Any:
    """The rendezvous store of the default process group, or None when there is none."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None
