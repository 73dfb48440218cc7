"""The recorder protocol: what the executor and the channels report when a step is timed.

A recorder attached to a Pipeline (``pipe.recorder = ...``, or ``trace=True``) receives every op's
interval, every transfer wait and every runtime event (the optimizer settle; the lowered program's
communication actions, named ``issue …``/``wait …``: :data:`COMM_ACTION_PREFIXES`).  Without
one the executor reads no clock.  :func:`as_recorder` completes
an object that only has ``op`` and ``wait`` with the defaults of :class:`RecorderDefaults`, once,
when it is attached — the executor then calls every method without probing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from ...schedule.channels import MessageKey
from ...schedule.ir import Op
from .. import PipelineError

__all__ = [
    "COMM_ACTION_PREFIXES",
    "OpRecorder",
    "Recorder",
    "RecorderDefaults",
    "StepRecorder",
]

#: How the names of the lowered program's communication events start (a trace draws them in a lane of
#: their own: ``rank r comm``).
COMM_ACTION_PREFIXES = ("issue ", "wait ")


@runtime_checkable
class OpRecorder(Protocol):
    """The least a recorder provides: op intervals and transfer waits."""

    def op(self, op: Op, start: Any, end: Any) -> None:
        """``op`` ran from ``start`` to ``end`` (values of the recorder's clock)."""

    def wait(self, key: MessageKey, start: Any, end: Any) -> None:
        """The rank waited for message ``key`` from ``start`` to ``end``."""


@runtime_checkable
class Recorder(OpRecorder, Protocol):
    """A complete recorder: also a clock, a step boundary and runtime events."""

    def clock(self) -> Any:
        """The current time, in whatever unit ``op``/``wait``/``event`` then receive."""

    def begin_step(self) -> None:
        """Called before each step's first op."""

    def event(self, name: str, start: Any, end: Any) -> None:
        """A runtime action that is not an op of the schedule (e.g. ``"optimizer settle"``) ran."""


@runtime_checkable
class StepRecorder(Recorder, Protocol):
    """A recorder keeping whole steps, which :meth:`~..pipeline.Pipeline.measured_timelines` gathers."""

    @property
    def keeps_first_step(self) -> bool:
        """True while the oldest kept step is the pipeline's first."""

    def seconds(self) -> list[Any]:
        """The kept steps as ``perf_counter`` seconds (see :meth:`~.trace.TraceRecorder.seconds`)."""


class RecorderDefaults:
    """Base class giving a recorder the optional parts: ``perf_counter`` clock, no-op step and events."""

    def clock(self) -> Any:
        """``time.perf_counter()`` seconds."""
        return time.perf_counter()

    def begin_step(self) -> None:
        """Nothing to prepare."""

    def event(self, name: str, start: Any, end: Any) -> None:
        """Runtime events are ignored."""


class _Completed(RecorderDefaults):
    """An :class:`OpRecorder` completed with the defaults its own class lacks."""

    def __init__(self, inner: OpRecorder):
        self.op: Callable[[Op, Any, Any], None] = inner.op
        self.wait: Callable[[MessageKey, Any, Any], None] = inner.wait
        # an attribute set once here, so the executor's calls need no probing per op
        for name in ("clock", "begin_step", "event"):
            if hasattr(inner, name):
                setattr(self, name, getattr(inner, name))


def as_recorder(recorder: OpRecorder | None) -> Recorder | None:
    """``recorder`` itself when it is a complete :class:`Recorder`, else completed with the defaults."""
    if recorder is None or isinstance(recorder, Recorder):
        return recorder
    if not isinstance(recorder, OpRecorder):
        raise PipelineError(
            f"a recorder needs op(op, start, end) and wait(key, start, end) methods; "
            f"{type(recorder).__name__} lacks them"
        )
    return _Completed(recorder)
