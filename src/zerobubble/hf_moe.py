"""Pipeline layers of the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE), with the
router's load-balancing loss carried across stages.

The decoder blocks run as they are (:class:`~zerobubble.hf.RotaryDecoderLayer`): top-k routing is
per token, with no capacity and no token dropping in these families, so a microbatch routes each
token as the whole batch does.  When the config asks for the auxiliary loss
(``output_router_logits=True`` and ``router_aux_loss_coef ≠ 0``) the layers also pass on a
``(2, experts)`` float32 tensor: each sparse block adds its top-k assignment counts (row 0) and its
routing probabilities summed over the tokens (row 1), in the order and dtypes of
``load_balancing_loss_func``; the head returns ``(logits, coef · aux)`` and
:func:`zerobubble.hf.with_router_aux_loss` adds the second to the loss.  The gradient reaches every stage's
router through that tensor's gradient, on the pipeline's own channel: nothing else crosses a stage.
The loss is per microbatch, as the model computes it on the batch it is given
(``docs/transformers.md``, "Mixture of experts").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .hf import LMHead, RotaryDecoderLayer, RotaryEmbedding, _sliding_layers

__all__ = [
    "RouterAuxDecoderLayer",
    "RouterAuxEmbedding",
    "RouterAuxHead",
    "moe_layers",
    "router_statistics",
]


def _router(block: nn.Module) -> nn.Module | None:
    """The block's top-k router (``mlp.gate`` of a sparse block), None for a dense block (Qwen-MoE's
    ``mlp_only_layers`` and ``decoder_sparse_step`` leave some blocks dense)."""
    mlp: Any = getattr(block, "mlp", None)
    return mlp.gate if hasattr(mlp, "experts") else None


def _experts(config: Any) -> int:
    """The number of routed experts (``num_local_experts`` in Mixtral, ``num_experts`` in Qwen)."""
    return int(getattr(config, "num_local_experts", None) or config.num_experts)


def router_statistics(
    logits: torch.Tensor, top_k: int, experts: int, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """One block's ``[assignment counts, summed routing probabilities]``, ``(2, experts)`` float32,
    computed as ``load_balancing_loss_func`` computes them for a layer (padding excluded)."""
    weights = torch.softmax(logits, dim=-1)
    _, selected = torch.topk(weights, top_k, dim=-1)
    if attention_mask is None:
        kind = torch.float32 if logits.device.type in ("cpu", "mps") else torch.int32
        counts = torch.histc(selected.reshape(-1).to(kind), bins=experts, min=0, max=experts)
        probs = weights.float().sum(dim=0)
    else:
        mask = attention_mask.reshape(-1).to(device=logits.device, dtype=torch.float32)
        counts = torch.zeros(experts, dtype=torch.float32, device=logits.device)
        counts = counts.scatter_add_(0, selected.reshape(-1), mask.repeat_interleave(top_k))
        probs = (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
    return torch.stack([counts.to(torch.float32), probs])


class RouterAuxEmbedding(nn.Module):
    """The rotary embedding followed by zero router statistics: ``tokens → (hidden, cos, sin, stats)``."""

    def __init__(self, embedding: RotaryEmbedding, experts: int):
        super().__init__()
        self.embedding, self.experts = embedding, experts

    def forward(
        self, tokens: torch.Tensor, *, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden, cos, sin = self.embedding(tokens, position_ids=position_ids)
        return hidden, cos, sin, torch.zeros(2, self.experts, dtype=torch.float32, device=hidden.device)


class RouterAuxDecoderLayer(RotaryDecoderLayer):
    """A decoder block adding its router's statistics (:func:`router_statistics`) to those it is
    given: ``(hidden, cos, sin, stats) → (hidden, cos, sin, stats)``; a dense block passes them on."""

    def __init__(self, block: nn.Module, config: Any, *, sliding: bool = False):
        super().__init__(block, config, sliding=sliding)
        self.top_k, self.experts = config.num_experts_per_tok, _experts(config)

    def forward(  # type: ignore[override]
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        stats: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        router = _router(self.layer)
        keywords = {"attention_mask": attention_mask, "position_ids": position_ids}
        if router is None:
            return (*super().forward(hidden, cos, sin, **keywords), stats)
        logits: list[torch.Tensor] = []
        # the router's logits as the model records them (its OutputRecorder reads output 0); a hook
        # for this call only, so the model's modules keep no trace of the cut
        handle = router.register_forward_hook(lambda _module, _args, output: logits.append(output[0]))
        try:
            outputs = super().forward(hidden, cos, sin, **keywords)
        finally:
            handle.remove()
        added = router_statistics(logits[-1], self.top_k, self.experts, attention_mask)
        return (*outputs, stats + added)


class RouterAuxHead(LMHead):
    """The head of a cut whose model adds the load-balancing loss: ``(hidden, cos, sin, stats) →
    (logits, router_aux_loss_coef · aux)``, ``aux`` as ``load_balancing_loss_func`` finishes it."""

    def __init__(self, norm: nn.Module, head: nn.Module, *, experts: int, sparse_blocks: int, coef: float):
        super().__init__(norm, head)
        self.experts, self.sparse_blocks, self.router_aux_loss_coef = experts, sparse_blocks, coef

    def forward(  # type: ignore[override]
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        stats: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = super().forward(hidden)
        rows: Any = 0.0  # summed over the sparse blocks as the model sums it: a float, or a tensor
        for _ in range(self.sparse_blocks):
            if attention_mask is None:
                rows = rows + hidden.shape[0] * hidden.shape[1]
            else:
                rows = rows + attention_mask.reshape(-1).to(device=stats.device, dtype=torch.float32).sum()
        per_expert, probability = stats[0] / rows, stats[1] / rows
        aux = torch.sum(per_expert * probability.unsqueeze(0)) * self.experts
        return logits, self.router_aux_loss_coef * aux


def moe_layers(model: Any) -> list[nn.Module]:
    """``MixtralForCausalLM``, ``Qwen2MoeForCausalLM`` or ``Qwen3MoeForCausalLM`` →
    ``[embedding, decoder layer 0, …, decoder layer n−1, head]``, carrying the router statistics
    when ``config.output_router_logits`` and ``config.router_aux_loss_coef`` ask for the auxiliary
    loss (the head then returns ``(logits, aux term)``: :func:`zerobubble.hf.with_router_aux_loss`)."""
    inner, config = model.model, model.config
    embedding = RotaryEmbedding(inner.embed_tokens, inner.rotary_emb)
    pairs = list(zip(inner.layers, _sliding_layers(config)))
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    if not getattr(config, "output_router_logits", False) or coef == 0.0:
        blocks = [RotaryDecoderLayer(block, config, sliding=window) for block, window in pairs]
        return [embedding, *blocks, LMHead(inner.norm, model.lm_head)]
    experts = _experts(config)
    blocks = [RouterAuxDecoderLayer(block, config, sliding=window) for block, window in pairs]
    sparse = sum(_router(block) is not None for block in inner.layers)
    head = RouterAuxHead(inner.norm, model.lm_head, experts=experts, sparse_blocks=sparse, coef=coef)
    return [RouterAuxEmbedding(embedding, experts), *blocks, head]
