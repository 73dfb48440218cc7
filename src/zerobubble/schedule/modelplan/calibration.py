"""Calibration: a running plan checked against the run's own recorded steps, and planned again.

:func:`calibrate` (called by the runtime's ``schedule="auto"`` after its first recorded steps) scales
the layer profile a plan came from to the op times the run measured per chunk
(:func:`calibrated_profile`), simulates the running schedule and partition under it — the
calibrated prediction — and runs :func:`~.search.plan` again on it.  :func:`profile_from_trace` does
the same scaling for a recorded run's ``summary.json`` (``zerobubble plan --trace``).

Pure Python; no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..builders import get_spec
from ..compare import iteration_period
from ..ir import ScheduleError
from ..simulate import simulate
from .profile import LayerProfile, ModelProfile, stage_costs
from .result import Calibration, Plan
from .search import plan


def calibrate(
    running: Plan,
    profile: ModelProfile,
    layer_bounds: Sequence[int],
    measured: Mapping[str, Sequence[float]],
    transfer_latency: float,
    steps: int,
    tie_margin: float = 0.02,
) -> Plan:
    """``running`` with its :class:`Calibration` from a run's recorded op times (pure; see the class).

    ``profile`` is the layer profile ``running`` came from, ``layer_bounds`` the run's chunk bounds
    and ``measured`` the mean op durations per chunk, ``{"f": [...], "b": [...], "w": [...]}`` in
    seconds.  The re-plan tries the schedules and chunk counts ``running`` tried, under its budget
    and optimizer mode; it replaces the running plan only when predicted faster by more than
    ``tie_margin``.
    """
    f, b, w = (tuple(float(x) for x in measured[key]) for key in ("f", "b", "w"))
    scaled = calibrated_profile(profile, layer_bounds, f, b, w, transfer_latency)
    schedule = running.schedule
    costs = stage_costs(scaled, running.partition, schedule.num_stages, fused=not schedule.splits_backward)
    predicted = iteration_period(simulate(schedule, costs), running.optimizer)
    names = list(dict.fromkeys(c.schedule for c in running.candidates))
    interleaved = sorted({c.chunks for c in running.candidates if get_spec(c.schedule).chunks is None})
    again = plan(
        scaled,
        running.ranks,
        running.microbatches,
        running.memory_budget,
        schedules=names,
        interleaved_chunks=interleaved or (2,),
        optimizer=running.optimizer,
    )
    chosen, current = again.winner, running.winner
    same = (chosen.schedule, chosen.chunks, chosen.partition) == (
        current.schedule,
        current.chunks,
        current.partition,
    )
    assert chosen.period is not None
    keeps = same or chosen.period >= predicted * (1 - tie_margin)
    calibration = Calibration(
        steps,
        f,
        b,
        w,
        transfer_latency,
        scaled,
        running.predicted_iteration_time,
        predicted,
        again,
        keeps,
    )
    return replace(running, calibration=calibration)


def profile_from_trace(summary: Mapping[str, Any]) -> ModelProfile:
    """A profile from a run's ``summary.json`` (:func:`~zerobubble.runtime.observe.trace.write_trace`).

    The trace measured F, B and W per virtual stage.  When the run recorded its layer profile
    (``schedule="auto"``) and layer bounds, each layer keeps its profiled share of its stage and is
    scaled so that the stage's sums equal the measured ones (a fused BW is split in the profile's
    B : W ratio); memory comes from the profile.  Otherwise every recorded stage becomes one layer
    with the measured times and no byte counts (``bytes_known=False``: one placeholder unit of
    activations a stage, as the run planned without ``costs``; the plan reports no bytes and refuses
    a byte budget).  ``T_comm`` is the run's median measured transfer latency.
    """
    try:
        measured = summary["costs_seconds"]
        f, b, w = (list(measured[key]) for key in ("f", "b", "w"))
    except (KeyError, TypeError):
        raise ScheduleError(
            "not a trace summary: summary.json lacks costs_seconds; record one with "
            "'zerobubble train --trace DIR'"
        ) from None
    latency = float(summary.get("transfer_latency") or 0.0)
    bounds = list(summary.get("layer_bounds") or ())
    recorded = summary.get("layer_profile")
    if not recorded or len(bounds) != len(f) + 1:
        layers = tuple(
            LayerProfile(f"stage {s}", f[s], b[s], w[s], activation_bytes=1.0, weight_input_bytes=1.0)
            for s in range(len(f))
        )
        return ModelProfile(
            layers, comm_latency=latency, source="trace (per stage, times only)", bytes_known=False
        )
    calibrated = calibrated_profile(ModelProfile.from_dict(recorded), bounds, f, b, w, latency)
    return replace(calibrated, source="trace (per layer)")


def calibrated_profile(
    profile: ModelProfile,
    layer_bounds: Sequence[int],
    f: Sequence[float],
    b: Sequence[float],
    w: Sequence[float],
    latency: float,
) -> ModelProfile:
    """``profile`` with each chunk's layers scaled so that their sums equal a run's measured op times.

    ``layer_bounds`` are the run's chunk bounds (chunk ``s`` holds layers ``[bounds[s], bounds[s+1])``)
    and ``f``, ``b``, ``w`` the measured mean op duration of each chunk in seconds (a fused BW recorded
    as B with ``w = 0``).  Each layer keeps its profiled share of its chunk (:func:`_rescaled`); bytes
    are unchanged.  ``latency`` (the run's measured one-way transfer time) becomes ``T_comm``, with
    no size term: it was measured on the messages the run sends.
    """
    if len(layer_bounds) != len(f) + 1 or layer_bounds[-1] != len(profile.layers):
        raise ScheduleError(
            f"cannot calibrate a profile of {len(profile.layers)} layers with the chunk bounds "
            f"{list(layer_bounds)} of {len(f)} measured chunks"
        )
    scaled: list[LayerProfile] = []
    for stage in range(len(f)):
        group = profile.layers[layer_bounds[stage] : layer_bounds[stage + 1]]
        scaled.extend(_rescaled(group, f[stage], b[stage], w[stage]))
    return replace(
        profile,
        layers=tuple(scaled),
        comm_latency=latency,
        comm_bandwidth=0.0,
        source=f"{profile.source}; calibrated by a run's measured op times",
    )


def _rescaled(group: Sequence[LayerProfile], f: float, b: float, w: float) -> list[LayerProfile]:
    """``group``'s layers with their times scaled to the measured stage sums (shares kept as profiled).

    A split run (W measured, or no W to measure) scales B and W each; a run of fused BW ops
    (``w == 0`` although the profile has W) scales B, W and the fused backward by measured BW over
    profiled BW.
    """
    total_f = math.fsum(layer.forward for layer in group)
    total_b = math.fsum(layer.backward_input for layer in group)
    total_w = math.fsum(layer.backward_weight for layer in group)
    total_fused = math.fsum(layer.fused for layer in group)

    def ratio(measured: float, profiled: float) -> float:
        return measured / profiled if profiled > 0 else 1.0

    scale_f = ratio(f, total_f)
    if w == 0.0 and total_w > 0.0:
        scale_b = scale_w = scale_fused = ratio(b, total_fused)
    else:
        scale_b, scale_w, scale_fused = ratio(b, total_b), ratio(w, total_w), ratio(b + w, total_b + total_w)
    return [
        replace(
            layer,
            forward=layer.forward * scale_f,
            backward_input=layer.backward_input * scale_b,
            backward_weight=layer.backward_weight * scale_w,
            backward_fused=layer.backward_fused * scale_fused,
        )
        for layer in group
    ]
