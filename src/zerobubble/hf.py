"""Pipeline layers cut from Hugging Face ``transformers`` models (GPT-2, Llama), weights shared.

:class:`~zerobubble.Pipeline` takes a list of layers, each called with the previous layer's output
(a tuple is unpacked).  These adapters cut a ``transformers`` causal language model into such a
list without copying or renaming a weight: an embedding layer, one layer per decoder block and a
head.  Llama's rotary ``position_embeddings`` are computed once by the embedding layer and passed
along with the hidden states as a tuple ``(hidden, cos, sin)``, so they cross stage boundaries.
``transformers`` is imported only by the caller's model; nothing here downloads anything.

The blocks run without a cache and without an attention mask (full causal attention over the
sequence), as in training on packed sequences.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _hidden(output: Any) -> torch.Tensor:
    """A decoder block's hidden states (transformers 4 returns a tuple, 5 a tensor)."""
    return output[0] if isinstance(output, tuple) else output


class GPT2Embedding(nn.Module):
    """Token and position embeddings of a ``GPT2Model`` (its ``wte``, ``wpe`` and dropout)."""

    def __init__(self, transformer: Any):
        super().__init__()
        self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[-1], device=tokens.device)
        return self.drop(self.wte(tokens) + self.wpe(positions))


class GPT2Layer(nn.Module):
    """One ``GPT2Block``: hidden states in, hidden states out."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return _hidden(self.block(hidden))


class LMHead(nn.Module):
    """Final norm and vocabulary projection; extra inputs (Llama's rotary tables) are dropped."""

    def __init__(self, norm: nn.Module, head: nn.Module):
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, hidden: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(hidden))


def gpt2_layers(model: Any) -> list[nn.Module]:
    """``GPT2LMHeadModel`` → ``[embedding, block 0, …, block n−1, head]``.

    Untie the head from the token embedding first (``tie_word_embeddings=False``) when the two
    may land on different ranks: a tied weight would be updated on each rank separately.
    """
    transformer = model.transformer
    blocks = [GPT2Layer(block) for block in transformer.h]
    return [GPT2Embedding(transformer), *blocks, LMHead(transformer.ln_f, model.lm_head)]


class LlamaEmbedding(nn.Module):
    """Token embedding and the rotary tables: ``tokens → (hidden, cos, sin)``."""

    def __init__(self, model: Any):
        super().__init__()
        self.embed_tokens, self.rotary_emb = model.embed_tokens, model.rotary_emb

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = self.embed_tokens(tokens)
        positions = torch.arange(tokens.shape[-1], device=tokens.device).unsqueeze(0)
        cos, sin = self.rotary_emb(hidden, positions)
        return hidden, cos, sin


class LlamaLayer(nn.Module):
    """One ``LlamaDecoderLayer``: ``(hidden, cos, sin) → (hidden, cos, sin)``."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _hidden(self.layer(hidden, position_embeddings=(cos, sin))), cos, sin


def llama_layers(model: Any) -> list[nn.Module]:
    """``LlamaForCausalLM`` → ``[embedding, decoder layer 0, …, decoder layer n−1, head]``."""
    inner = model.model
    return [
        LlamaEmbedding(inner),
        *(LlamaLayer(layer) for layer in inner.layers),
        LMHead(inner.norm, model.lm_head),
    ]
