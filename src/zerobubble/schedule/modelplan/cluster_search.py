"""The search over a cluster's layouts that :func:`~.cluster.plan_cluster` and
:func:`~.moe.plan_moe_cluster` share: every layout's schedule planned (in worker processes with
``ClusterSearch.jobs``), then its communication chosen in the order of a lower bound, pruning what
cannot be among the ``keep`` fastest within the memory budget (``docs/auto-planning.md``, "Speed,
and the prune").  Pure Python; no torch."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .cluster import ClusterOption, ClusterSearch, _option, _Scheduled, _scheduled, _Setting
from .layout import Grid

__all__ = ["search_layouts"]


def search_layouts(candidates: Sequence[tuple[_Setting, Grid]], search: ClusterSearch) -> list[ClusterOption]:
    """Each ``(setting, grid)`` planned (by ``search.jobs`` processes) and its communication chosen,
    in the candidates' order; with ``search.keep``, only as far as needed for the ``keep`` fastest
    steps within the memory budget to be exact (a layout over it, :attr:`ClusterOption.fits` False,
    ranks after them and prunes nothing).

    A layout's step is at least its busiest GPU's compute (the compute stream runs its ops one at a
    time, whatever the communication and however much all-to-all a pair hides): every layout's
    schedule is planned, then the layouts are simulated in the order of that bound, and once ``keep``
    steps are known a layout whose bound exceeds the ``keep``-th fastest is not simulated
    (``pruned``, with a note saying why).  Why not a cheaper bound before planning: docs/auto-planning.md."""
    planned = _plan_all(candidates, search.jobs)
    keep = search.keep
    options: list[ClusterOption | None] = [None] * len(planned)
    steps: list[float] = []
    for index in sorted(range(len(planned)), key=lambda i: _bound(planned[i])):
        found, setting = planned[index], candidates[index][0]
        if isinstance(found, _Scheduled) and keep and len(steps) >= keep and found.bound > steps[keep - 1]:
            options[index] = _pruned(found, steps[keep - 1], keep)
            continue
        option = options[index] = _option(setting, found) if isinstance(found, _Scheduled) else found
        if option.plan is not None and option.fits:  # one over the budget prunes nothing
            steps = sorted([*steps, option.step_time])
    return [option for option in options if option is not None]


def _plan_all(candidates: Sequence[tuple[_Setting, Grid]], jobs: int) -> list[_Scheduled | ClusterOption]:
    """:func:`_scheduled` of every candidate, in order, by ``jobs`` worker processes (pure functions
    of picklable records: the same plans as in this process)."""
    if jobs == 1 or len(candidates) < 2:
        return [_scheduled(setting, grid) for setting, grid in candidates]
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=min(jobs, len(candidates))) as pool:
        return list(pool.map(_scheduled_candidate, candidates))


def _scheduled_candidate(candidate: tuple[_Setting, Grid]) -> _Scheduled | ClusterOption:
    return _scheduled(*candidate)


def _bound(found: _Scheduled | ClusterOption) -> float:
    return found.bound if isinstance(found, _Scheduled) else -math.inf


def _pruned(found: _Scheduled, threshold: float, keep: int) -> ClusterOption:
    """``found`` not simulated: its compute alone is slower than the ``keep``-th fastest step."""
    grid = found.grid
    note = (
        f"not simulated: its busiest GPU computes {found.bound:.3f} s, more than the step of the "
        f"{keep}. fastest layout, {threshold:.3f} s"
    )
    return ClusterOption(
        grid.pp, grid.dp, grid.tp, grid.sharding, found.microbatches, None, note=note, pruned=True
    )
