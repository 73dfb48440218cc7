"""Finding tensors inside runtime objects and counting the memory behind them.

Used wherever the runtime measures activation memory (the memory meter, the profiler, the W store's
account of what W will free): one walk over containers and work items, and one rule for bytes —
each distinct storage once, so views and aliases are not counted twice.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def tensors_in(value: Any, depth: int = 5) -> list[torch.Tensor]:
    """The tensors inside ``value``, searched ``depth`` levels deep.

    Descends into dicts, lists, tuples and sets, a ``functools.partial``'s bound arguments and other
    objects' attributes (a deferred W's closure); modules are skipped (their parameters are not
    activations).  Each tensor object is listed once.
    """
    found: dict[int, torch.Tensor] = {}
    _collect(value, found, depth)
    return list(found.values())


def storage_bytes(tensors: Iterable[torch.Tensor], excluded: frozenset[int] | set[int] = frozenset()) -> int:
    """Bytes of the distinct storages behind ``tensors``; storages whose data pointer is in ``excluded``
    are left out."""
    sizes: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            sizes[storage.data_ptr()] = storage.nbytes()
    return sum(sizes.values())


def _collect(value: Any, found: dict[int, torch.Tensor], depth: int) -> None:
    if isinstance(value, torch.Tensor):
        found[id(value)] = value
        return
    if depth == 0 or value is None or isinstance(value, (str, bytes, int, float, bool, type, nn.Module)):
        return
    if isinstance(value, functools.partial):
        items: Iterable[Any] = (*value.args, *value.keywords.values())
    elif isinstance(value, dict):
        items = value.values()
    elif isinstance(value, (list, tuple, set)):
        items = value
    elif isinstance(value, types.MethodType):  # a bound method queued as work: its object's state
        items = (value.__self__,)
    else:
        items = [*getattr(value, "__dict__", {}).values(), *_slot_values(value)]
    for item in items:
        _collect(item, found, depth - 1)


def _slot_values(value: Any) -> list[Any]:
    """The values of the ``__slots__`` attributes of ``value``'s class and its bases that are set."""
    values = []
    for cls in type(value).__mro__:
        slots = getattr(cls, "__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(value, name):
                values.append(getattr(value, name))
    return values


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (tensor parallelism, FSDP2), or a
    Parameter holding one.  Never imports that package (a second at import time): where it is not
    imported yet, no DTensor exists."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    if dtensor is None:
        return False
    return isinstance(tensor, dtensor) or isinstance(getattr(tensor, "data", None), dtensor)


def full_value(tensor: Any) -> Any:
    """A DTensor's full value (``full_tensor()``: collective over its mesh); anything else as it is."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def local_value(tensor: Any) -> Any:
    """A DTensor's local shard (``to_local()``, no communication; under ``no_grad`` it shares the
    DTensor's storage, so writing into it writes the DTensor); anything else as it is."""
    return tensor.to_local() if is_dtensor(tensor) else tensor
