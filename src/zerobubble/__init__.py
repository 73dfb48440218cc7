"""zerobubble: pipeline-parallel training of PyTorch models with zero-bubble schedules.

``zerobubble.schedule`` (pure Python) builds, simulates, validates and draws schedules;
``zerobubble.runtime`` (torch) runs them.  ``Pipeline`` is imported lazily so that using only the
schedule layer never imports torch.
"""

from .schedule import CostModel, Schedule, ScheduleError, build_schedule, simulate, validate_schedule

__version__ = "0.1.0"

__all__ = [
    "CostModel",
    "Pipeline",
    "Schedule",
    "ScheduleError",
    "build_schedule",
    "simulate",
    "validate_schedule",
]


def __getattr__(name: str):
    if name == "Pipeline":
        from .runtime.pipeline import Pipeline

        return Pipeline
    raise AttributeError(f"module 'zerobubble' has no attribute {name!r}")
