"""Expert parallelism: a mixture-of-experts layer's experts sharded over the mesh's ``"ep"`` ranks.

The ``ep`` ranks are replicas of the pipeline, each running its own share of the batch; every
parameter but the experts' is replicated over them and its gradients averaged with the other
replicas' (:class:`~.data_parallel.GradientAverager`).  A fused experts module of transformers
(``experts.gate_up_proj`` ``(E, 2I, H)`` and ``experts.down_proj`` ``(E, H, I)``: Mixtral,
Qwen2-MoE, Qwen3-MoE) becomes an :class:`ExpertParallelExperts` holding ``E / ep`` experts per
rank, its two weights ``DTensor``\\ s ``Shard(0)`` over the ``ep`` mesh (so ``full_tensor()`` and
DCP see the whole).  Its forward sends each routed token to the rank owning its expert (dispatch,
an all-to-all), runs the local experts on the tokens of every rank, and sends the results back
(combine, the reverse all-to-all); the router, its top-k choice and the weighting stay on the
token's own rank, so the routing and the router's gradient are those of one process.

Gradients: an expert's weight gradient sums the contributions of every ``ep`` rank's tokens, each
rank's loss being the mean over its own batch, so the averager divides it by the replica count like
every other gradient, without reducing it over ``ep`` (over ``"dp"`` only, where the mesh has one).
Why and how it is exact, and what it costs: ``docs/runtime.md``, "Expert parallelism".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ...schedule.grid import Grid
from .. import PipelineError
from . import consistency
from .data_parallel import ParallelLayout
from .groups import local_group

__all__ = [
    "ExpertParallelExperts",
    "broadcast_replicas",
    "check_expert_layers",
    "expert_parameters",
    "expert_sharding",
    "recorded_payloads",
    "shard_experts",
]

_FUSED = ("gate_up_proj", "down_proj")
# the variants of transformers' experts interface the dispatch below computes as the eager forward
_PLAIN_LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True}


def _weight(module: nn.Module, name: str) -> Any:
    """``module``'s own parameter ``name`` (None: it has none)."""
    return module._parameters.get(name)


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a fused experts module of transformers (module docstring)."""
    return (
        all(
            isinstance(_weight(module, name), torch.Tensor) and _weight(module, name).dim() == 3
            for name in _FUSED
        )
        and hasattr(module, "act_fn")
        and not isinstance(module, ExpertParallelExperts)
    )


def check_expert_layers(layers: Iterable[nn.Module], ep: int) -> None:
    """Refuse, alike on every rank, a model expert parallelism cannot shard over ``ep`` ranks: one
    without fused experts, experts not divisible by ``ep``, a layout the dispatch does not compute."""
    if ep == 1:
        return
    found = [m for layer in layers for m in layer.modules() if is_fused_experts(m)]
    if not found:
        raise PipelineError(
            f'the mesh has an "ep" dimension of {ep} ranks, but the layers hold no mixture-of-experts '
            "layer (a module with 3-D gate_up_proj and down_proj parameters, as zerobubble.hf's "
            'Mixtral, Qwen2-MoE and Qwen3-MoE cuts): drop the "ep" dimension, or name it "dp"'
        )
    for module in found:
        experts = _weight(module, "gate_up_proj").shape[0]
        if experts % ep:
            raise PipelineError(
                f'{type(module).__name__} holds {experts} experts, which the "ep" dimension of {ep} '
                f"ranks does not divide: give the mesh an ep size dividing {experts}"
            )
        odd = {key: getattr(module, key, value) for key, value in _PLAIN_LAYOUT.items()}
        odd = {key: value for key, value in odd.items() if value != _PLAIN_LAYOUT[key]}
        if odd or getattr(module, "has_post_expert_norm", False):
            raise PipelineError(
                f"{type(module).__name__} has an experts layout expert parallelism does not compute "
                f"({odd or 'a post-expert norm'}): it runs concatenated, untransposed gate-up weights "
                "without bias only"
            )


ExpertPayload = tuple[int, int, torch.dtype]
"""One forward's exchange of an experts module: (routed rows, row width, dtype)."""


@contextlib.contextmanager
def recorded_payloads(layers: Sequence[nn.Module]) -> Iterator[dict[int, dict[int, ExpertPayload]]]:
    """While open, every call of a fused experts module under ``layers[i]`` (or a deep copy of it:
    the hooks travel with the module) records in ``found[i][j]`` (``j``: the module's place among the
    layer's modules) what expert parallelism would exchange: its tokens times their top k, of the
    hidden width, in the hidden states' dtype.  The hooks are removed on exit."""
    found: dict[int, dict[int, ExpertPayload]] = {}
    handles = []
    for index, layer in enumerate(layers):
        for position, module in enumerate(layer.modules()):
            if is_fused_experts(module):
                hook = _PayloadHook(found.setdefault(index, {}), position)
                handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


class _PayloadHook:
    """The forward pre-hook of :func:`recorded_payloads`: records one experts module's exchange."""

    def __init__(self, found: dict[int, ExpertPayload], position: int):
        self.found, self.position = found, position

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        top_k_index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
        if isinstance(hidden, torch.Tensor) and isinstance(top_k_index, torch.Tensor):
            self.found[self.position] = (int(top_k_index.numel()), int(hidden.shape[-1]), hidden.dtype)

    def __deepcopy__(self, memo: dict[int, Any]) -> _PayloadHook:
        return self  # a profiled deep copy of the layer records here as well


def shard_experts(layer: nn.Module, mesh: Any, backward_group: Any = None) -> nn.Module:
    """``layer`` with each fused experts module replaced, in place, by an
    :class:`ExpertParallelExperts` over the 1-D ``mesh`` (the parameter names stay); the exchanges
    of autograd's backward go over ``backward_group`` (None: the mesh's group too)."""
    for parent in list(layer.modules()):
        for name, child in list(parent.named_children()):
            if is_fused_experts(child):
                setattr(parent, name, ExpertParallelExperts(child, mesh, backward_group))
    return layer


def expert_sharding(grid: Grid, mesh: Any, *, timeout: float) -> Callable[[nn.Module], nn.Module] | None:
    """What each layer goes through on a grid with an ``"ep"`` dimension: :func:`shard_experts` over
    it (None without one).  Creates the ``ep`` ranks' backward group here, one on every rank of the
    mesh whatever its layers hold (:mod:`.groups`): a backward's exchanges never share a group with
    a forward's, so an overlapped pair may run its halves on two threads (:mod:`..execute.pairs`)."""
    if grid.ep == 1:
        return None
    ep_mesh = mesh[grid.dim("ep")]
    ranks = dist.get_process_group_ranks(ep_mesh.get_group())
    backward_group = local_group(ranks, timeout=timedelta(seconds=timeout))
    return lambda layer: shard_experts(layer, ep_mesh, backward_group)


def broadcast_replicas(module: nn.Module, layout: ParallelLayout, rank: int) -> None:
    """Start every replica of pipeline rank ``rank`` from replica 0's values
    (:func:`~.consistency.broadcast_replicas`), but the experts: each shard from the first of the
    ``"dp"`` replicas holding it (they were scattered from the first ``ep`` rank)."""
    experts = expert_parameters([module])
    source = layout.grid.global_rank(rank, 0)
    consistency.broadcast_replicas(module, layout.dp_group, source, skip=experts)
    if layout.expert_group is not None and experts:
        first = dist.get_global_rank(layout.expert_group, 0)
        kept = {id(p) for p in experts}
        shared = [t for t in [*module.parameters(), *module.buffers()] if id(t) not in kept]
        consistency.broadcast_replicas(module, layout.expert_group, first, skip=shared)


def expert_parameters(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """The sharded expert weights under ``modules`` (each once)."""
    found: dict[int, nn.Parameter] = {}
    for module in modules:
        for child in module.modules():
            if isinstance(child, ExpertParallelExperts):
                found.update((id(p), p) for p in child.parameters())
    return list(found.values())


class ExpertParallelExperts(nn.Module):
    """This ``ep`` rank's share of a fused experts module: experts ``[r·E/ep, (r+1)·E/ep)`` as
    ``DTensor`` shards of ``gate_up_proj`` and ``down_proj``; called as the module it replaces,
    ``(hidden (N, H), top_k_index (N, k), top_k_weights (N, k)) → (N, H)`` (module docstring)."""

    def __init__(self, experts: nn.Module, mesh: Any, backward_group: Any = None):
        super().__init__()
        from torch.distributed.tensor import Shard, distribute_tensor

        self.num_experts = int(_weight(experts, "gate_up_proj").shape[0])
        self.act_fn: Callable[[torch.Tensor], torch.Tensor] = getattr(experts, "act_fn")  # noqa: B009
        self.mesh, self.group = mesh, mesh.get_group()
        # the exchanges run inside autograd's backward (the AllToAlls' backwards, and a forward it
        # recomputes) go over their own group: the two halves of an overlapped pair then each keep
        # one group's collectives in one order on every ep rank, whichever thread runs them
        self.backward_group = backward_group if backward_group is not None else self.group
        self.ranks = dist.get_world_size(self.group)
        self.local_experts = self.num_experts // self.ranks
        for name in _FUSED:  # the mesh's first rank's values, scattered (every replica starts alike)
            whole = _weight(experts, name).detach()
            self.register_parameter(name, nn.Parameter(distribute_tensor(whole, mesh, [Shard(0)])))

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        tokens, k = top_k_index.shape
        chosen = top_k_index.reshape(-1)
        # the (token, choice) pairs by expert: grouped by owning rank, then by its local expert
        order = torch.argsort(chosen, stable=True)
        owners = torch.arange(tokens, device=chosen.device).repeat_interleave(k)[order]
        sent = torch.bincount(chosen, minlength=self.num_experts)
        received = self._exchange_counts(sent)  # (ep, local): rank s's pairs for each local expert
        send_sizes = sent.view(self.ranks, self.local_experts).sum(1).tolist()
        receive_sizes = received.sum(1).tolist()
        groups = self._groups()
        dispatched = AllToAll.apply(hidden_states[owners], send_sizes, receive_sizes, groups)
        computed = self._local_experts(dispatched, received)
        combined = AllToAll.apply(computed, receive_sizes, send_sizes, groups)
        weighted = combined * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add(0, owners, weighted.to(hidden_states.dtype))

    def _exchange_counts(self, sent: torch.Tensor) -> torch.Tensor:
        """Every rank's pair counts for this rank's experts, ``(ep, local experts)``."""
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent.contiguous(), group=self._groups()[0])
        return received.view(self.ranks, self.local_experts)

    def _groups(self) -> tuple[Any, Any]:
        """(the group of this forward's exchanges, that of their backward): a forward autograd's
        backward recomputes (activation checkpointing) runs in the backward, on its group."""
        in_backward = torch._C._current_graph_task_id() != -1
        return (self.backward_group if in_backward else self.group), self.backward_group

    def _local_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each local expert's feed-forward on its rows (``rows`` as received: by source rank, then
        by local expert), in the received order."""
        gate_up, down = (_weight(self, name).to_local() for name in _FUSED)  # this rank's experts
        expert_of = torch.arange(self.local_experts, device=rows.device).repeat(self.ranks)
        expert_of = expert_of.repeat_interleave(counts.reshape(-1))
        by_expert = torch.argsort(expert_of, stable=True)
        grouped = rows[by_expert].split(counts.sum(0).tolist())
        outputs = []
        for expert, part in enumerate(grouped):
            gate, up = F.linear(part, gate_up[expert]).chunk(2, dim=-1)
            outputs.append(F.linear(self.act_fn(gate) * up, down[expert]))
        return torch.cat(outputs)[torch.argsort(by_expert)]


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits, differentiable: the backward sends the gradients
    back along the same pairs (the reverse exchange); ``groups``: (the forward's group, the
    backward's)."""

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, send: Sequence[int], receive: Sequence[int], groups: tuple[Any, Any]
    ) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, groups[1]
        return _exchange(rows, send, receive, groups[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad, ctx.receive, ctx.send, ctx.group), None, None, None


def _exchange(rows: torch.Tensor, send: Sequence[int], receive: Sequence[int], group: Any) -> torch.Tensor:
    """``rows`` cut by ``send`` to the group's ranks; what they send back, by ``receive``."""
    out = rows.new_empty((sum(receive), *rows.shape[1:]))
    work = dist.all_to_all_single(
        out, rows.contiguous(), list(receive), list(send), group=group, async_op=True
    )
    work.wait()
    return out
