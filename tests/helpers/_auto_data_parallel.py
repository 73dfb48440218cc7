"""Rank worker of tests/runtime/construct/test_auto_data_parallel.py: ``schedule="auto"`` on a mesh of
pp 2 × dp 2 trained beside one process (:func:`_training_equivalence.train_case`), with what its plan
chose for the replicas and what the Pipeline runs."""

from __future__ import annotations

from typing import Any

import _training_equivalence as equivalence
from _training_equivalence import Case


def auto_case(
    layout: str, fsdp: tuple[str | int, bool, bool | None, int] | None, memory_limit: str | None = None
) -> Case:
    """``schedule="auto"`` on ``layout`` ("mesh-fsdp" or "mesh-replicate"), ``fsdp=`` and the budget as
    given."""
    return Case(
        schedule="auto", microbatches=2, blocks=4, vocab_parallel=False, tied=False, checkpointing=False,
        optimizer="adam", lr=0.05, max_norm=None, post_validation=True, loop="zero-first", layout=layout,
        steps=3, calibrate=0, fsdp=fsdp, memory_limit=memory_limit,
    )  # fmt: skip


def train_auto(case: Case, offered: tuple[Any, ...] | None = None) -> dict[str, Any]:
    """``case`` trained on this rank (the worst errors against one process), and the plan's
    data-parallel choice, the options the Pipeline lowered and sharded with, and the plan's reason.
    ``offered``: the only records the planner may choose from (else its own candidates)."""
    from zerobubble.schedule.modelplan import choices

    built: list[Any] = []
    original, candidates = equivalence._pipeline, choices.planner_candidates

    def kept(case: Case, model: dict[str, Any]) -> Any:
        built.append(original(case, model))
        return built[-1]

    equivalence._pipeline = kept  # train_case builds the Pipeline: keep it to read its plan
    if offered is not None:  # on every rank alike (rank 0 plans)
        choices.planner_candidates = lambda grid: list(offered)
    try:
        result = equivalence.train_case(case)
    finally:
        equivalence._pipeline, choices.planner_candidates = original, candidates
    pipe = built[0]
    sharded = pipe._sharded
    result.update(
        planned=pipe.plan.comm.options if pipe.plan.comm is not None else None,
        lowered=pipe.lowered.options,
        sharded=sharded.options if sharded is not None else None,
        reason=pipe.plan.reason,
        comm_reason=pipe.plan.comm.reason if pipe.plan.comm is not None else "",
        tried=pipe.plan.comm.tried if pipe.plan.comm is not None else (),
    )
    return result


def train_offered(job: tuple[Case, tuple[Any, ...]]) -> dict[str, Any]:
    """:func:`train_auto` of ``(case, offered)`` (a rank pool passes one argument)."""
    return train_auto(*job)
