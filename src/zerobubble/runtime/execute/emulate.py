"""Emulated compute: the real runtime with every op's computation stretched to its modelled duration.

``Pipeline(..., emulate=costs)`` runs the real executor, real processes and real transfers of real
(small) tensors, but each op lasts exactly what ``costs`` (a :class:`CostModel`, **in milliseconds**
by default; ``unit`` = seconds per cost unit) says: the op takes its inputs (received by the wait
entry before it), runs the small real computation, waits until ``duration`` has passed since then,
and leaves its outputs for the send entry after it.
Comparing the measured iteration time with ``simulate(schedule, costs)`` then isolates the runtime's
own overhead (dispatch, transfers, clock), and pipelines of 4–8 ranks can be measured on a machine
with 2 cores, since waiting ranks do not compute.

The wait sleeps until ``spin`` seconds before the deadline and busy-waits the rest (``time.sleep``
alone wakes 50–100 µs late, more on a loaded machine).  With many more ranks than cores keep
``spin`` small (the default 0.2 ms) or 0: a spinning rank takes a core from the others.  Costs should
be milliseconds, not microseconds, for the same reason.  The vocabulary-parallel S and T ops last
``vocab_s`` / ``vocab_t`` of this rank's shard, counted from the op's start (their collectives' waits
are inside them).  Transfers are not delayed: predict with
``comm = 0`` and the real (small) transfer cost shows up as overhead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ...schedule import CostModel, Kind, ScheduleError
from .executor import Executor, StageState

DEFAULT_SPIN = 2e-4


def wait_until(deadline: float, spin: float = DEFAULT_SPIN) -> None:
    """Return at ``time.perf_counter() >= deadline``: sleep most of the way, busy-wait the last ``spin`` s."""
    clock = time.perf_counter
    remaining = deadline - clock() - spin
    if remaining > 0:
        time.sleep(remaining)
    while clock() < deadline:
        pass


def install_emulation(
    executor: Executor, costs: CostModel, unit: float = 1e-3, spin: float = DEFAULT_SPIN
) -> None:
    """Replace ``executor``'s handlers by emulated ones taking ``costs`` (× ``unit`` seconds) per op."""
    if not unit > 0 or spin < 0:
        raise ScheduleError(
            f"emulation needs unit > 0 and spin >= 0 seconds, got unit={unit!r}, spin={spin!r}"
        )
    stage_costs = costs.resolve(executor.schedule.placement)
    seconds = {
        kind: [value * unit for value in values]
        for kind, values in ((Kind.F, stage_costs.f), (Kind.B, stage_costs.b), (Kind.W, stage_costs.w))
    }
    seconds[Kind.BW] = [b + w for b, w in zip(seconds[Kind.B], seconds[Kind.W])]
    handlers = {
        Kind.F: _forward(executor, seconds[Kind.F], spin),
        Kind.B: _backward(executor, seconds[Kind.B], spin, defer=True),
        Kind.BW: _backward(executor, seconds[Kind.BW], spin, defer=False),
        Kind.W: _weight(executor, seconds[Kind.W], spin),
    }
    for kind, shards in ((Kind.S, stage_costs.vocab_s), (Kind.T, stage_costs.vocab_t)):
        if kind in executor.handlers:  # the vocabulary-parallel ops: per shard (this rank's)
            duration = shards[executor.rank] * unit if shards else 0.0
            handlers[kind] = _vocab_op(executor.handlers[kind], duration, spin)
    executor.handlers = handlers
    executor.compile()


Handler = Callable[[StageState, int], None]


def _forward(executor: Executor, durations: list[float], spin: float) -> Handler:
    clock = time.perf_counter

    def forward(state: StageState, j: int) -> None:
        inputs = executor.receive_forward(state, j)
        ready = clock()
        outputs = executor.compute_forward(state, j, inputs)
        wait_until(ready + durations[state.index], spin)
        executor.send_forward(state, j, outputs)

    return forward


def _backward(executor: Executor, durations: list[float], spin: float, defer: bool) -> Handler:
    clock = time.perf_counter

    def backward(state: StageState, j: int) -> None:
        grads = executor.receive_backward(state, j)
        ready = clock()
        input_grads = executor.compute_backward(state, j, grads, defer)
        wait_until(ready + durations[state.index], spin)
        executor.send_backward(state, j, input_grads)

    return backward


def _vocab_op(handler: Handler, duration: float, spin: float) -> Handler:
    """An S or T op lasting at least ``duration`` from its start: its waits for the vocabulary
    collectives sit inside the real handler, so the duration counts from the op's start."""
    clock = time.perf_counter

    def vocab_op(runner: Any, j: int) -> None:
        started = clock()
        handler(runner, j)
        wait_until(started + duration, spin)

    return vocab_op


def _weight(executor: Executor, durations: list[float], spin: float) -> Handler:
    clock = time.perf_counter

    def weight(state: StageState, j: int) -> None:
        ready = clock()
        executor.compute_weight(state, j)
        wait_until(ready + durations[state.index], spin)

    return weight
