"""Construction, step two: this rank's part of a :class:`~.resolve.Resolution`.

:func:`place_stages` keeps this rank's chunks (moved to its device, registered under their original
names, each with its weight-gradient store, deferral and split guard, as the
:class:`~.request.PipelineRequest` asks); :func:`tie_parameters`
finds the parameters tied across ranks and starts their copies equal (the optimizer step and the
data-parallel reductions are set up by :mod:`..optim.step`).  The :class:`~..pipeline.Pipeline`
calls them once every rank has agreed on the resolution.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ...schedule.ir import Kind
from .. import PipelineError
from ..execute.executor import StageState
from ..parallel.consistency import TiedParameter
from ..parallel.data_parallel import (
    ParallelLayout,
)
from ..parallel.fsdp import ShardFn
from ..tensors import is_dtensor
from ..wgrad import WeightGradStore, install_deferral
from ..wgrad.verify import SplitGuard
from .resolve import Resolution
from .staging import StageModule, stage_of

if TYPE_CHECKING:
    from .request import PipelineRequest


def place_stages(
    resolution: Resolution,
    request: PipelineRequest,
    *,
    rank: int,
    device: torch.device,
    module: nn.Module,
    shard: ShardFn | None = None,
    experts: Callable[[nn.Module], nn.Module] | None = None,
) -> tuple[dict[int, StageState], dict[int, SplitGuard]]:
    """Cut the layers into chunks and keep rank ``rank``'s, registered in ``module`` under their
    original names: ``(stages, guards)`` by stage index.  Each stage's split gets a guard
    (:mod:`..wgrad.verify`), checking it unless the request's ``verify`` is False; the request's
    ``fast_paths`` join the split's rules.

    ``parallelize(layer, mesh)`` (tensor parallelism) and ``experts(layer)`` (expert parallelism)
    replace each layer on ``device`` before its backward is split (:func:`parallelized`); so does
    ``shard(stage, stage_module)`` (``data_parallel="fsdp"``: :class:`~..parallel.fsdp.ShardedStages`)
    each chunk, so that the split sees the parameters the forwards will use."""
    parallelize, mesh, verify = request.parallelize, request.mesh, request.verify
    schedule, named, bounds = resolution.schedule, resolution.layers, resolution.bounds
    stages, guards = {}, {}
    for index in schedule.placement.stages_of(rank):
        chunk = [
            (name, parallelized(name, layer.to(device), parallelize, mesh, experts))
            for name, layer in named[bounds[index] : bounds[index + 1]]
        ]
        for name, layer in chunk:
            module.add_module(name, layer)
        layers = [layer for _, layer in chunk]
        stage_module = StageModule(layers)
        if shard is not None:
            shard(index, stage_module)
        store = WeightGradStore()
        # fused schedules too: their BW ops gain the fast paths' cheaper accumulation
        deferral = install_deferral(layers, store, request.fast_paths, generic=schedule.splits_backward)
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
    if parallelize is not None:
        _check_local_ties(resolution, set(stages), module)
    return stages, guards


def _check_local_ties(resolution: Resolution, held: set[int], module: nn.Module) -> None:
    """The uses of a tied parameter on this rank still share one Parameter after ``parallelize``
    (sharding one use's module replaces its Parameter and would silently untie them)."""
    bounds = list(resolution.bounds)
    for uses in resolution.ties:
        names = [name for index, name in uses if stage_of(index, bounds) in held]
        if len({id(module.get_parameter(name)) for name in names}) > 1:
            raise PipelineError(
                f"parallelize untied the parameters {', '.join(names)} (tied in the layers given): "
                "leave the modules that use a tied parameter unparallelized"
            )


def parallelized(
    name: str,
    layer: nn.Module,
    parallelize: Callable[[nn.Module, Any], nn.Module] | None,
    mesh: Any,
    experts: Callable[[nn.Module], nn.Module] | None = None,
) -> nn.Module:
    """``parallelize(layer, mesh)`` (``layer`` itself without a hook), checked: an ``nn.Module``
    whose parameter names are the layer's own (checkpoints, ties and the consistency check use them).
    ``experts(layer)`` first shards its experts in place (:func:`~..parallel.experts.shard_experts`).

    Its parameters may be ``DTensor``s (tensor parallelism): the split computes their gradients as
    ``DTensor``s with the placements plain autograd gives them (``docs/guide.md``).
    """
    if experts is not None:
        layer = experts(layer)
    if parallelize is None:
        return layer
    names = [n for n, _ in layer.named_parameters(remove_duplicate=False)]
    result = parallelize(layer, mesh)
    if not isinstance(result, nn.Module):
        raise PipelineError(
            f"parallelize(layer, mesh) returned a {type(result).__name__} for layer {name}; return the "
            "layer to use (parallelize_module returns the module it was given)"
        )
    changed = [n for n, _ in result.named_parameters(remove_duplicate=False)]
    if changed != names:
        raise PipelineError(
            f"parallelize(layer, mesh) changed the parameter names of layer {name} ({names[:4]} -> "
            f"{changed[:4]}): parallelize the layer's submodules in place (parallelize_module on the "
            "layer, with a plan of its own submodule names) and return it, without wrapping it"
        )
    return result


def tie_parameters(
    resolution: Resolution,
    rank: int,
    layout: ParallelLayout,
    module: nn.Module,
    wait: Callable[[Any, str], None],
) -> list[TiedParameter]:
    """This rank's copies of the parameters tied across ranks; each copy then holds the value of the
    tie's first holder (point to point over the layout's ties group, collective over the replica).
    A tie across ranks whose copy ``parallelize`` made a DTensor is refused on every rank."""
    placement, bounds, tied = resolution.schedule.placement, list(resolution.bounds), []
    for tag, uses in enumerate(resolution.ties):
        holders = sorted({placement.rank_of(stage_of(index, bounds)) for index, _ in uses})
        if len(holders) < 2 or rank not in holders:
            continue  # one rank holds every use: autograd accumulates into the one Parameter
        source = placement.rank_of(stage_of(uses[0][0], bounds))
        local = next(name for index, name in uses if rank == placement.rank_of(stage_of(index, bounds)))
        tied.append(
            TiedParameter(
                uses[0][1],
                module.get_parameter(local),
                layout.ties_group,
                [layout.grid.global_rank(holder) for holder in holders],
                layout.grid.global_rank(source),
                tag,
            )
        )
    if any(len({placement.rank_of(stage_of(i, bounds)) for i, _ in uses}) > 1 for uses in resolution.ties):
        _refuse_sharded_ties(tied, layout.ties_group, module)
    for tie in tied:
        tie.broadcast_value(wait)
    return tied


def _refuse_sharded_ties(tied: Sequence[TiedParameter], group: Any, module: nn.Module) -> None:
    """A parameter tied across ranks that ``parallelize`` made a ``DTensor`` on some holder is an
    error on every rank of the replica (one max-reduce over ``group``): its copies are broadcast
    and their gradients summed as plain tensors."""
    sharded = [tie.name for tie in tied if is_dtensor(tie.param)]
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    flag = torch.tensor([float(bool(sharded))], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item() > 0:
        raise PipelineError(
            f"a parameter tied across pipeline ranks ({', '.join(sharded) or 'on another rank'}) is a "
            "DTensor after parallelize: ties across ranks hold plain parameters only; leave that layer "
            "unparallelized or place the tied layers on one rank"
        )
