"""Communication in the schedule: lower a built schedule to each rank's full program, check it, time it.

:func:`lower` places the sends and receives, FSDP's unshard, reshard and reduce-scatter per unit,
the replicated all-reduce per bucket, the output layer's collectives and the optimizer step around
the compute ops, each issued asynchronously and waited on where its result is needed;
:func:`validate_lowered` checks the program before anything runs; :func:`simulate_lowered` times it
with a compute stream and communication links that overlap; :func:`choose_options` picks the
fastest lowering under a memory cap.  ``docs/communication.md`` describes the model.  Pure Python.
"""

from .actions import (
    Action,
    Comm,
    CommKind,
    Compute,
    Issue,
    LoweredSchedule,
    LoweringOptions,
    Step,
    Wait,
)
from .collectives import CollectiveCosts, CommProfile
from .layout import StageBytes
from .lower import lower, options_for_grid

__all__ = [
    "Action",
    "CollectiveCosts",
    "Comm",
    "CommKind",
    "CommProfile",
    "Compute",
    "Issue",
    "LoweredSchedule",
    "LoweringOptions",
    "StageBytes",
    "Step",
    "Wait",
    "lower",
    "options_for_grid",
]
