"""``Pipeline(schedule="auto")``: profile, plan once, broadcast, so every rank runs the same plan.

:func:`resolve_auto` is called by the Pipeline before it places any layer: :func:`plan_for_pipeline`
decides what its :class:`~.request.PipelineRequest` and :class:`Planning` ask, :func:`~.resolve.from_plan`
makes the plan the Pipeline's :class:`~.resolve.Resolution`.
Ranks 0 and 1 of the group time a transfer (:func:`~.profile.measure_transfer`); every rank
profiles the layers on the first microbatch of the example batch and of its keyword arguments (on
copies: the model, its gradients and the random state are untouched) — all at once, or in turns
when the ranks outnumber the CPU cores (:func:`profiling_turns`); rank 0 takes the median of each
time over the ranks and runs :func:`zerobubble.schedule.modelplan.plan`; the resulting
:class:`Plan` — or the error saying why nothing fits — is broadcast, so every rank either runs the
same schedule and partition or raises the same :class:`PipelineError` before allocating anything.

:class:`Calibrator` then records the run's own first steps and calibrates the plan from them
(:func:`zerobubble.schedule.modelplan.calibrate`): ``pipe.plan.calibration`` holds the prediction from
the measured op times and the plan they would choose.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ...schedule import ScheduleError
from ...schedule.modelplan import Link, MeshLayout, ModelProfile, Plan, calibrate, median_profile, plan
from .. import PipelineError
from ..observe.recorder import OpRecorder, StepRecorder
from ..parallel.experts import ExpertPayload, recorded_payloads
from ..vocab.runner import plain_model
from .profile import measure_all_to_all, measure_transfer, profile_layers

if TYPE_CHECKING:
    from ..observe.trace import MeasuredTimeline
    from .request import PipelineRequest
    from .resolve import Resolution

logger = logging.getLogger(__name__)

SHARED_CORE_EVICTION = 64 * 2**20
"""Bytes written before each timed op when the ranks share cores: more than the last-level cache."""


@dataclass(frozen=True, kw_only=True)
class Planning:
    """What the planner is asked for one pipeline (:func:`plan_for_pipeline`).

    ``ranks`` is the pipeline's size; ``schedules`` limits the candidates (every registry schedule
    but the ILP when None; a named schedule with ``partition="profile"`` passes just its own) and
    ``chunks`` fixes the interleaved chunk count.  ``head`` is ``"plain"``, or ``"both"`` to weigh a
    vocabulary-parallel head against the plain one (``vocab_embedding``: the embedding too).
    ``layout`` places each stage on the mesh's ``dp × tp`` ranks (its links timed by the measured
    transfer); None: one rank per stage.
    """

    ranks: int
    microbatches: int
    memory_limit: str | float | None = None
    post_validation: bool = True
    schedules: Sequence[str] | None = None
    chunks: int | None = None
    head: str = "plain"
    vocab_embedding: bool = False
    layout: MeshLayout | None = None


def plan_for_pipeline(
    named: Sequence[tuple[str, nn.Module]],
    example: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    group: dist.ProcessGroup | None,
    device: torch.device,
    planning: Planning,
    repeats: int = 5,
    experts_group: dist.ProcessGroup | None = None,
) -> tuple[Plan, ModelProfile]:
    """The plan every rank of ``group`` agrees on, and the profile it came from (collective).

    ``example`` is one batch as :meth:`Pipeline.step` takes it, ``(inputs, targets)`` or
    ``(inputs, targets, kwargs)`` with the step's keyword arguments in a dict
    (:func:`example_parts`); ``planning`` says what to plan for.  With ``experts_group`` (this rank's
    ``"ep"`` ranks) each mixture-of-experts layer's exchange is timed on it
    (:func:`_with_all_to_all`), which the planner weighs (``dualpipe-v`` among the candidates).
    Raises :class:`PipelineError` on every rank when no schedule fits.
    """
    example = example_parts(example)
    comm = measure_transfer(group, device)
    mine: ModelProfile | str = "this rank did not profile"
    turns = profiling_turns(dist.get_world_size(group), device)
    # ranks taking turns on a core switch working sets: each op then starts with another rank's data
    # in the caches, so time it after an eviction; a rank with a core (or a GPU) of its own keeps its
    # caches warm (the op times recorded in runs matched the warm profile: docs/auto-planning.md)
    evict = SHARED_CORE_EVICTION if turns > 1 else 0
    microbatches = planning.microbatches
    layers = [layer for _, layer in named] if experts_group is not None else []  # no experts: no hooks
    with recorded_payloads(layers) as payloads:
        for turn in range(turns):  # at most as many ranks profile at once as there are cores for them
            if turns > 1:
                dist.barrier(group=group)
            if dist.get_rank(group) % turns == turn:
                mine = _profile_here(named, example, loss_fn, microbatches, device, comm, repeats, evict)
    if experts_group is not None:
        mine = _with_all_to_all(mine, payloads, group, experts_group, device)
    rank, source = dist.get_rank(group), dist.get_global_rank(group, 0) if group is not None else 0
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(mine, gathered, dst=source, group=group)
    payload: list[Any] = [None]
    if gathered is not None:
        payload[0] = _decide(gathered, device, planning)
    dist.broadcast_object_list(payload, src=source, group=group, device=_object_device(device))
    outcome = payload[0]
    if isinstance(outcome, str):
        raise PipelineError(f'schedule="auto" cannot run: {outcome}')
    return outcome


def _with_all_to_all(
    mine: ModelProfile | str,
    payloads: Mapping[int, Mapping[int, ExpertPayload]],
    group: dist.ProcessGroup | None,
    experts_group: dist.ProcessGroup,
    device: torch.device,
) -> ModelProfile | str:
    """``mine`` with each mixture-of-experts layer's ``all_to_all``: its experts modules' exchanges
    (recorded while profiling, :func:`~..parallel.experts.recorded_payloads`) timed on
    ``experts_group`` (collective on ``group``: the ranks first agree on what to time, so a rank whose
    profile failed, and recorded nothing, still takes part)."""
    recorded = {index: [calls[j] for j in sorted(calls)] for index, calls in payloads.items() if calls}
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, recorded, group=group)
    agreed: dict[int, list[ExpertPayload]] = next((each for each in gathered if each), {})
    seconds = {
        index: sum(measure_all_to_all(experts_group, *payload, device=device) for payload in calls)
        for index, calls in sorted(agreed.items())
    }
    if isinstance(mine, str) or not seconds:
        return mine
    layers = tuple(replace(layer, all_to_all=seconds.get(i, 0.0)) for i, layer in enumerate(mine.layers))
    return replace(mine, layers=layers)


def resolve_auto(
    request: PipelineRequest,
    group: dist.ProcessGroup | None,
    device: torch.device,
    planning: Planning,
    experts_group: dist.ProcessGroup | None = None,
) -> Resolution:
    """``request`` resolved by the planner (collective): :func:`plan_for_pipeline`'s plan as a
    :class:`~.resolve.Resolution`, the same on every rank; or the same error on every rank.

    With ``head=`` the planner profiles the plain model (the head, and the embedding, as layers of
    their own: :func:`~..vocab.runner.plain_model`) and chooses: a vocabulary-parallel winner
    resolves the request's layers with the head's loss.  ``experts_group``: this rank's ``"ep"``
    ranks, on which the experts' exchanges are timed (:func:`plan_for_pipeline`).
    """
    from .resolve import from_plan, head_loss
    from .staging import checked_loss_fn, named_layers

    layers, loss_fn = request.layers, request.loss_fn
    if request.head is not None:  # the planner weighs a plain head against the vocabulary-parallel one
        layers, loss_fn = plain_model(request.head, request.embedding, request.layers)
    named, loss = named_layers(layers), checked_loss_fn(loss_fn)
    chosen, profile = plan_for_pipeline(
        named, request.example, loss, group, device, planning, experts_group=experts_group
    )
    if request.head is not None and chosen.winner.vocab_parallel:
        return from_plan(named_layers(request.layers), chosen, profile, head_loss)
    return from_plan(named, chosen, profile, loss)


def profiling_turns(world: int, device: torch.device) -> int:
    """In how many turns the ``world`` ranks profile so that each has the cores it computes with.

    On a GPU every rank has its own device: one turn.  On the CPU a rank computes with
    ``torch.get_num_threads()`` threads; when the ranks together want more cores than this process
    may use, profiling them all at once would time every layer on a fraction of a core, while in the
    run the ranks take turns by themselves (one computes while another waits).  The profile is then
    taken in turns, each rank on the cores it would have alone — the simulator's model of a rank.
    """
    slots = cpu_slots(device)
    return 1 if slots is None else math.ceil(world / slots)


def cpu_slots(device: torch.device) -> int | None:
    """How many ranks of ``torch.get_num_threads()`` threads the CPUs this process may use hold at
    once; None on a GPU (a device per rank)."""
    if device.type != "cpu":
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, torch.get_num_threads()))


def example_parts(example: Any) -> tuple[Any, Any, Mapping[str, Any]]:
    """``example`` as ``(inputs, targets, keyword arguments)``: ``(inputs, targets)`` has none, a
    third element is the dict of keyword arguments ``step(inputs, targets, **kwargs)`` would get
    (``{"attention_mask": mask}``).  Anything else raises :class:`PipelineError`."""
    sequence = isinstance(example, (tuple, list))
    if sequence and len(example) == 2:
        return example[0], example[1], {}
    if sequence and len(example) == 3 and isinstance(example[2], Mapping):
        return example[0], example[1], example[2]
    if sequence and len(example) == 3:
        given = f"a third element that is a {type(example[2]).__name__}, not a dict"
    else:
        given = f"a {len(example)}-element {type(example).__name__}" if sequence else type(example).__name__
    raise PipelineError(
        'schedule="auto" profiles the layers before placing them: pass example=(inputs, targets), one '
        'batch as step() takes it, or example=(inputs, targets, {"attention_mask": mask, ...}) with '
        f"the keyword arguments step() gets (got {given})"
    )


def _profile_here(
    named: Sequence[tuple[str, nn.Module]],
    example: tuple[Any, Any, Mapping[str, Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    microbatches: int,
    device: torch.device,
    comm: tuple[float, float],
    repeats: int,
    evict_bytes: int = 0,
) -> ModelProfile | str:
    """This rank's profile of the layers on the first microbatch, or why it failed.

    The keyword arguments are split and checked as :meth:`Pipeline.step` splits them
    (:func:`~.staging.split_keywords`): the layers are profiled with the first microbatch's.
    """
    from .staging import layer_keywords, split_keywords

    try:
        inputs, targets, kwargs = example
        inputs, targets = (_first_microbatch(part, microbatches) for part in (inputs, targets))
        keywords = [(name, layer_keywords(layer)) for name, layer in named]
        first = split_keywords(kwargs, microbatches, device, "step", keywords)[:1]
        return profile_layers(
            named,
            inputs,
            targets,
            loss_fn,
            device,
            repeats,
            comm=comm,
            evict_bytes=evict_bytes,
            kwargs=first[0] if first else None,
        )
    except PipelineError as error:
        return str(error)
    except Exception as error:  # every rank must learn of it, or the others wait in the collectives
        return f"profiling the layers failed on rank {dist.get_rank()}: {type(error).__name__}: {error}"


def _decide(
    profiles: Sequence[ModelProfile | str], device: torch.device, planning: Planning
) -> tuple[Plan, ModelProfile] | str:
    """Rank 0's plan from every rank's profile (median times), or the message every rank will raise."""
    failures = [outcome for outcome in profiles if isinstance(outcome, str)]
    if failures:
        return failures[0]
    try:
        profile = median_profile(profiles)  # type: ignore[arg-type]  # no str left
        device_memory = (
            float(torch.cuda.get_device_properties(device).total_memory) if device.type == "cuda" else None
        )
        layout = planning.layout
        if layout is not None:  # the mesh's collectives on the link the transfer was measured on
            link = Link(profile.comm_latency, profile.comm_bandwidth)
            layout = replace(layout, tp_link=link, dp_link=link)
        chosen = plan(
            profile,
            planning.ranks,
            planning.microbatches,
            planning.memory_limit,
            optimizer="post-validation" if planning.post_validation else "sync",
            device_memory=device_memory,
            cores=_shared_cores(device, planning.ranks, len(profiles)),
            schedules=planning.schedules,
            interleaved_chunks=(planning.chunks,) if planning.chunks is not None else (2,),
            head=planning.head,
            vocab_embedding=planning.vocab_embedding,
            layout=layout,
        )
        return chosen, profile
    except ScheduleError as error:
        return str(error)


def _shared_cores(device: torch.device, ranks: int, world: int) -> int | None:
    """The processors this pipeline's ``ranks`` share (of ``world`` ranks on the machine), or None
    when every rank has its own: the simulator then models the sharing (:func:`~...schedule.simulate`)."""
    slots = cpu_slots(device)
    if slots is None or slots >= world:
        return None
    return max(1, slots * ranks // world)


def _first_microbatch(batch: Any, microbatches: int) -> Any:
    tensors = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
    for tensor in tensors:
        if tensor.dim() == 0 or tensor.shape[0] % microbatches:
            raise PipelineError(
                f"the example batch of size {tensor.shape[0] if tensor.dim() else 'a scalar'} does not split "
                f"into {microbatches} equal microbatches"
            )
    pieces = tuple(t[: t.shape[0] // microbatches] for t in tensors)
    return pieces[0] if isinstance(batch, torch.Tensor) else pieces


def _object_device(device: torch.device) -> torch.device | None:
    return device if device.type == "cuda" else None


class Calibrated(Protocol):
    """What a :class:`Calibrator` sees of the Pipeline it calibrates: the resolution it runs (its
    schedule, layer bounds, plan and profile), its group and device, and its recorder slot."""

    @property
    def resolution(self) -> Resolution: ...

    @property
    def group(self) -> dist.ProcessGroup | None: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def recorder(self) -> OpRecorder | None: ...

    @recorder.setter
    def recorder(self, recorder: OpRecorder | None) -> None: ...


class Calibrator:
    """Calibrates a ``schedule="auto"`` Pipeline's plan from the run's own first steps (collective).

        The Pipeline calls :meth:`after_step` after every step until it returns the calibrated plan; the
    Calibrator sees the Pipeline only through :class:`Calibrated`: the resolution it runs, where it
    runs, and its recorder slot (the one thing it changes, for the recorded steps).  The first step is
        left out (it also exchanges shape headers and allocates); the next ``steps`` are recorded — by
        the Pipeline's own recorder with ``trace=True``, else by a :class:`~..observe.trace.TraceRecorder`
        attached for them only — then every rank of the pipeline sends its op intervals to rank 0, which
        takes per chunk and kind the median over the steps of the mean op time, runs
        :func:`~zerobubble.schedule.modelplan.calibrate` and broadcasts the calibrated plan.  A
        calibration that fails leaves the plan as it was and logs why: training goes on.
    """

    def __init__(self, steps: int):
        if steps < 1:
            raise PipelineError(f"calibrate must be a number of steps >= 1 (or 0 for none), got {steps}")
        self.steps = steps
        self.completed = 0
        self.recorder: StepRecorder | None = None
        # a recorder of the caller's, attached again after the recorded steps
        self.replaced: OpRecorder | None = None
        self.attached = False

    def after_step(self, pipe: Calibrated) -> Plan | None:
        """Count a finished step; attach the recorder after the first, calibrate after the last one.

        Returns None until the recorded steps are done, then the plan with its calibration (the
        running plan unchanged when the calibration failed); the Pipeline adopts it as its ``plan``.
        """
        self.completed += 1
        if self.completed == 1:
            self._attach(pipe)
        if self.completed < 1 + self.steps:
            return None
        try:
            return self._calibrated(pipe)
        finally:
            if self.attached:
                pipe.recorder = self.replaced

    def _attach(self, pipe: Calibrated) -> None:
        """Record with the Pipeline's step recorder, or attach one for the recorded steps (a recorder
        of the caller's that keeps no steps is put back afterwards; every rank records alike)."""
        if isinstance(pipe.recorder, StepRecorder):
            self.recorder = pipe.recorder
            return
        from ..observe.trace import TraceRecorder

        self.replaced = pipe.recorder
        self.recorder = TraceRecorder(pipe.device, keep=self.steps)
        pipe.recorder = self.recorder
        self.attached = True

    def _calibrated(self, pipe: Calibrated) -> Plan:
        """The plan with its calibration, the same on every rank of the pipeline (collective)."""
        from ..observe.trace import gather_timelines

        resolved = pipe.resolution
        assert self.recorder is not None and resolved.plan is not None and resolved.profile is not None
        timelines = gather_timelines(self.recorder, resolved.schedule, pipe.group, pipe.device)
        payload: list[Any] = [None]
        if timelines is not None:  # pipeline rank 0
            try:
                payload[0] = self._calibrate(resolved, timelines[-self.steps :])
            except Exception as error:  # every rank must learn of it, or the others wait in the broadcast
                payload[0] = f"{type(error).__name__}: {error}"
        source = dist.get_global_rank(pipe.group, 0) if pipe.group is not None else 0
        dist.broadcast_object_list(payload, src=source, group=pipe.group, device=_object_device(pipe.device))
        outcome = payload[0]
        if isinstance(outcome, str):
            logger.warning('schedule="auto": calibrating the plan from recorded steps failed: %s', outcome)
            return resolved.plan
        logger.info('schedule="auto": %s', outcome.calibration.describe())
        return outcome

    @staticmethod
    def _calibrate(resolved: Resolution, recorded: Sequence[MeasuredTimeline]) -> Plan:
        """Rank 0's calibrated plan from the recorded steps' timelines."""
        from ..observe.trace import measured_costs, transfer_latencies

        assert resolved.plan is not None and resolved.profile is not None
        per_step = [measured_costs([timeline]) for timeline in recorded]
        # the median step's op time per chunk: a burst of load elsewhere during one step is left out
        costs = {
            kind: [statistics.median(values) for values in zip(*(getattr(c, kind) for c in per_step))]
            for kind in ("f", "b", "w")
        }
        latencies = sorted(x for t in recorded for x in transfer_latencies(t))
        latency = latencies[len(latencies) // 2] if latencies else resolved.profile.comm_latency
        return calibrate(resolved.plan, resolved.profile, resolved.bounds, costs, latency, len(recorded))
