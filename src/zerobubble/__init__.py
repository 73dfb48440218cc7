"""zerobubble: pipeline-parallel training of PyTorch models with zero-bubble schedules.

``zerobubble.schedule`` (pure Python) builds, simulates, validates and draws schedules;
``zerobubble.runtime`` (torch) runs them; ``zerobubble.errors`` holds every error type.  ``Pipeline``,
``VocabParallelHead`` and ``VocabParallelEmbedding`` are imported lazily so that using only the schedule
layer never imports torch.  The public modules: ``docs/architecture.md``, "The errors, and the public
surface".
"""

from .schedule import CostModel, Schedule, ScheduleError, build_schedule, simulate, validate_schedule

__version__ = "0.1.0"

__all__ = [
    "CostModel",
    "FSDPOptions",
    "Pipeline",
    "Schedule",
    "ScheduleError",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "build_schedule",
    "simulate",
    "validate_schedule",
]


def __dir__() -> list[str]:
    """The module's names, the lazily imported ones included (``dir(zerobubble)`` loads no torch)."""
    return sorted({*globals(), *__all__})


def __getattr__(name: str):
    if name == "Pipeline":
        from .runtime.pipeline import Pipeline

        return Pipeline
    if name == "FSDPOptions":
        from .schedule.sharding import FSDPOptions

        return FSDPOptions
    if name in ("VocabParallelHead", "VocabParallelEmbedding"):
        from .runtime.vocab import layers as vocab_layers

        return getattr(vocab_layers, name)
    raise AttributeError(f"module 'zerobubble' has no attribute {name!r}")
