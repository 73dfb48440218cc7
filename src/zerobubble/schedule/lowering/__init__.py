"""Communication in the schedule: lower a built schedule to each rank's full program, check it, time it.

:func:`lower` places the sends and receives, FSDP's unshard, reshard and reduce-scatter per unit,
the replicated all-reduce per bucket, the output layer's collectives and the optimizer step around
the compute ops, each issued asynchronously and waited on where its result is needed;
:func:`validate_lowered` checks the program before anything runs; :func:`simulate_lowered` times it
with a compute stream and communication links that overlap; :func:`choose_options` picks the
fastest lowering under a memory cap.  ``docs/communication.md`` describes the model.  Pure Python.
"""

from ...errors import LoweredDeadlock, LoweringError
from .actions import (
    Action,
    Comm,
    CommKind,
    Compute,
    Issue,
    LoweredSchedule,
    Step,
    Wait,
)
from .check import validate_lowered
from .choose import CommChoice, candidate_options, choose_options
from .collectives import CollectiveCosts, CommProfile
from .layout import StageBytes
from .lower import lower
from .memory import ParameterMemory
from .overlap import simulate_lowered
from .pictures import render_comm_svg, render_comm_text, to_comm_chrome_trace
from .spans import CommTimeline

__all__ = [
    "Action",
    "CollectiveCosts",
    "Comm",
    "CommChoice",
    "CommKind",
    "CommProfile",
    "CommTimeline",
    "Compute",
    "Issue",
    "LoweredDeadlock",
    "LoweredSchedule",
    "LoweringError",
    "ParameterMemory",
    "StageBytes",
    "Step",
    "Wait",
    "candidate_options",
    "choose_options",
    "lower",
    "render_comm_svg",
    "render_comm_text",
    "simulate_lowered",
    "to_comm_chrome_trace",
    "validate_lowered",
]
