"""Rank worker of tests/runtime/parallel/test_dp_buckets.py: the all-reduces a replicated Pipeline
really posts over its data-parallel group in one step, beside the buckets its lowered program names.

:func:`posted_buckets` builds a :class:`~_training_equivalence.Case`'s Pipeline, spies on
``torch.distributed.all_reduce`` during one training step and returns, in posting order, the
element count of every asynchronous all-reduce over the rank's data-parallel group, and the
gradient element counts of the lowered program's ``issue all_reduce`` actions, in program order.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from _dist import DistSpy
from _training_equivalence import Case, _batch, _optimizer, _pipeline, build_model

from zerobubble.schedule.lowering import CommKind, Issue


class _Posts(DistSpy):
    def __init__(self, group: Any):
        super().__init__(["all_reduce"])
        self.group, self.sizes = group, []

    def seen(self, name: str, args: tuple, kwargs: dict) -> None:
        if kwargs.get("group") is self.group and kwargs.get("async_op"):
            self.sizes.append(args[0].numel())


def posted_buckets(case: Case) -> dict[str, list[int]]:
    """One step of ``case``: the all-reduces posted over the data-parallel group (element counts,
    in order; the loss's average excluded) and the lowered program's buckets (module docstring)."""
    pipe = _pipeline(case, build_model(case))
    grid = pipe.layout.grid
    lowered = pipe.lowered
    program = lowered.program_of(grid.pipeline_rank, grid.dp_index)
    itemsize = 8  # float64 gradients
    expected = [
        int(lowered.part_grad_bytes[a.comm.stage][a.comm.index]) // itemsize
        for a in program
        if isinstance(a, Issue) and a.comm.kind is CommKind.ALL_REDUCE
    ]
    spy = _Posts(pipe.layout.dp_group)
    with spy:
        pipe.step(*(t.chunk(grid.dp)[grid.dp_index] for t in _batch(case, 0, grid.dp)))
    optimizer = _optimizer(case, list(pipe.parameters()))
    pipe.optimizer_step(optimizer, max_norm=case.max_norm)
    pipe.synchronize()
    dist.barrier()
    posted = [size for size in spy.sizes if size > 1]  # the mean loss's average is one element
    return {"posted": posted, "expected": expected}


def mismatched_buckets(case: Case) -> str:
    """``case``'s Pipeline with another bucket size on rank 0 than on its peers: the error this rank
    raises ("accepted" if none)."""
    from dataclasses import replace

    from zerobubble.runtime import PipelineError

    mine = replace(case, bucket_bytes=1.0 if dist.get_rank() == 0 else case.bucket_bytes)
    try:
        _pipeline(mine, build_model(mine))
    except PipelineError as error:
        return str(error)
    finally:
        dist.barrier()
    return "accepted"
