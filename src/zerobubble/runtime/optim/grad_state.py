"""The global gradient state the optimizer step needs: ``[Σ ‖g‖_p^p, non-finite flag]``.

Each rank computes its part of the state (:func:`local_state`; for DTensor gradients of tensor
parallelism the full tensors' norms, for FSDP2/HSDP shards the local shards' parts), parts combine
by :func:`combine_states` (or one all-reduce, :func:`reduce_op`), and :func:`clip_coefficient` turns
the total into ``clip_grad_norm_``'s factor.  Pure functions, used by :mod:`.post_validation`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..tensors import full_value, local_value
from .rollback import OptimizerValidationError


def check_max_norm(max_norm: float | None) -> float | None:
    """``max_norm`` as a float (None: no clipping); raise when it is not positive."""
    if max_norm is None:
        return None
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not float(max_norm) > 0.0:
        raise OptimizerValidationError(f"max_norm must be a positive number or None, got {max_norm!r}")
    return float(max_norm)


def clip_coefficient(total_norm: float, max_norm: float | None, dtype: torch.dtype) -> float:
    """torch's clip factor ``clamp(max_norm / (total_norm + 1e-6), max=1)``, in ``dtype``.

    1.0 means no clipping (also when ``max_norm`` is None).
    """
    if max_norm is None:
        return 1.0
    # in the gradients' dtype, as clip_grad_norm_ computes it, so the scaled gradients match torch's
    norm = torch.tensor(total_norm, dtype=dtype)
    return float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))


@torch.no_grad()
def local_state(
    grads: Sequence[torch.Tensor], norm_type: float, device: torch.device, *, shards: bool = False
) -> torch.Tensor:
    """``[Σ ‖g‖_p^p (max ‖g‖_∞ for p = inf), non-finite flag]`` of ``grads``, float64 on ``device``.

    A DTensor gradient of tensor parallelism counts with the norm of its full tensor, the same on
    every rank of its mesh (a collective over it, in the same order on each of them): each tp rank's
    pipeline thus reaches the norm of the whole model, every tensor counted once.  With ``shards``
    (``data_parallel="fsdp"``) a DTensor gradient counts its local shard only: the caller sums the
    states of the shards' holders (:func:`reduce_op` over the data-parallel group), one collective
    for all of them.
    """
    if not grads:
        return torch.zeros(2, dtype=torch.float64, device=device)
    if shards:
        parts = _shard_parts(grads, norm_type, device)
        nonfinite = (~torch.isfinite(parts)).any().to(torch.float64)
        return torch.stack([parts.max() if math.isinf(norm_type) else parts.sum(), nonfinite])
    norms = torch.stack(
        [full_value(torch.linalg.vector_norm(g, norm_type)).to(device, torch.float64) for g in grads]
    )
    nonfinite = (~torch.isfinite(norms)).any().to(torch.float64)
    part = norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()
    return torch.stack([part, nonfinite])


def _shard_parts(grads: Sequence[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """Each sharded gradient's part of the state over the data-parallel shard group: ``‖local
    shard‖_p^p`` (``‖·‖_∞``), float64 on ``device``.

    FSDP2's DTensors put their data-parallel dimensions first: HSDP's ``Replicate`` (equal copies,
    counted once), then the dimension FSDP shards over (summed by the caller).  A gradient of FSDP2
    over tensor parallelism is also cut along the dimensions after that one where it is ``Shard``:
    its part is summed (maxed) over those dimensions' groups first, one collective per set of groups
    for all the gradients cut alike, so that each row is counted once.
    """
    parts = [_local_part(grad, norm_type, device) for grad in grads]
    alike: dict[tuple[Any, ...], list[int]] = {}
    for index, grad in enumerate(grads):
        groups = _inner_shard_groups(grad)
        if groups:
            alike.setdefault(groups, []).append(index)
    reduced = {index for indices in alike.values() for index in indices}
    combined = [part for index, part in enumerate(parts) if index not in reduced]
    for groups, indices in alike.items():
        chosen = torch.stack([parts[index] for index in indices])
        total = chosen.max() if math.isinf(norm_type) else chosen.sum()
        for group in groups:
            dist.all_reduce(total, op=reduce_op(norm_type), group=group)
        combined.append(total)
    return torch.stack(combined)


def _local_part(grad: torch.Tensor, norm_type: float, device: torch.device) -> torch.Tensor:
    """``‖local shard‖_p^p`` (``‖·‖_∞`` for p = inf) of one gradient, float64 on ``device``."""
    norm = torch.linalg.vector_norm(local_value(grad), norm_type).to(device, torch.float64)
    return norm if math.isinf(norm_type) else norm.pow(norm_type)


def _inner_shard_groups(grad: torch.Tensor) -> tuple[Any, ...]:
    """The groups of a DTensor's sharded mesh dimensions after its first (FSDP's) one."""
    mesh = getattr(grad, "device_mesh", None)
    if mesh is None or mesh.ndim < 2:
        return ()
    placements = grad.placements  # type: ignore[attr-defined]
    # cut: Shard, or the _StridedShard FSDP2 uses over a tensor-parallel Shard of the same dim
    cut = [dim for dim, p in enumerate(placements) if not (p.is_replicate() or p.is_partial())]
    return tuple(mesh.get_group(dim) for dim in cut[1:])


def combine_states(earlier: torch.Tensor, local: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The state of a chain prefix extended by one rank's local state.

    Both entries combine alike: a sum of p-th powers (a maximum for p = inf), and a 0/1 flag that
    stays positive once any rank saw a non-finite gradient.
    """
    if math.isinf(norm_type):
        return torch.maximum(earlier, local)
    return earlier + local


def reduce_op(norm_type: float) -> dist.ReduceOp:
    """The all-reduce that :func:`combine_states` performs pairwise (synchronous mode)."""
    # torch's stubs type the members as RedOpType while the collectives take ReduceOp
    return dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM  # type: ignore[return-value]
