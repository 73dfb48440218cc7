"""Every error type of zerobubble, in one module that imports neither torch nor any other layer.

The library, the command line, the demo and the benchmarks all import their errors from here, so no
one imports upwards (a benchmark from ``zerobubble.cli``, the schedule layer from the runtime) to
raise or catch one.  Each type is also importable where it was first defined — ``ScheduleError``
from :mod:`zerobubble.schedule`, ``PipelineError`` from :mod:`zerobubble.runtime`, ``PeerFailure``
from ``zerobubble.runtime.failures``, ... — as the same class.

* :class:`ScheduleError` (a ``ValueError``): a schedule, or a request to build one, is invalid;
  :class:`ValidationError` and :class:`DeadlockError` are the validator's and the simulator's.
* :class:`PipelineError` (a ``RuntimeError``): the pipeline cannot run as asked, or a step failed;
  :class:`PeerFailure`, :class:`RankFailure`, :class:`OptimizerValidationError` and
  :class:`SplitMismatchError` say which way.
* :class:`OptionsError` (both): a data-parallel options record (``FSDPOptions``) is invalid.
* :class:`UsageError`: a command-line mistake argparse cannot see (the CLI and ``zerobubble bench``);
  :class:`ConfigError` (a ``ValueError``): a setting of the ``zerobubble train`` demo that cannot run.

The ``zerobubble`` command reports each of these in one line and exits with status 2
(``docs/failure-semantics.md`` says what each runtime failure looks like).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .schedule.ir import Op

__all__ = [
    "ConfigError",
    "DeadlockError",
    "OptimizerValidationError",
    "OptionsError",
    "PeerFailure",
    "PipelineError",
    "RankFailure",
    "ScheduleError",
    "SplitMismatchError",
    "SplitMismatchWarning",
    "UsageError",
    "ValidationError",
]


class ScheduleError(ValueError):
    """A schedule, or a request to build one, is invalid; the message says what and where."""


class ValidationError(ScheduleError):
    """A schedule failed a check; ``rank`` and ``op`` say where (when known)."""

    def __init__(self, message: str, rank: int | None = None, op: Op | None = None):
        super().__init__(message)
        self.rank = rank
        self.op = op


class DeadlockError(ScheduleError):
    """The ranks' programs wait on each other in a cycle (or on an op that no program contains).

    ``waits`` maps each stuck rank to ``(its next op, the op it waits for)``.
    """

    def __init__(self, message: str, waits: dict[int, tuple[Op, Op]]):
        super().__init__(message)
        self.waits = waits


class LoweringError(ValidationError):
    """A lowered program (``schedule/lowering``) failed a check; ``rank`` and ``action`` say where."""

    def __init__(self, message: str, rank: int, action: object = None):
        super().__init__(message, rank)
        self.action = action


class LoweredDeadlock(ScheduleError):
    """Lowered programs wait on each other forever; ``rank`` and ``action`` name one stuck rank."""

    def __init__(self, message: str, rank: int, action: object):
        super().__init__(message)
        self.rank = rank
        self.action = action


class PipelineError(RuntimeError):
    """The pipeline cannot run as asked, or a step failed; the message says where and what to do."""


class OptionsError(ScheduleError, PipelineError):
    """An :class:`~zerobubble.schedule.sharding.FSDPOptions` record is invalid.  The record is read by
    the schedule layer (lowering, planner) and the runtime alike, so its error is both a
    :class:`ScheduleError` and a :class:`PipelineError`: either ``except`` catches it."""


class PeerFailure(PipelineError):
    """Another rank of the pipeline failed; the message carries its rank, its op and its error."""


class RankFailure(PipelineError):
    """A spawned rank raised or died.  ``results`` holds what the other ranks returned (rank → result),
    ``errors`` what each failed rank raised (rank → exception; None when it died or its exception
    could not be pickled); the message holds every failed rank's traceback."""

    def __init__(
        self,
        message: str,
        results: dict[int, Any] | None = None,
        errors: dict[int, BaseException | None] | None = None,
    ):
        super().__init__(message)
        self.results = results or {}
        self.errors = errors or {}

    def common_error(self, kinds: tuple[type[BaseException], ...]) -> BaseException | None:
        """The one error that stands for the whole failure when every failed rank raised one of
        ``kinds``: the first, by rank, that is not a rank stopping because another failed (a
        ``PeerFailure``).  None when a rank died or raised anything else: its traceback matters."""
        errors = [self.errors[rank] for rank in sorted(self.errors)]
        if not errors or not all(isinstance(e, kinds) and not isinstance(e, RankFailure) for e in errors):
            return None
        return next((e for e in errors if not isinstance(e, PeerFailure)), errors[0])


class OptimizerValidationError(PipelineError):
    """The optimizer step cannot be validated as asked; the message says why and what to do."""


class SplitMismatchError(PipelineError):
    """``verify="strict"``: the B/W split of a module disagrees with plain autograd."""


class SplitMismatchWarning(UserWarning):
    """The B/W split of a module disagreed with plain autograd; it now runs a fused backward."""


class UsageError(Exception):
    """A command-line mistake that argparse itself cannot see."""


class ConfigError(ValueError):
    """A demo setting that cannot run (a ``zerobubble train``/``profile`` flag): one-line message."""
