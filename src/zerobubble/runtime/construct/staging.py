"""From the user's layers and batch to this rank's stages and microbatches.

The Pipeline's preparation steps, each a plain function: name the layers, cut them into chunks
(evenly or at the user's cut points), resolve and validate the schedule, wrap a chunk's layers
into one :class:`StageModule`, and split a batch into microbatches.  Every mistake becomes a
:class:`PipelineError` that says what to pass instead.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ...schedule import CostModel, Schedule, ScheduleError, build_schedule, validate_schedule
from ...schedule.partition import even_partition
from ...schedule.vocab import add_vocab_ops
from .. import PipelineError
from ..tensors import is_dtensor

DEFAULT_MICROBATCHES = 8
"""The microbatch count of a Pipeline built from a registry name without ``microbatches``."""

W_MEMORY_FRACTION = 1.0
"""The activation memory a microbatch keeps from its B to its W, as a fraction of what its F kept
(``M_W / M_B``), used to plan when no ``costs`` are given.  Between B and W the runtime keeps what
each layer's weight gradient needs (:mod:`..wgrad`): a fast-path layer its input and its output
gradient, a generically split layer its local graph.  A transformer block keeps 16·s·b·h elements
against 17·s·b·h + 2.5·a·s²·b for F (fraction < 0.95), a Linear–GELU–Linear block 10/9 of F.
1.0 is also the largest fraction every builder accepts (zb-v needs W to free at least what B adds).
Measured peaks per schedule: ``docs/guide.md`` § Memory; give ``costs`` with your own
``mem_b``/``mem_w`` to plan exactly."""


def default_costs() -> CostModel:
    """The cost model a Pipeline plans with when the caller gives none (unit times, see above)."""
    return CostModel(mem_w=W_MEMORY_FRACTION)


@dataclass(frozen=True)
class Keywords:
    """The parameters of a layer's ``forward`` that can take a keyword argument.

    ``positional``: those that take a value by position or by name, in order (the layer's
    positional values fill the first ones); ``named``: the keyword-only ones; ``rest``: whether it
    has ``**kwargs`` (then it takes every name).
    """

    positional: tuple[str, ...] = ()
    named: frozenset[str] = frozenset()
    rest: bool = False

    def takes(self, name: str) -> bool:
        """Whether some call of the forward can take ``name`` by keyword."""
        return self.rest or name in self.named or name in self.positional

    def select(self, kwargs: Mapping[str, Any], given: int) -> dict[str, Any]:
        """The entries of ``kwargs`` the forward takes after ``given`` positional values."""
        filled = self.positional[:given]
        return {
            key: value
            for key, value in kwargs.items()
            if key not in filled and (self.rest or key in self.named or key in self.positional)
        }


def layer_keywords(layer: nn.Module) -> Keywords:
    """The keywords ``layer``'s class ``forward`` takes (:class:`Keywords`).

    Read from the class, not the instance: the weight-gradient split installs a ``(*args, **kwargs)``
    forward on the instance (:mod:`..wgrad`); of a compiled module, its original's.
    """
    target = getattr(layer, "_orig_mod", layer)  # torch.compile's OptimizedModule
    try:
        parameters = list(inspect.signature(type(target).forward).parameters.values())[1:]  # no self
    except (TypeError, ValueError):
        return Keywords()
    kind = inspect.Parameter
    return Keywords(
        positional=tuple(p.name for p in parameters if p.kind is kind.POSITIONAL_OR_KEYWORD),
        named=frozenset(p.name for p in parameters if p.kind is kind.KEYWORD_ONLY),
        rest=any(p.kind is kind.VAR_KEYWORD for p in parameters),
    )


class StageModule(nn.Module):
    """A contiguous run of layers; a layer returning a tuple passes it unpacked to the next one.

    Keyword arguments (``Pipeline.step(..., attention_mask=m)``, this microbatch's slice) reach
    every layer whose ``forward`` takes them by name (all of them with ``**kwargs``) other than a
    parameter its positional values fill; the signatures are inspected here once
    (:func:`layer_keywords`).
    """

    def __init__(self, layers: Sequence[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.keywords: list[Keywords] = [layer_keywords(layer) for layer in layers]

    def forward(self, *inputs: torch.Tensor, **kwargs: Any) -> Any:
        values: Any = inputs
        if not kwargs:
            for layer in self.layers:
                values = layer(*values) if isinstance(values, tuple) else layer(values)
            return values
        for layer, keywords in zip(self.layers, self.keywords):
            if isinstance(values, tuple):
                values = layer(*values, **keywords.select(kwargs, len(values)))
            else:
                values = layer(values, **keywords.select(kwargs, 1))
        return values


def resolve_schedule(
    schedule: str | Schedule,
    world: int,
    microbatches: int | None,
    chunks: int | None,
    costs: CostModel | None,
    *,
    vocab_parallel: bool = False,
) -> tuple[Schedule, Any]:
    """Build (or check) the schedule for ``world`` ranks and validate it: ``(schedule, timeline)``.

    ``vocab_parallel``: the schedule runs a vocabulary-parallel head, whose S and T ops a built
    schedule gets (and a given one without them too, :func:`~...schedule.vocab.add_vocab_ops`)."""
    costs = costs if costs is not None else default_costs()
    try:
        if isinstance(schedule, str):
            built = build_schedule(
                schedule,
                world,
                microbatches or DEFAULT_MICROBATCHES,
                costs=costs,
                chunks=chunks,
                validate=False,
                vocab_parallel=vocab_parallel,
            )
        else:
            built = schedule
            if vocab_parallel and not built.vocab_shards:
                built = add_vocab_ops(built, costs)
            if built.vocab_shards and not vocab_parallel:
                raise PipelineError(
                    f"schedule {built.name!r} has vocabulary-parallel ops (S, T): pass "
                    "head=VocabParallelHead(...)"
                )
            if microbatches is not None and microbatches != built.microbatches:
                raise PipelineError(
                    f"the schedule object runs {built.microbatches} microbatches but "
                    f"microbatches={microbatches} was given; drop the argument or build the schedule "
                    "for that count"
                )
        if built.num_ranks != world:
            raise PipelineError(
                f"schedule {built.name!r} needs {built.num_ranks} ranks but the process group has {world}; "
                f"start {built.num_ranks} ranks or build the schedule for {world}"
            )
        return built, validate_schedule(built, costs)
    except ScheduleError as error:
        raise PipelineError(
            f"schedule {getattr(schedule, 'name', schedule)!r} cannot run: {error}"
        ) from error


def checked_loss_fn(loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> Callable[[Any, Any], torch.Tensor]:
    """``loss_fn``, or a clear error when it is missing."""
    if loss_fn is None:
        raise PipelineError("Pipeline needs a loss_fn(output, target) returning a scalar tensor")
    return loss_fn


def stage_of(layer: int, bounds: list[int]) -> int:
    """The chunk (virtual stage) holding layer ``layer`` given the chunks' start indices."""
    return next(stage for stage in range(len(bounds) - 1) if layer < bounds[stage + 1])


def named_layers(layers: nn.Sequential | Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` in model order: a Sequential's child names, else the list positions."""
    if isinstance(layers, nn.Sequential):
        named = list(layers.named_children())
    else:
        named = [(str(index), layer) for index, layer in enumerate(layers)]
    for name, layer in named:
        if not isinstance(layer, nn.Module):
            raise PipelineError(f"layer {name} is a {type(layer).__name__}, not an nn.Module")
        _refuse_reducing_wrappers(name, layer)
    return named


def _refuse_reducing_wrappers(name: str, layer: nn.Module) -> None:
    """Wrappers whose gradient reduction the B/W split would silently bypass are an error.

    ``DistributedDataParallel`` and FSDP1 reduce from autograd's accumulation hooks, which W's own
    accumulation into ``.grad`` never fires (no reduction, no error); a layer the user sharded with
    FSDP2's ``fully_shard`` has ``DTensor`` parameters whose reduction FSDP2 would run from B's
    hooks, before W has written the gradients.  The Pipeline's own ``data_parallel`` replicates and
    averages correctly, ``data_parallel="fsdp"`` applies ``fully_shard`` itself and drives its
    reduction after W (:mod:`..parallel.fsdp`), and tensor parallelism goes through
    ``Pipeline(parallelize=...)``, applied to this rank's layers only.
    """
    for path, module in layer.named_modules():
        kind = type(module).__name__
        where = f"layer {name}" + (f" ({path})" if path else "")
        if kind in ("DistributedDataParallel", "FullyShardedDataParallel"):
            raise PipelineError(
                f"{where} is wrapped in {kind}, whose gradient reduction runs from autograd's "
                "accumulation hooks: the zero-bubble split computes weight gradients in W, where those "
                "hooks never fire, so the replicas would silently drift apart. Pass the unwrapped "
                "module and Pipeline(..., data_parallel=D) for data-parallel replicas, or "
                'Pipeline(..., mesh=mesh, data_parallel="fsdp") to shard them'
            )
        if any(base.__name__ == "FSDPModule" for base in type(module).__mro__):
            raise PipelineError(
                f"{where} was sharded with FSDP2's fully_shard: FSDP2 would reduce its gradients from "
                "B's hooks, before W has computed them. Pass the unwrapped module and "
                'Pipeline(..., mesh=mesh, data_parallel="fsdp"): the Pipeline applies fully_shard to '
                "each chunk itself and reduce-scatters after the chunk's last W"
            )
    for param_name, param in layer.named_parameters():
        if is_dtensor(param):
            raise PipelineError(
                f"layer {name}'s parameter {param_name} is a DTensor (FSDP2 fully_shard or tensor "
                "parallelism applied before the Pipeline cut the layers): pass plain layers, and "
                'Pipeline(..., mesh=mesh, data_parallel="fsdp") to shard them over the mesh\'s dp '
                "dimension (the Pipeline applies fully_shard itself) or Pipeline(..., mesh=mesh, "
                "parallelize=fn) for tensor parallelism, which calls fn(layer, mesh) on each layer of "
                "this rank's stages (e.g. parallelize_module(layer, mesh['tp'], plan)) before "
                "splitting its backward"
            )


def partition_bounds(count: int, stages: int, partition: Sequence[int] | None) -> list[int]:
    """Start index of every chunk, plus ``count`` at the end."""
    if partition is None:
        if count < stages:
            raise PipelineError(
                f"{count} layers cannot fill {stages} pipeline chunks; give at least {stages}"
            )
        return [0, *even_partition(count, stages), count]
    cuts = [int(c) for c in partition]
    bounds = [0, *cuts, count]
    if len(cuts) != stages - 1 or any(b >= a for a, b in zip(bounds[1:], bounds)):
        raise PipelineError(
            f"partition must list {stages - 1} strictly increasing layer indices in 1..{count - 1} "
            f"(where chunks 1..{stages - 1} start); got {list(partition)}"
        )
    return bounds


def split_batch(
    batch: Any, microbatches: int, what: str, device: torch.device
) -> list[tuple[torch.Tensor, ...]] | None:
    """``batch`` (a tensor or a tuple of tensors) as ``microbatches`` tuples along dim 0, on ``device``."""
    if batch is None:
        return None
    if isinstance(batch, Mapping):
        raise PipelineError(
            f"the {what} are a dict ({', '.join(map(str, batch))}); the pipeline passes tensors "
            "positionally — pass a tuple of tensors (e.g. tuple(batch.values())) and let the first "
            "layer take them in that order"
        )
    tensors = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
    for position, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise PipelineError(
                f"the {what} hold a {type(tensor).__name__} at position {position}; pass tensors only"
            )
        if tensor.dim() > 0 and tensor.shape[0] == 0:
            raise PipelineError(f"the {what} batch is empty (size 0 along dimension 0)")
        if tensor.dim() == 0 or tensor.shape[0] % microbatches:
            size = tensor.shape[0] if tensor.dim() else "a scalar"
            raise PipelineError(
                f"the {what} batch of size {size} does not split into {microbatches} equal microbatches; "
                f"use a batch size that is a multiple of {microbatches}"
            )
    pieces = [t.to(device, non_blocking=True).chunk(microbatches) for t in tensors]
    return [tuple(piece[j] for piece in pieces) for j in range(microbatches)]


def split_call(
    inputs: Any,
    targets: Any,
    microbatches: int,
    device: torch.device,
    call: str,
    rank: int,
    ends: tuple[bool, bool],
) -> tuple[list[tuple[torch.Tensor, ...]], list[Any]]:
    """A call's ``(inputs, targets)`` as microbatches on rank ``rank``; ``ends`` says whether it holds
    the first and the last stage (which need the inputs, the targets).  A target microbatch of one
    tensor is that tensor."""
    split_inputs = split_batch(inputs, microbatches, "inputs", device)
    split_targets = split_batch(targets, microbatches, "targets", device)
    if ends[0] and split_inputs is None:
        raise PipelineError(f"rank {rank} holds the first stage: pass the batch inputs to {call}()")
    if ends[1] and split_targets is None:
        raise PipelineError(f"rank {rank} holds the last stage: pass the targets to {call}()")
    targets_mb = [t[0] if len(t) == 1 else t for t in split_targets] if split_targets else []
    return split_inputs or [], targets_mb


_PLAIN_VALUES = (type(None), bool, int, float, complex, str, bytes)


def split_keywords(
    kwargs: Mapping[str, Any],
    microbatches: int,
    device: torch.device,
    call: str,
    keywords: Sequence[tuple[str, Keywords]],
) -> list[dict[str, Any]]:
    """A call's keyword arguments as one dict per microbatch (``[]`` without any).

    A tensor of at least one dimension is moved to ``device`` and split along dim 0 like the inputs;
    a 0-d tensor and any value that holds no tensor (None, a number, a string, an object) reach every
    microbatch unchanged.  ``keywords`` are ``(layer name, names)`` of every layer of the model
    (:func:`layer_keywords`): a name no layer takes is refused, so is a tensor that requires grad in
    ``step`` (its gradient would be split over the ranks holding its users) and a container holding
    tensors (they would not be split).
    """
    if not kwargs:
        return []
    pieces: dict[str, Any] = {}
    for key, value in kwargs.items():
        if not any(names.takes(key) for _, names in keywords):
            # (a layer's first positional parameter takes the previous layer's output)
            listed = [
                f"{layer} ({', '.join([*names.positional[1:], *sorted(names.named)])})"
                for layer, names in keywords
                if names.positional[1:] or names.named
            ][:8]
            known = f"layers taking keywords: {'; '.join(listed)}" if listed else "no layer takes keywords"
            raise PipelineError(
                f"the keyword argument {key!r} of {call}() is taken by no layer's forward ({known}); "
                "add it to the forward of the layers that need it, or drop it"
            )
        if isinstance(value, torch.Tensor):
            pieces[key] = _split_keyword(key, value, microbatches, device, call)
        elif not isinstance(value, _PLAIN_VALUES) and any(
            isinstance(leaf, torch.Tensor) for leaf in tree_leaves(value)
        ):
            raise PipelineError(
                f"the keyword argument {key!r} of {call}() is a {type(value).__name__} holding tensors; "
                "only a tensor keyword argument is split into microbatches — pass each tensor as a "
                "keyword argument of its own"
            )
        else:
            pieces[key] = [value] * microbatches
    return [{key: piece[j] for key, piece in pieces.items()} for j in range(microbatches)]


def _split_keyword(
    key: str, tensor: torch.Tensor, microbatches: int, device: torch.device, call: str
) -> Sequence[torch.Tensor]:
    if call == "step" and tensor.requires_grad:
        raise PipelineError(
            f"the keyword argument {key!r} of step() requires grad: keyword arguments are constants of "
            "the layers that take them (no gradient flows back to them, so the B/W split stays exact); "
            f"pass {key}=value.detach(), or compute it in a layer and pass it on positionally"
        )
    tensor = tensor.to(device, non_blocking=True)
    if tensor.dim() == 0:
        return [tensor] * microbatches
    if tensor.shape[0] == 0 or tensor.shape[0] % microbatches:
        raise PipelineError(
            f"the keyword argument {key!r} of {call}() has batch size {tensor.shape[0]} (dimension 0), "
            f"which does not split into {microbatches} equal microbatches; pass the same batch size as "
            "the inputs (a tensor without a batch dimension: keep it in the layer, e.g. as a buffer)"
        )
    return tensor.chunk(microbatches)


def merge_microbatches(values: Sequence[Any]) -> Any:
    """The per-microbatch outputs ``values`` as one batch: tensors concatenated along dim 0 (0-d
    tensors stacked), tuples, lists and dicts merged entry by entry, other values listed."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(values)) if first.dim() else torch.stack(list(values))
    if isinstance(first, Mapping):
        return {key: merge_microbatches([value[key] for value in values]) for key in first}
    if isinstance(first, (tuple, list)):
        merged = [merge_microbatches([value[i] for value in values]) for i in range(len(first))]
        if hasattr(first, "_fields"):  # a named tuple
            return type(first)(*merged)
        return type(first)(merged)
    return list(values)
