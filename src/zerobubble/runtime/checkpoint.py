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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from . import PipelineError

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
