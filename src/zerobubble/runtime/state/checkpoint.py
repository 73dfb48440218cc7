"""Checkpoints that interchange with the unpipelined model, tied parameters included.

Each rank's :meth:`~zerobubble.runtime.Pipeline.state_dict` holds every entry the unpipelined
model's ``state_dict()`` has for the layers that rank holds — parameters, persistent buffers, extra
state — under the same names, in the same order.  A parameter tied across layers (a language model's
head reusing the embedding's weight) appears under each of its names, as in the unpipelined model:
its first name on the rank holding its first layer, each alias on the rank holding that layer (one
rank may hold both).  The layers of one pipeline replica are split between its ranks, so the ranks'
dicts have disjoint keys and their *union* is the unpipelined model's state dict, key for key and value
for value (:func:`merge_state_dicts`; :meth:`~zerobubble.runtime.Pipeline.full_state_dict` gathers it).

Loading (:func:`select_entries`) takes a whole-model dict or this rank's own dict: each rank takes its
own keys, ignores those of layers other ranks hold and reports keys the model does not have at all.
Every copy of a tied parameter is set from one value (the first of its names the dict holds), so the
copies on different ranks stay equal; a dict whose names of one tied parameter hold different values
is refused.

The optimizer's state is keyed by parameter name the same way (:func:`optimizer_state_by_name`,
:func:`load_optimizer_state_by_name`: torch's ``get_optimizer_state_dict`` layout, nested or flat), so
that the ranks' dicts saved with ``torch.distributed.checkpoint`` load into any other layout or into
the unpipelined model; :func:`create_optimizer_state` gives parameters without state the state their
first step starts from, for ``dcp.load`` to fill in place.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .. import PipelineError

_SHOWN = 8  # keys named in one error message


def model_keys(named: Sequence[tuple[str, nn.Module]]) -> tuple[str, ...]:
    """The keys of ``nn.Sequential(*layers).state_dict()``, in its order (tied aliases included)."""
    return tuple(f"{name}.{key}" for name, layer in named for key in layer.state_dict())


def merge_state_dicts(dicts: Iterable[Mapping[str, Any]], order: Sequence[str] = ()) -> dict[str, Any]:
    """The union of the ranks' state dicts, keys listed in ``order`` first (in that order).

    The ranks of one pipeline replica hold disjoint keys; a key several dicts hold (replicas) takes
    the first dict's value.
    """
    merged: dict[str, Any] = {}
    for state in dicts:
        for key, value in state.items():
            merged.setdefault(key, value)
    ordered = {key: merged.pop(key) for key in order if key in merged}
    ordered.update(merged)
    return ordered


def select_entries(
    state_dict: Mapping[str, Any],
    local: Mapping[str, Any],
    known: frozenset[str],
    ties: Sequence[Sequence[str]],
) -> tuple[dict[str, Any], list[str], list[str]]:
    """This rank's entries of ``state_dict``: ``(entries, missing keys, unexpected keys)``.

    ``local`` is this rank's own state dict, ``known`` every key of the whole model, ``ties`` the
    names of each tied parameter (first name first).  Missing keys are this rank's keys the dict does
    not supply (a tied parameter is supplied by any of its names); unexpected keys are those of no
    layer of the model.  Raises when a tied parameter's names hold different values, or an entry's
    shape differs from this rank's tensor — before anything is loaded.
    """
    unexpected = [key for key in state_dict if key not in known]
    entries = {key: state_dict[key] for key in local if key in state_dict}
    for names in ties:
        present = [name for name in names if name in state_dict]
        if not present:
            continue
        value = state_dict[present[0]]
        for other in present[1:]:
            if not _same(value, state_dict[other]):
                raise PipelineError(
                    f"the state dict holds different values under {present[0]!r} and {other!r}, which "
                    "name one tied parameter; a tied parameter has one value — make the entries equal "
                    f"or drop {other!r} (it is then loaded from {present[0]!r})"
                )
        for name in names:
            if name in local:
                entries[name] = value
    mismatched = [
        f"{key}: {list(value.shape)} in the state dict, {list(local[key].shape)} in the model"
        for key, value in entries.items()
        if isinstance(value, torch.Tensor)
        and isinstance(local[key], torch.Tensor)
        and value.shape != local[key].shape
    ]
    if mismatched:
        raise PipelineError(f"shapes differ, nothing was loaded: {_listing(mismatched)}")
    missing = [key for key in local if key not in entries]
    return entries, missing, unexpected


def strict_error(missing: Sequence[str], unexpected: Sequence[str], rank: int) -> PipelineError:
    """The error of a strict load with ``missing`` / ``unexpected`` keys (nothing was loaded)."""
    parts = []
    if missing:
        parts.append(f"missing keys of rank {rank}'s layers: {_listing(missing)}")
    if unexpected:
        parts.append(f"unexpected keys (no layer of the model has them): {_listing(unexpected)}")
    return PipelineError(
        f"load_state_dict(strict=True) on rank {rank}: {'; '.join(parts)}; nothing was loaded — pass the "
        "unpipelined model's state_dict(), the merged state dicts of every rank or this rank's own, "
        "or strict=False"
    )


def _listing(items: Sequence[str]) -> str:
    shown = ", ".join(repr(item) if " " not in item else item for item in items[:_SHOWN])
    return shown + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


def _same(first: Any, second: Any) -> bool:
    if first is second:
        return True
    if not (isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)):
        return bool(first == second)
    if first.shape != second.shape or first.dtype != second.dtype:
        return False
    return torch.equal(first.detach().cpu(), second.detach().cpu())


# -- optimizer state by parameter name (torch.distributed.checkpoint) -------------------------------

_STATE, _GROUPS, _PARAMS = "state", "param_groups", "params"


def create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of ``optimizer`` that has no state yet the state its first step would
    start from, so that a checkpoint can be loaded into it in place (``dcp.load``).

    ``torch.optim.SGD`` with momentum gets a zero ``momentum_buffer``; ``Adam`` and ``AdamW`` get
    ``step`` 0 and zero ``exp_avg`` / ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad), laid out
    as their own ``_init_group`` lays them out.  For Adam, AdamW and SGD without dampening the next
    step is then the same as from no state at all (SGD with ``dampening > 0`` would start its buffer
    from the gradient instead).  SGD without momentum keeps no state.  Another optimizer whose
    parameters lack state raises: take one step first (optimizers such as Adagrad create their state
    at construction and need nothing).
    """
    from torch.optim.optimizer import _get_scalar_dtype  # the dtype Adam's own step counter has

    for group in optimizer.param_groups:
        for param in group[_PARAMS]:
            if optimizer.state.get(param):
                continue
            if isinstance(optimizer, torch.optim.Adam):  # AdamW is an Adam
                on_device = bool(group.get("fused")) or bool(group.get("capturable"))
                scalar = _get_scalar_dtype(is_fused=group.get("fused"))
                state = {
                    "step": torch.zeros((), dtype=scalar, device=param.device if on_device else "cpu"),
                    "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                }
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                optimizer.state[param] = state
            elif isinstance(optimizer, torch.optim.SGD):
                if float(group["momentum"]) != 0.0:
                    optimizer.state[param] = {"momentum_buffer": torch.zeros_like(param).detach()}
            else:
                raise PipelineError(
                    f"{type(optimizer).__name__} has no state for some parameters yet and the Pipeline "
                    "creates it only for SGD, Adam and AdamW: take one optimizer step before "
                    "optimizer_state_dict(), or load into an optimizer that has state"
                )


def optimizer_state_by_name(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], flatten: bool = False
) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameter names (``names[id(param)]``) in place of indices.

    Nested, as ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` returns it:
    ``{"state": {name: {"exp_avg": ..., "step": ...}}, "param_groups": [{..., "params": [names]}]}``;
    with ``flatten`` as with its ``flatten_optimizer_state_dict=True``: ``"state.NAME.KEY"`` and
    ``"param_groups.NAME.KEY"`` (each group's hyper-parameters under each of its parameters' names).
    The tensors are the optimizer's own (a checkpoint loads into them in place).
    """
    raw = optimizer.state_dict()
    params = [param for group in optimizer.param_groups for param in group[_PARAMS]]
    unknown = [index for index, param in enumerate(params) if id(param) not in names]
    if unknown:
        raise PipelineError(
            f"the optimizer holds {len(unknown)} parameters that are not this Pipeline's: pass an "
            "optimizer over pipe.parameters()"
        )
    name_of = [names[id(param)] for param in params]
    state = {name_of[index]: dict(value) for index, value in raw[_STATE].items()}
    groups = [{**group, _PARAMS: [name_of[index] for index in group[_PARAMS]]} for group in raw[_GROUPS]]
    if not flatten:
        return {_STATE: state, _GROUPS: groups}
    flat: dict[str, Any] = {}
    for name, values in state.items():
        flat.update({f"{_STATE}.{name}.{key}": value for key, value in values.items()})
    for group in groups:
        for name in group[_PARAMS]:
            flat.update({f"{_GROUPS}.{name}.{key}": value for key, value in group.items() if key != _PARAMS})
    return flat


def load_optimizer_state_by_name(
    optimizer: torch.optim.Optimizer,
    state_dict: Mapping[str, Any],
    names: Mapping[int, str],
    aliases: Mapping[str, Sequence[str]],
    strict: bool = True,
) -> list[str]:
    """Load a state dict of :func:`optimizer_state_by_name` (nested or flat, of any layout's ranks, or
    of the unpipelined model from torch's ``get_optimizer_state_dict``) into ``optimizer``.

    Each parameter's state is looked up under its name (or, for a tied parameter, any name of it in
    ``aliases``); each param group's hyper-parameters come from the loaded group holding one of its
    parameters' names, or else the loaded group of the same position (a nested dict read back by
    ``dcp.load`` holds one rank's groups).  Returns the names whose state the dict lacks; with
    ``strict`` these raise before anything is loaded.
    """
    if isinstance(optimizer, (torch.optim.SGD, torch.optim.Adam)):
        create_optimizer_state(optimizer)  # then a parameter with state must find its own
    nested = _STATE in state_dict
    loaded_state: Mapping[str, Any] = state_dict[_STATE] if nested else _unflatten_state(state_dict)
    loaded_groups = list(state_dict.get(_GROUPS, [])) if nested else []
    state: dict[int, Any] = {}
    groups: list[dict[str, Any]] = []
    missing: list[str] = []
    index = 0
    for position, group in enumerate(optimizer.param_groups):
        mine = [names[id(param)] for param in group[_PARAMS]]
        hyper = _group_values(group, mine, loaded_groups, position, state_dict, nested)
        groups.append({**hyper, _PARAMS: list(range(index, index + len(mine)))})
        for name, param in zip(mine, group[_PARAMS]):
            found = next((n for n in (name, *aliases.get(name, ())) if n in loaded_state), None)
            if found is not None:
                state[index] = dict(loaded_state[found])
            elif optimizer.state.get(param):  # state it has (or would be created with)
                missing.append(name)
            index += 1
    if strict and missing:
        raise PipelineError(
            f"the optimizer state dict has no state for {_listing(missing)}; nothing was loaded — pass a "
            "dict of optimizer_state_dict() (or of torch's get_optimizer_state_dict on the unpipelined "
            "model) that covers this rank's parameters, or strict=False"
        )
    optimizer.load_state_dict({_STATE: state, _GROUPS: groups})
    return missing


def _unflatten_state(flat: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The ``"state"`` part of a flat dict: ``{name: {key: value}}`` (a key is the last dotted part)."""
    state: dict[str, dict[str, Any]] = {}
    prefix = f"{_STATE}."
    for key, value in flat.items():
        if key.startswith(prefix):
            name, _, leaf = key[len(prefix) :].rpartition(".")
            state.setdefault(name, {})[leaf] = value
    return state


def _group_values(
    group: Mapping[str, Any],
    mine: Sequence[str],
    loaded_groups: Sequence[Mapping[str, Any]],
    position: int,
    flat: Mapping[str, Any],
    nested: bool,
) -> dict[str, Any]:
    """This param group's hyper-parameters as the loaded dict holds them (its own where it has none)."""
    own = {key: value for key, value in group.items() if key != _PARAMS}
    if not nested:
        values = dict(own)
        for key in own:
            found = [flat[f"{_GROUPS}.{name}.{key}"] for name in mine if f"{_GROUPS}.{name}.{key}" in flat]
            if found and any(not _same(found[0], other) for other in found[1:]):
                raise PipelineError(
                    f"the optimizer state dict holds different {key!r} for parameters of one param group"
                )
            if found:
                values[key] = found[0]
        return values
    match = next((g for g in loaded_groups if set(mine) & set(g.get(_PARAMS, ()))), None)
    if match is None and position < len(loaded_groups):
        match = loaded_groups[position]
    if match is None:
        return own
    return {**own, **{key: value for key, value in match.items() if key != _PARAMS}}
