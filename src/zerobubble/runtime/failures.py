"""How one rank's failure reaches the others: error notices and waits that poll with a deadline.

gloo cannot cancel a posted transfer (a ``wait(timeout)`` that expires closes the channel for
good) and its point-to-point works only report completion from inside ``wait()``, so a rank blocked
in ``work.wait()`` would sit there until the timeout even when the peer it waits for has already
failed and will never send.  Every wait of the runtime goes through :meth:`PeerMonitor.wait`: the
calling thread makes the blocking ``wait()`` call itself (a transfer that has arrived costs no
thread hand-over) while the monitor's *watchdog* thread, every :data:`CHECK_INTERVAL` seconds,
looks for an *error notice* in the store every rank shares (the ``torch.distributed`` rendezvous
store) and at the deadline, and ends the wait when either says so.  ``benchmarks/wait_latency.py``
measures the cost against a bare ``wait()``.  A rank whose step fails posts one notice — its rank,
the op it was running and the original exception text — before re-raising, so its peers raise
:class:`PeerFailure` within a fraction of a second whether or not the failing process lives on.  A
process that dies closes its sockets, which gloo reports at once.  Past the deadline (the
Pipeline's ``timeout``) a wait raises a :class:`~zerobubble.runtime.PipelineError` naming what it
waited for.  See ``docs/failure-semantics.md``.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..errors import PeerFailure, PipelineError

CHECK_INTERVAL = 0.02
"""Seconds between two looks at the shared store while a wait is not complete."""


Guarded = Callable[[str, Callable[[], Any]], Any]
"""``guarded(call, work)``: run a Pipeline call's communicating work, telling the peers and marking
the Pipeline unusable if it raises (``Pipeline._guarded``)."""


class PeerMonitor:
    """Posts this rank's error notice and watches for the others' while waiting.

    ``key`` names the pipeline in the shared store (the same on every rank of one Pipeline, and
    new for every Pipeline); ``rank`` is this rank's pipeline rank; ``timeout`` bounds every
    :meth:`wait`.  Notices go through ``store`` (a ``torch.distributed.Store``; the default process
    group's rendezvous store when None).  With ``key=None``, or without a store (a process group
    created without one), notices are not exchanged and waits only time out.
    """

    def __init__(self, key: str | None, rank: int, timeout: float, store: Any = None):
        self.key = f"zerobubble/{key}/error"
        self.rank = rank
        self.timeout = timeout
        self._store = None if key is None else store if store is not None else _shared_store()
        self.failure: str | None = None  # set once this rank has failed or learnt of a failure
        self._watchdog: _Watchdog | None = None

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
        watchdog = self._watchdog
        if watchdog is None:
            watchdog = self._watchdog = _Watchdog(self)
            weakref.finalize(self, watchdog.close)  # the thread ends with its monitor
        watchdog.arm(work, what)
        try:
            work.wait()  # blocks in C++ with the GIL released; the watchdog may end it early
        except RuntimeError as error:
            verdict = watchdog.disarm()
            if verdict is not None:  # the watchdog ended the wait: say why, not "channel closed"
                raise verdict from None
            self.explain()
            raise PipelineError(
                f"rank {self.rank}: waiting for {_text(what)} failed — a peer rank probably died "
                f"({type(error).__name__}: {error})"
            ) from error
        verdict = watchdog.disarm()
        if verdict is not None:  # the transfer completed just as the watchdog gave up on it
            raise verdict

    def timed_out(self, what: str | Callable[[], str]) -> PipelineError:
        """The error of a wait for ``what`` that outlived the timeout."""
        return PipelineError(
            f"rank {self.rank}: waiting for {_text(what)} failed (timeout {self.timeout:g} s) — "
            "the peer is stalled or stopped without an error notice"
        )


class _Watchdog:
    """A daemon thread that ends the caller's blocking ``wait()`` on a peer's error or the deadline.

    The caller blocks in ``work.wait()`` itself, so a transfer that is already there costs no
    thread hand-over.  Every :data:`CHECK_INTERVAL` seconds the thread looks at the armed wait (if
    any): once it has lasted a full interval, it reads the peers' error notices (one store round
    trip) and compares the clock with the deadline.  To stop the wait it calls ``wait()`` on the
    same work with a tiny timeout, which makes gloo close the channel and the caller's ``wait()``
    raise; the verdict is handed over by :meth:`disarm`.  A lock orders a verdict against the
    caller disarming, so a verdict never lands on a later wait.
    """

    def __init__(self, monitor: PeerMonitor) -> None:
        self._monitor = weakref.ref(monitor)
        self._lock = threading.Lock()
        self._armed: tuple[Any, str | Callable[[], str], float] | None = None
        """The wait being watched: (work, what it waits for, when it started)."""
        self._verdict: PipelineError | None = None
        self._closed = threading.Event()
        threading.Thread(target=self._run, name="zerobubble-watchdog", daemon=True).start()

    def arm(self, work: Any, what: str | Callable[[], str]) -> None:
        """Watch ``work`` until :meth:`disarm` (called by the waiting thread); the monitor's
        ``timeout`` counts from now."""
        self._armed = (work, what, time.monotonic())

    def disarm(self) -> PipelineError | None:
        """Stop watching; the error to raise if the watchdog ended the wait, else None."""
        with self._lock:
            self._armed = None
            verdict, self._verdict = self._verdict, None
        return verdict

    def close(self) -> None:
        """Let the thread end at its next look."""
        self._closed.set()

    def _run(self) -> None:
        while not self._closed.wait(CHECK_INTERVAL):
            self._look()

    def _look(self) -> None:
        # The Work is only referenced inside this call: a Work outliving its process group (held
        # by an idle thread at exit) aborts the process.
        armed = self._armed
        if armed is None or time.monotonic() - armed[2] < CHECK_INTERVAL:
            return  # nothing waits, or not long enough to be worth a store round trip
        verdict = self._verdict_for(armed[1], armed[2])
        if verdict is None:
            return
        with self._lock:
            # that wait ended meanwhile, or was already stopped and its caller (slow to be scheduled
            # on a loaded machine) has not disarmed yet: nothing to stop
            if self._armed is not armed or self._verdict is not None:
                return
            self._verdict = verdict
            with contextlib.suppress(RuntimeError):  # gloo closes the channel; the caller raises
                armed[0].wait(timedelta(milliseconds=1))

    def _verdict_for(self, what: str | Callable[[], str], started: float) -> PipelineError | None:
        monitor = self._monitor()
        if monitor is None:
            return None
        try:
            monitor.check()
        except PeerFailure as failure:
            return failure
        return monitor.timed_out(what) if time.monotonic() - started >= monitor.timeout else None


def _text(what: str | Callable[[], str]) -> str:
    return what if isinstance(what, str) else what()


def _shared_store() -> Any:
    """The rendezvous store of the default process group, or None when there is none."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None
