"""Construction, step two: this rank's part of a :class:`~.resolve.Resolution`.

:func:`place_stages` keeps this rank's chunks (moved to its device, registered under their original
names, each with its weight-gradient store, deferral and split guard); :func:`tie_parameters`
creates the groups of the parameters tied across ranks and starts their copies equal.  The
:func:`chain_optimizer` and :func:`install_averager` set up the optimizer step and the data-parallel
reductions.  The :class:`~.pipeline.Pipeline` calls them once every rank has agreed on the resolution.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..schedule.ir import Kind, Op
from .consistency import TiedParameter
from .data_parallel import (
    GradientAverager,
    ParallelLayout,
    chunk_parameters,
    first_forward,
    last_gradient_ops,
)
from .executor import Executor, Hook, StageState
from .fsdp import ShardedStages, ShardFn
from .optim import PipelineOptimizer, validation_chain
from .resolve import Resolution
from .staging import StageModule, stage_of
from .wgrad import FastPaths, WeightGradStore, install_deferral
from .wgrad.verify import SplitGuard


def place_stages(
    resolution: Resolution,
    rank: int,
    device: torch.device,
    module: nn.Module,
    fast_paths: FastPaths | None,
    verify: bool | str,
    shard: ShardFn | None = None,
) -> tuple[dict[int, StageState], dict[int, SplitGuard]]:
    """Cut the layers into chunks and keep rank ``rank``'s, registered in ``module`` under their
    original names: ``(stages, guards)`` by stage index.  Each stage's split gets a guard
    (:mod:`.wgrad.verify`), checking it unless ``verify`` is False.  ``shard(stage, stage_module)``
    (``sharding="fsdp"``: :class:`~.fsdp.ShardedStages`) runs on each chunk before its backward is
    split, so that the split sees the parameters the forwards will use."""
    schedule, named, bounds = resolution.schedule, resolution.layers, resolution.bounds
    stages, guards = {}, {}
    for index in schedule.placement.stages_of(rank):
        chunk = named[bounds[index] : bounds[index + 1]]
        for name, layer in chunk:
            module.add_module(name, layer.to(device))
        layers = [layer for _, layer in chunk]
        stage_module = StageModule(layers)
        if shard is not None:
            shard(index, stage_module)
        store = WeightGradStore()
        # fused schedules too: their BW ops gain the fast paths' cheaper accumulation
        deferral = install_deferral(layers, store, fast_paths, generic=schedule.splits_backward)
        state = StageState(
            index,
            stage_module,
            store,
            first=index == 0,
            last=index == schedule.num_stages - 1,
            name=f"layers {chunk[0][0]}..{chunk[-1][0]}",
        )
        kinds = {op.kind for op in schedule.programs[rank] if op.stage == index}
        guard = guards[index] = SplitGuard(
            stage=index,
            module=state.module,
            store=store,
            deferral=deferral,
            names={id(child): name for name, child in module.named_modules()},
            strict=verify == "strict",
            deferred=Kind.W in kinds,
            fused=Kind.BW in kinds,
        )
        state.guard = guard if verify is not False else None
        stages[index] = state
    return stages, guards


def tie_parameters(
    resolution: Resolution, rank: int, layout: ParallelLayout, module: nn.Module
) -> list[TiedParameter]:
    """Groups for the ties spanning several ranks (collective: every replica, every tie, in order);
    each copy then holds the value of the tie's first holder."""
    placement, bounds, tied = resolution.schedule.placement, list(resolution.bounds), []
    for uses in resolution.ties:
        holders = sorted({placement.rank_of(stage_of(index, bounds)) for index, _ in uses})
        if len(holders) < 2:
            continue  # one rank holds every use: autograd accumulates into the one Parameter
        source = placement.rank_of(stage_of(uses[0][0], bounds))
        for replica in range(layout.data_parallel):
            ranks = [layout.global_rank(holder, replica) for holder in holders]
            created = dist.new_group(ranks, timeout=layout.setup_timeout)
            if replica == layout.dp_index and rank in holders:
                local = next(
                    name for index, name in uses if rank == placement.rank_of(stage_of(index, bounds))
                )
                param = module.get_parameter(local)
                tied.append(TiedParameter(uses[0][1], param, created, layout.global_rank(source)))
    for tie in tied:
        tie.broadcast_value()
    return tied


def chain_optimizer(
    resolution: Resolution,
    layout: ParallelLayout,
    rank: int,
    device: torch.device,
    post_validation: bool,
    wait: Callable[..., Any],
    tied: Sequence[TiedParameter],
    sharded: bool = False,
) -> PipelineOptimizer:
    """The optimizer step of pipeline rank ``rank``: the ranks chained in the order the resolved
    timeline finishes them (:func:`~.optim.validation_chain`)."""
    finish_times = [ends[-1] if ends else 0.0 for ends in resolution.timeline.end]
    chain = [layout.global_rank(r) for r in validation_chain(finish_times)]
    return PipelineOptimizer(
        chain,
        layout.global_rank(rank),
        layout.control_group,
        post_validation,
        device,
        wait=wait,
        # a tied parameter's summed gradient is counted once, by the holder of its first layer
        norm_excludes=[t.param for t in tied if t.source != layout.global_rank(rank)],
        # sharded gradients: each rank's norm state covers its shards, summed over the replicas first
        shard_group=layout.dp_group if sharded else None,
    )


def install_averager(
    executor: Executor, program: Sequence[Op], layout: ParallelLayout, wait: Callable[..., Any]
) -> GradientAverager | None:
    """With data parallelism, the averager of the replicas' gradients, each chunk's all-reduce
    started by a hook after its last gradient op; None with one replica."""
    if layout.data_parallel == 1:
        return None
    last_ops = last_gradient_ops(program)
    chunks = chunk_parameters(executor.stages, last_ops)
    averager = GradientAverager(chunks, layout.dp_group, layout.data_parallel, wait=wait)
    for stage, position in last_ops.items():  # a chunk's gradients are final after this op
        start = functools.partial(averager.start, stage)
        executor.add_hook(position, Hook(f"all-reduce start (stage {stage})", start), after=True)
    return averager


def install_sharded_reduction(executor: Executor, program: Sequence[Op], sharded: ShardedStages) -> None:
    """``sharding="fsdp"``: every chunk unsharded before the first forward (after the optimizer
    settle hook, added earlier), reduce-scattered by FSDP2 after its last gradient op."""
    executor.add_hook(first_forward(program), Hook("FSDP unshard", sharded.unshard))
    for stage, position in last_gradient_ops(program).items():
        reduce = functools.partial(sharded.reduce, stage)
        executor.add_hook(position, Hook(f"FSDP reduce-scatter (stage {stage})", reduce), after=True)
