"""Construction, step one: the Pipeline's arguments resolved into one frozen :class:`Resolution`.

A :class:`~..pipeline.Pipeline` is built in two steps.  First its arguments (its
:class:`~.request.PipelineRequest`) are *resolved*: the schedule is built (or checked) for the
pipeline's ranks and validated — once —, the layers are named and cut into chunks, the loss function
is checked and the parameters tied between layers are found.  :func:`resolve` does it for a schedule
name or object; it is pure (no collective, nothing moves or allocates) and raises a
:class:`PipelineError` saying what to pass instead.  With
``schedule="auto"`` or ``partition="profile"`` the planner decides instead (:func:`.auto.resolve_auto`:
a collective, it profiles the layers) and :func:`from_plan` turns its plan into the same
:class:`Resolution`.  Then the Pipeline only builds from that value: every rank agrees on it, keeps
its own chunks, ties and channels (:mod:`.build`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ...schedule import CostModel, Schedule, Timeline, simulate
from ...schedule.modelplan import ModelProfile, Plan
from .. import PipelineError
from ..parallel.consistency import Agreement, agree, find_ties, fingerprint
from ..parallel.data_parallel import pipeline_size_of
from ..parallel.fsdp import check_sharding, check_ties
from .staging import checked_loss_fn, default_costs, named_layers, partition_bounds, resolve_schedule

if TYPE_CHECKING:
    from ...schedule.sharding import FSDPOptions
    from .request import PipelineRequest

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(output, target)`` returning a scalar tensor."""

NamedLayer = tuple[str, nn.Module]
"""A layer and its name in the model (a Sequential's child name, else its list position)."""

Tie = tuple[tuple[int, str], ...]
"""One parameter shared by several layers: ``(layer index, qualified name)`` per use, in model order."""


@dataclass(frozen=True)
class Resolution:
    """Everything a Pipeline is built from, the same on every rank of the pipeline.

    ``schedule`` runs on the pipeline's ranks; ``timeline`` is its simulation under ``costs`` (the
    validator's, from which the optimizer's validation chain is ordered); chunk ``s`` holds
    ``layers[bounds[s]:bounds[s + 1]]``; ``ties`` lists the parameters shared by several layers;
    ``loss_fn`` is the checked loss function.  ``plan`` and ``profile`` are the planner's choice and
    the layer profile it came from (``schedule="auto"`` or ``partition="profile"``), else None.
    """

    schedule: Schedule
    timeline: Timeline
    layers: tuple[NamedLayer, ...]
    bounds: tuple[int, ...]
    costs: CostModel
    ties: tuple[Tie, ...]
    loss_fn: LossFn
    plan: Plan | None = None
    profile: ModelProfile | None = None

    @property
    def partition(self) -> tuple[int, ...]:
        """The layer indices where chunks ``1..S−1`` start."""
        return self.bounds[1:-1]

    def describe(self) -> str:
        """One line: the schedule, its ranks, microbatches and chunks per rank, the cut points."""
        schedule = self.schedule
        return (
            f"schedule {schedule.name}: {schedule.num_ranks} ranks, {schedule.microbatches} microbatches, "
            f"{schedule.chunks} chunks per rank, layers cut at {list(self.partition)}"
        )


def resolve(request: PipelineRequest, *, ranks: int, data_parallel: int = 1) -> Resolution:
    """``request`` resolved for ``ranks`` ranks running ``data_parallel`` replicas (pure).

    Its ``schedule`` is a registry name (built for ``microbatches``, :data:`~.staging.DEFAULT_MICROBATCHES`
    when None, and ``chunks``) or a :class:`Schedule` (checked against ``microbatches``); it is
    validated once, under ``costs`` (:func:`~.staging.default_costs` when None).  Its ``partition``
    lists the ``S−1`` cut points (even chunks when None).  With ``head=`` the loss is a
    vocabulary-parallel head's, whose S and T ops the schedule gets (:mod:`~...schedule.vocab`).
    Raises :class:`PipelineError`.
    """
    vocab_parallel, costs = request.vocab_parallel, request.costs
    loss = checked_loss_fn(request.loss_fn) if not vocab_parallel else head_loss
    size = pipeline_size_of(ranks, data_parallel)
    built, timeline = resolve_schedule(
        request.schedule, size, request.microbatches, request.chunks, costs, vocab_parallel=vocab_parallel
    )
    named = named_layers(request.layers)
    bounds = partition_bounds(len(named), built.num_stages, request.cut_points)
    return Resolution(
        schedule=built,
        timeline=timeline,
        layers=tuple(named),
        bounds=tuple(bounds),
        costs=costs if costs is not None else default_costs(),
        ties=_ties(named),
        loss_fn=loss,
    )


def head_loss(output: Any, target: Any) -> torch.Tensor:  # pragma: no cover - never called
    """The loss function of a vocabulary-parallel pipeline: the head computes the loss itself."""
    raise PipelineError("the vocabulary-parallel head computes the loss; loss_fn is not used")


def from_plan(layers: Sequence[NamedLayer], plan: Plan, profile: ModelProfile, loss_fn: LossFn) -> Resolution:
    """The resolution of a planner's ``plan`` (pure): its schedule, partition and per-stage costs.

    The planner validated the schedule already; it is simulated under the plan's costs (as the
    validator would) for the timeline.
    """
    named = list(layers)
    schedule = plan.schedule
    bounds = partition_bounds(len(named), schedule.num_stages, plan.partition)
    return Resolution(
        schedule=schedule,
        timeline=simulate(schedule, plan.costs),
        layers=tuple(named),
        bounds=tuple(bounds),
        costs=plan.costs,
        ties=_ties(named),
        loss_fn=loss_fn,
        plan=plan,
        profile=profile,
    )


def agree_on(
    attempt: Callable[[], Resolution],
    *,
    data_parallel: int,
    seed: int | None,
    group: dist.ProcessGroup | None,
    verify: bool | str = True,
    check_calls: bool = True,
    sharding: str | None = None,
    fsdp: FSDPOptions | None = None,
) -> tuple[Resolution, Agreement]:
    """``attempt()``'s resolution, once every rank of ``group`` agrees on it (collective).

    The ranks exchange fingerprints of their layers, schedule, cut points, ties, ``data_parallel``,
    ``sharding``, ``fsdp`` (the units or buckets the lowering cuts) and ``check_calls``
    (:func:`~..parallel.consistency.agree`; ``seed`` as there).  ``sharding`` is checked here
    (:func:`~..parallel.fsdp.check_sharding`, and no parameter tied across chunks with ``"fsdp"``),
    so a wrong value raises the same way on every rank.  A rank whose arguments are wrong
    (``attempt`` or ``verify`` raised) still joins the exchange, so its peers raise naming it
    instead of waiting for it; it raises its own :class:`PipelineError`.
    """
    problem, mine, resolution = None, None, None
    try:
        resolution = attempt()
        check_verify(verify)
        check_sharding(sharding, data_parallel)
        if sharding is not None:
            check_ties(resolution.ties, resolution.bounds)
        mine = fingerprint(
            resolution.layers,
            resolution.schedule,
            resolution.bounds,
            data_parallel,
            resolution.ties,
            check_calls=check_calls,
            sharding=sharding,
            fsdp=fsdp,
        )
    except PipelineError as error:
        problem = error
    agreement = agree(mine, None if problem is None else str(problem), seed, group)
    if problem is not None:
        raise problem
    assert resolution is not None
    return resolution, agreement


def check_verify(verify: bool | str) -> None:
    """``verify`` is True, False or ``"strict"`` (the split guard's setting, :mod:`..wgrad.verify`)."""
    if verify not in (True, False, "strict"):
        raise PipelineError(f'verify={verify!r}: pass True (the default), "strict" or False')


def _ties(named: Sequence[NamedLayer]) -> tuple[Tie, ...]:
    return tuple(tuple(tie) for tie in find_ties(named))
