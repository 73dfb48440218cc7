"""The schedule layer: IR, costs, simulation, validation, builders, pictures and export.

Pure Python — it never imports torch — so it runs in planners, CI jobs and notebooks.
"""

from .builders import (
    REGISTRY,
    BuilderSpec,
    build_schedule,
    get_spec,
    register_schedule,
    registered_schedule,
    unregister_schedule,
)
from .costs import CostModel, StageCosts, parse_memory_limit, transformer_costs
from .ir import BW, B, F, Kind, Op, Placement, Schedule, ScheduleError, W, dependencies
from .polish import PolishReport, polish_schedule, solver_available
from .simulate import DeadlockError, Timeline, simulate
from .validate import ValidationError, validate_schedule

__all__ = [
    "BW",
    "REGISTRY",
    "B",
    "BuilderSpec",
    "CostModel",
    "DeadlockError",
    "F",
    "Kind",
    "Op",
    "Placement",
    "PolishReport",
    "Schedule",
    "ScheduleError",
    "StageCosts",
    "Timeline",
    "ValidationError",
    "W",
    "build_schedule",
    "dependencies",
    "get_spec",
    "parse_memory_limit",
    "polish_schedule",
    "register_schedule",
    "registered_schedule",
    "simulate",
    "solver_available",
    "transformer_costs",
    "unregister_schedule",
    "validate_schedule",
]
