"""``zerobubble train --profile DIR``: ``torch.profiler`` traces of a few steps after the warm-up,
one Chrome trace JSON per rank, and the summary's line about them."""

from __future__ import annotations

import os
from typing import Any

#: Steps ``zerobubble train --profile`` records after its warm-up (fewer when the run is shorter).
PROFILE_STEPS = 3


def profile_window(steps: int) -> tuple[int, int, int]:
    """``(wait, warmup, active)`` steps of the profiler schedule for a run of ``steps`` steps.

    The first step is left out (it sends shape headers and builds autograd's first graphs), the next
    warms the profiler up, then up to :data:`PROFILE_STEPS` are recorded; a shorter run records what
    it can (a one-step run that one step).
    """
    wait = 1 if steps >= 3 else 0
    warmup = 1 if steps - wait >= 2 else 0
    return wait, warmup, max(1, min(PROFILE_STEPS, steps - wait - warmup))


def profile_path(directory: str, rank: int) -> str:
    """The Chrome trace ``zerobubble train --profile`` writes for global ``rank``."""
    return os.path.join(directory, f"rank{rank}.pt.trace.json")


class _NoProfiler:
    def __enter__(self) -> _NoProfiler:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def step(self) -> None:
        pass


def step_profiler(directory: str | None, steps: int, rank: int, backend: str) -> Any:
    """A ``torch.profiler.profile`` over :func:`profile_window`'s steps writing this rank's trace to
    ``directory``, or a stand-in doing nothing without one."""
    if directory is None:
        return _NoProfiler()
    from torch.profiler import ProfilerActivity, profile, schedule

    wait, warmup, active = profile_window(steps)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if backend == "nccl" else [])
    path = profile_path(directory, rank)

    def write(prof) -> None:
        os.makedirs(directory, exist_ok=True)
        prof.export_chrome_trace(path)

    return profile(
        activities=activities,
        schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
        on_trace_ready=write,
    )


def profile_lines(directory: str | None, steps: int) -> tuple[str, ...]:
    """What the summary says of the traces :func:`step_profiler` wrote (nothing without them)."""
    if directory is None:
        return ()
    wait, warmup, active = profile_window(steps)
    first = wait + warmup + 1
    recorded = f"step {first}" if active == 1 else f"steps {first}-{first + active - 1}"
    return (
        f"torch profiler traces of {recorded}: {os.path.join(directory, 'rank*.pt.trace.json')} "
        "(zerobubble/ ranges: ops, transfers, hooks)",
    )
