"""The names of the profiler ranges the runtime opens while a torch profiler records.

While ``torch.profiler`` (or the autograd profiler) is active, the executor runs every entry of a
rank's program inside a ``torch.profiler.record_function`` range, so a trace (Perfetto, TensorBoard,
Nsight through ``emit_nvtx``) shows the schedule; with no profiler active it runs its plain loop and
opens none (the check is made once per step).  The names, all under ``zerobubble/``:

* ``zerobubble/<kind> s<stage> mb<microbatch>`` — an op of the schedule: ``zerobubble/F s0 mb3``,
  ``zerobubble/B s1 mb0``, ``zerobubble/W s1 mb0``, ``zerobubble/BW s0 mb2``;
* ``zerobubble/send F s<stage> mb<j>`` / ``zerobubble/recv F s<stage> mb<j>`` — activations sent by
  F of ``stage`` / received by F of ``stage``; ``send B`` / ``recv B`` the same for input gradients
  (sent by a B or BW of ``stage``, received by the B or BW of ``stage``).  Only transfers between
  ranks: a hand-over between two stages of one rank is no message.  A receive's range covers its
  wait; a send's only its posting (the wait for sends to leave is ``zerobubble/wait sends`` at the
  step's end);
* ``zerobubble/hook <name>`` — a runtime action of the program (:class:`~..execute.executor.Hook`):
  ``zerobubble/hook optimizer settle``, ``zerobubble/hook all-reduce start (stage 1)``;
* ``zerobubble/step`` — one training step's program, around all of the above.

Each op range contains the op's own transfers, so a receive's wait shows inside its op.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...schedule.channels import ACTIVATIONS, MessageKey
from ...schedule.ir import Op

PREFIX = "zerobubble/"
STEP = PREFIX + "step"
WAIT_SENDS = PREFIX + "wait sends"


def _flag() -> bool:
    return torch.autograd.profiler._is_profiler_enabled


#: ``profiling()`` is True while a torch profiler records in this process (``torch.profiler.profile``
#: and the like): torch's own C++ check where it has one (tens of nanoseconds a call), else the
#: autograd profiler's Python flag.
profiling: Callable[[], bool] = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", _flag)


def op_range(op: Op) -> str:
    """``zerobubble/F s0 mb3``: the range of one op."""
    return f"{PREFIX}{op.kind.value} s{op.stage} mb{op.microbatch}"


def hook_range(name: str) -> str:
    """``zerobubble/hook optimizer settle``: the range of a runtime hook."""
    return f"{PREFIX}hook {name}"


def send_range(key: MessageKey) -> str:
    """The range of sending message ``key``, named after the sending op's direction and stage."""
    if key.direction == ACTIVATIONS:
        return f"{PREFIX}send F s{key.boundary} mb{key.microbatch}"
    return f"{PREFIX}send B s{key.boundary + 1} mb{key.microbatch}"


def recv_range(key: MessageKey) -> str:
    """The range of receiving message ``key``, named after the receiving op's direction and stage."""
    if key.direction == ACTIVATIONS:
        return f"{PREFIX}recv F s{key.boundary + 1} mb{key.microbatch}"
    return f"{PREFIX}recv B s{key.boundary} mb{key.microbatch}"
