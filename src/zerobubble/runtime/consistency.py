"""What the ranks of one Pipeline must agree on, checked at construction; tied parameters.

Every rank builds the Pipeline from its own copy of the layer list.  Before any channel is created
the ranks exchange a *fingerprint* — layer types, parameter names/shapes/dtypes, the schedule (name,
microbatches, stages, a digest of the programs), the cut points, the data-parallel degree and the
tied parameters — and every rank raises the same :class:`~zerobubble.runtime.PipelineError` naming
the first rank and item that differ from rank 0.  A rank that could not even build its part (a bad
argument) sends its error instead, so the others say which rank failed and why instead of waiting.

Tied parameters: a Parameter object used by two layers (an embedding reused by the LM head) is
detected here.  When the two layers land on different ranks each rank holds its own copy; the
Pipeline keeps them tied as Megatron keeps its embedding group: the copies start equal (broadcast
from the holder of the first layer) and their gradients are summed over the holders after every
step, so each copy takes the same optimizer step.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..schedule.ir import Schedule
from . import PipelineError


def find_ties(named: Sequence[tuple[str, nn.Module]]) -> list[list[tuple[int, str]]]:
    """Parameters shared by two or more layers: per tie, ``(layer index, qualified name)`` in model order.

    The first entry is the tie's canonical name (the one ``state_dict`` keeps).
    """
    users: dict[int, list[tuple[int, str]]] = {}
    for index, (layer_name, layer) in enumerate(named):
        for name, param in layer.named_parameters(remove_duplicate=False):
            users.setdefault(id(param), []).append((index, f"{layer_name}.{name}"))
    return [uses for uses in users.values() if len({index for index, _ in uses}) > 1]


def fingerprint(
    named: Sequence[tuple[str, nn.Module]],
    schedule: Schedule,
    bounds: Sequence[int],
    data_parallel: int,
    ties: Sequence[Sequence[tuple[int, str]]],
) -> dict[str, Any]:
    """The items every rank must agree on, in the order they are compared."""
    programs = hashlib.blake2b(repr(schedule.programs).encode(), digest_size=8).hexdigest()
    return {
        "number of layers": len(named),
        "layer types": [type(layer).__name__ for _, layer in named],
        "parameters": [
            (f"{layer_name}.{name}", tuple(p.shape), str(p.dtype).replace("torch.", ""))
            for layer_name, layer in named
            for name, p in layer.named_parameters()
        ],
        "tied parameters": [[name for _, name in tie] for tie in ties],
        "schedule": schedule.name,
        "microbatches": schedule.microbatches,
        "stages": schedule.num_stages,
        "layer cuts": list(bounds),
        "schedule programs": programs,
        "data_parallel": data_parallel,
    }


@dataclass(frozen=True)
class Agreement:
    """What the exchange settled: a key naming this Pipeline in the shared store, the RNG seed."""

    key: str
    seed: int


def agree(mine: dict[str, Any] | None, problem: str | None, seed: int | None, group: Any) -> Agreement:
    """Exchange fingerprints over ``group`` (collective); raise unless every rank matches rank 0.

    ``problem`` is this rank's construction error (then ``mine`` is None); ``seed`` the user's
    seed or None for rank 0's ``torch.initial_seed()``.
    """
    entry = {
        "fingerprint": mine,
        "problem": problem,
        "nonce": os.urandom(8).hex(),
        "seed": torch.initial_seed() if seed is None else seed,
    }
    entries: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(entries, entry, group=group)
    failed = [(rank, e["problem"]) for rank, e in enumerate(entries) if e["problem"] is not None]
    if failed and problem is None:
        rank, message = failed[0]
        raise PipelineError(f"rank {rank} could not build its part of the pipeline: {message}")
    if problem is None:
        _compare([e["fingerprint"] for e in entries])
    return Agreement(key=entries[0]["nonce"], seed=int(entries[0]["seed"]))


def _compare(prints: list[dict[str, Any]]) -> None:
    reference = prints[0]
    for rank, other in enumerate(prints[1:], start=1):
        for item, expected in reference.items():
            actual = other[item]
            if actual != expected:
                raise PipelineError(
                    f"rank {rank} differs from rank 0 in its {item}: {_difference(expected, actual)}; "
                    "every rank must build the Pipeline from the same layers and arguments"
                )


def _difference(expected: Any, actual: Any) -> str:
    if isinstance(expected, list) and isinstance(actual, list):
        for position, (a, b) in enumerate(zip(expected, actual)):
            if a != b:
                return f"entry {position} is {b!r} there but {a!r} on rank 0"
        return f"{len(actual)} entries there but {len(expected)} on rank 0"
    return f"{actual!r} there but {expected!r} on rank 0"


class TiedParameter:
    """One parameter shared by layers on different ranks of this pipeline, held by this rank.

    ``param`` is this rank's copy; ``group`` the process group of the holders (this replica's),
    ``source`` the global rank holding the tie's first layer.
    """

    def __init__(self, name: str, param: nn.Parameter, group: Any, source: int):
        self.name = name
        self.param = param
        self.group = group
        self.source = source

    @torch.no_grad()
    def broadcast_value(self) -> None:
        """Make this copy equal to the first holder's (collective over the holders)."""
        dist.broadcast(self.param.data, src=self.source, group=self.group)

    @torch.no_grad()
    def sum_gradients(self, wait: Callable[[Any, str], None]) -> None:
        """Sum the holders' gradients (collective over the holders); ``wait`` waits for the reduction."""
        if self.param.grad is None:
            self.param.grad = torch.zeros_like(self.param)
        work = dist.all_reduce(self.param.grad, group=self.group, async_op=True)
        wait(work, f"the gradient sum of the tied parameter {self.name}")


def broadcast_replicas(module: nn.Module, group: Any, source: int) -> None:
    """Copy replica 0's parameters and buffers to the other data-parallel replicas (as DDP does)."""
    with torch.no_grad():
        works = [
            dist.broadcast(tensor, src=source, group=group, async_op=True)
            for tensor in [*module.parameters(), *module.buffers()]
        ]
        for work in works:
            work.wait()
