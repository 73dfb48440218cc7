"""Pipeline layers cut from Hugging Face ``transformers`` causal language models, weights shared.

:class:`~zerobubble.Pipeline` takes a list of layers, each called with the previous layer's output
(a tuple is unpacked).  :func:`pipeline_layers` cuts a ``transformers`` causal LM into such a list
without copying or renaming a weight: an embedding, one layer per decoder block and a head, computing
what the model's own ``forward`` computes (``docs/transformers.md`` lists the families and the
contract an adapter for another architecture follows).

What travels between layers is a tuple of tensors: the hidden states, and for rotary-position
families the rotary tables ``(cos, sin)`` the embedding computes once, as the model does.  Each
decoder layer rebuilds its causal attention mask — sliding-window for the blocks whose attention is
windowed — and the position ids from the hidden states' shape with ``transformers``' own mask
helpers, so every attention implementation (eager, sdpa, …) gets the mask the model would give it
and no ``seq × seq`` tensor crosses a stage boundary.

Padded batches: the embedding and every decoder layer take ``attention_mask`` (the 2-D padding mask
of the tokenizer, 1 = keep) and ``position_ids`` (``(batch, seq)``) as keyword arguments, which
``Pipeline.step(input_ids, targets=labels, attention_mask=mask)`` hands each of them for its
microbatch.  They are used as the model's ``forward`` uses them: the padding mask is combined with
the causal (and sliding-window) mask by the same helpers, OPT derives its positions from the mask
and Falcon its ALiBi bias, and position ids given without a mask mark packed sequences to the
families whose ``forward`` detects them.  No KV cache.

A tied head (``tie_word_embeddings``) keeps sharing its Parameter with the token embedding; the
Pipeline keeps tied parameters tied across ranks.  ``transformers`` is imported only when a layer
runs (the caller's model needs it anyway); nothing here downloads anything.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

#: The section of the docs on writing an adapter for another architecture.
ADAPTER_DOCS = "docs/transformers.md, section 'Writing an adapter for another architecture'"


def _hidden(output: Any) -> torch.Tensor:
    """A decoder block's hidden states (some blocks return a tuple, most a tensor)."""
    return output[0] if isinstance(output, tuple) else output


def _positions(hidden: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The caller's ``position_ids``, else ``[[0, 1, …, seq − 1]]`` for a ``(batch, seq, …)`` tensor,
    as the models' ``forward`` defaults them."""
    if position_ids is not None:
        return position_ids
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def _opt_positions(attention_mask: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor:
    """``OPTDecoder``'s default position ids: ``cumsum(mask) · mask − 1`` per row (padding at −1,
    each sequence from 0 wherever its padding ends); ``arange(seq)`` without a mask."""
    if attention_mask is None:
        return _positions(tokens)
    return (torch.cumsum(attention_mask, dim=1) * attention_mask - 1).long()


def causal_mask(
    config: Any,
    hidden: torch.Tensor,
    *,
    sliding: bool = False,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> Any:
    """The causal mask ``config``'s attention implementation expects for ``hidden``'s sequences.

    Built by ``transformers.masking_utils`` as the model's ``forward`` builds it, with the causal
    skip disabled, so sdpa gets an explicit boolean mask and eager an additive float one (flash
    attention, which masks by itself, gets ``None``).  ``sliding`` gives the sliding-window mask of
    ``config.sliding_window``.  ``attention_mask`` (2-D, 1 = keep) removes the padded keys, as in
    the model.  ``position_ids`` are the caller's only: without a padding mask the helper reads
    restarting positions as packed sequences (a device-to-host read in every layer), and the
    default ``arange`` positions never restart, so they are not passed.
    """
    from transformers import masking_utils

    make = masking_utils.create_sliding_window_causal_mask if sliding else masking_utils.create_causal_mask
    return make(
        config=config,
        inputs_embeds=hidden,
        attention_mask=attention_mask,
        cache=None,
        position_ids=position_ids,
        allow_is_causal_skip=False,
    )


# -- embeddings -------------------------------------------------------------------------------------


class RotaryEmbedding(nn.Module):
    """Token embedding and rotary tables of a rotary-position model: ``tokens → (hidden, cos, sin)``.

    ``embed`` is the model's own embedding module (Gemma's scales by √hidden inside it);
    ``dropout`` the embedding dropout where the family has one (GPT-NeoX).
    """

    def __init__(self, embed: nn.Module, rotary: nn.Module, *, dropout: nn.Module | None = None):
        super().__init__()
        self.embed_tokens, self.rotary_emb = embed, rotary  # the names llama_layers always gave them
        self.dropout = dropout if dropout is not None else nn.Identity()

    def forward(
        self, tokens: torch.Tensor, *, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = self.dropout(self.embed_tokens(tokens))
        cos, sin = self.rotary_emb(hidden, _positions(tokens, position_ids))
        return hidden, cos, sin


class GPT2Embedding(nn.Module):
    """Token and position embeddings of a ``GPT2Model`` (its ``wte``, ``wpe`` and dropout)."""

    def __init__(self, transformer: Any):
        super().__init__()
        self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop

    def forward(self, tokens: torch.Tensor, *, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.drop(self.wte(tokens) + self.wpe(_positions(tokens, position_ids)))


class OPTEmbedding(nn.Module):
    """Token and learned position embeddings of an ``OPTDecoder``, with its ``project_in`` if any
    (the positions counted along the padding mask, as ``OPTDecoder`` counts them)."""

    def __init__(self, decoder: Any):
        super().__init__()
        self.embed_tokens, self.embed_positions = decoder.embed_tokens, decoder.embed_positions
        self.project_in = decoder.project_in if decoder.project_in is not None else nn.Identity()

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ids = position_ids if position_ids is not None else _opt_positions(attention_mask, tokens)
        positions = self.embed_positions(torch.ones(tokens.shape, device=tokens.device), 0, position_ids=ids)
        return self.project_in(self.embed_tokens(tokens)) + positions


# -- decoder layers ---------------------------------------------------------------------------------


class DecoderLayer(nn.Module):
    """One decoder block of an absolute-position model (GPT-2): hidden states in and out.

    The causal mask is rebuilt from the hidden states and the padding mask (:func:`causal_mask`).
    ``layerdrop`` skips the block in training with that probability, as ``OPTDecoder`` does.
    """

    def __init__(self, block: nn.Module, config: Any, *, layerdrop: float = 0.0):
        super().__init__()
        self.block, self.config, self.layerdrop = block, config, layerdrop

    def forward(
        self,
        hidden: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.training and self.layerdrop > 0 and torch.rand([]) < self.layerdrop:
            return hidden
        mask, positions = self.mask_and_positions(hidden, attention_mask, position_ids)
        return _hidden(self.block(hidden, attention_mask=mask, position_ids=positions))

    def mask_and_positions(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None
    ) -> tuple[Any, torch.Tensor]:
        """The block's mask and position ids, as ``GPT2Model`` makes them: its mask helper reads
        the caller's position ids (packed sequences)."""
        mask = causal_mask(self.config, hidden, attention_mask=attention_mask, position_ids=position_ids)
        return mask, _positions(hidden, position_ids)


class OPTDecoderLayer(DecoderLayer):
    """One ``OPTDecoderLayer``: as :class:`DecoderLayer`, with the mask and positions ``OPTDecoder``
    makes — its mask helper never reads the position ids, its positions count along the padding mask."""

    def mask_and_positions(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None
    ) -> tuple[Any, torch.Tensor]:
        """The mask of the padding alone; the caller's positions, else :func:`_opt_positions`."""
        mask = causal_mask(self.config, hidden, attention_mask=attention_mask)
        return mask, position_ids if position_ids is not None else _opt_positions(attention_mask, hidden)


class RotaryDecoderLayer(nn.Module):
    """One decoder block of a rotary-position model: ``(hidden, cos, sin) → (hidden, cos, sin)``.

    The block's causal mask (sliding-window when ``sliding``) is rebuilt from the hidden states and
    the padding mask, the position ids are the caller's or ``arange(seq)``; the rotary tables pass
    through to the next block.
    """

    def __init__(self, block: nn.Module, config: Any, *, sliding: bool = False):
        super().__init__()
        self.layer, self.config, self.sliding = block, config, sliding  # ``layer``: llama_layers' name

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mask = causal_mask(
            self.config,
            hidden,
            sliding=self.sliding,
            attention_mask=attention_mask,
            position_ids=position_ids,
        )
        output = self.layer(
            hidden,
            attention_mask=mask,
            position_ids=_positions(hidden, position_ids),
            position_embeddings=(cos, sin),
        )
        return _hidden(output), cos, sin


class FalconDecoderLayer(RotaryDecoderLayer):
    """One ``FalconDecoderLayer``: rotary, or ALiBi (``config.alibi``) folded into the mask as
    ``FalconModel`` folds it (the ALiBi bias is rebuilt from the padding mask too)."""

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mask, alibi = falcon_mask(
            self.config, hidden, attention_mask=attention_mask, position_ids=position_ids
        )
        output = self.layer(
            hidden,
            alibi=alibi,
            attention_mask=mask,
            position_ids=_positions(hidden, position_ids),
            position_embeddings=(cos, sin),
        )
        return _hidden(output), cos, sin


def falcon_mask(
    config: Any,
    hidden: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> tuple[Any, torch.Tensor | None]:
    """``FalconModel``'s ``(mask, alibi)`` for ``hidden``: the causal mask, with the ALiBi bias
    added in (and the bias itself, shaped as the model passes it) when ``config.alibi``.  The bias
    counts positions along the padding mask ``attention_mask`` (all ones without one)."""
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    mask = causal_mask(config, hidden, attention_mask=attention_mask, position_ids=position_ids)
    if not config.alibi:
        return mask, None
    batch, seq, heads = hidden.shape[0], hidden.shape[1], config.num_attention_heads
    if attention_mask is None:
        attention_mask = torch.ones((batch, seq), device=hidden.device, dtype=torch.long)
    alibi = build_alibi_tensor(attention_mask, heads, dtype=hidden.dtype)
    if mask is None or mask.ndim != 4:
        return mask, alibi
    lowest = torch.finfo(hidden.dtype).min
    if mask.dtype == torch.bool:
        mask = torch.where(mask, torch.zeros((), device=mask.device, dtype=hidden.dtype), lowest)
    alibi = alibi.reshape(batch, -1, *alibi.shape[1:])
    return torch.masked_fill(alibi / math.sqrt(config.hidden_size // heads), mask < -1, lowest), alibi


# -- head -------------------------------------------------------------------------------------------


class LMHead(nn.Module):
    """Final norm and vocabulary projection; extra inputs (the rotary tables) are dropped.

    ``project`` is OPT's ``project_out`` (applied between the norm and the head); ``softcap`` the
    final logit soft-capping ``c · tanh(logits / c)`` of Gemma 2.
    """

    def __init__(
        self,
        norm: nn.Module | None,
        head: nn.Module,
        *,
        project: nn.Module | None = None,
        softcap: float | None = None,
    ):
        super().__init__()
        self.norm = norm if norm is not None else nn.Identity()
        self.project = project if project is not None else nn.Identity()
        self.head, self.softcap = head, softcap

    def forward(self, hidden: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.project(self.norm(hidden)))
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


# -- the adapters -----------------------------------------------------------------------------------


def gpt2_layers(model: Any) -> list[nn.Module]:
    """``GPT2LMHeadModel`` → ``[embedding, block 0, …, block n−1, head]``.

    A tied head stays tied to the token embedding (the Pipeline sums the tied gradients when the
    two land on different ranks).
    """
    transformer = model.transformer
    blocks = [DecoderLayer(block, model.config) for block in transformer.h]
    return [GPT2Embedding(transformer), *blocks, LMHead(transformer.ln_f, model.lm_head)]


def _sliding_layers(config: Any) -> list[bool]:
    """Which decoder blocks attend through a sliding window, as the family's ``forward`` decides."""
    count, family = config.num_hidden_layers, config.model_type
    if family in ("mistral", "phi3"):  # one mask for all blocks: windowed when a window is set
        return [getattr(config, "sliding_window", None) is not None] * count
    types = getattr(config, "layer_types", None)
    if family in ("qwen2", "qwen3", "gemma2") and types is not None:
        return [kind == "sliding_attention" for kind in types[:count]]
    return [False] * count


def llama_layers(model: Any) -> list[nn.Module]:
    """``LlamaForCausalLM`` (or a model laid out like it: ``model.model.{embed_tokens, rotary_emb,
    layers, norm}`` and ``lm_head``) → ``[embedding, decoder layer 0, …, decoder layer n−1, head]``.

    Covers Llama, Qwen2, Qwen3, Mistral, Gemma, Gemma 2 and Phi-3: sliding-window blocks get
    sliding-window masks, and Gemma 2's final logit soft-capping is applied by the head.
    """
    inner, config = model.model, model.config
    blocks = [
        RotaryDecoderLayer(block, config, sliding=sliding)
        for block, sliding in zip(inner.layers, _sliding_layers(config))
    ]
    head = LMHead(inner.norm, model.lm_head, softcap=getattr(config, "final_logit_softcapping", None))
    return [RotaryEmbedding(inner.embed_tokens, inner.rotary_emb), *blocks, head]


def gpt_neox_layers(model: Any) -> list[nn.Module]:
    """``GPTNeoXForCausalLM`` → ``[embedding, layer 0, …, layer n−1, head]``."""
    inner, config = model.gpt_neox, model.config
    embedding = RotaryEmbedding(inner.embed_in, inner.rotary_emb, dropout=inner.emb_dropout)
    blocks = [RotaryDecoderLayer(block, config) for block in inner.layers]
    head = model.lm_head if hasattr(model, "lm_head") else model.embed_out  # ``embed_out`` before 5.0
    return [embedding, *blocks, LMHead(inner.final_layer_norm, head)]


def opt_layers(model: Any) -> list[nn.Module]:
    """``OPTForCausalLM`` → ``[embedding, decoder layer 0, …, decoder layer n−1, head]``."""
    decoder, config = model.model.decoder, model.config
    blocks = [OPTDecoderLayer(block, config, layerdrop=decoder.layerdrop) for block in decoder.layers]
    head = LMHead(decoder.final_layer_norm, model.lm_head, project=decoder.project_out)
    return [OPTEmbedding(decoder), *blocks, head]


def falcon_layers(model: Any) -> list[nn.Module]:
    """``FalconForCausalLM`` → ``[embedding, decoder layer 0, …, decoder layer n−1, head]``
    (rotary or ALiBi, as the config says)."""
    inner, config = model.transformer, model.config
    blocks = [FalconDecoderLayer(block, config) for block in inner.h]
    embedding = RotaryEmbedding(inner.word_embeddings, inner.rotary_emb)
    return [embedding, *blocks, LMHead(inner.ln_f, model.lm_head)]


#: ``config.model_type`` → the adapter cutting that family's causal LM.
ADAPTERS: dict[str, Callable[[Any], list[nn.Module]]] = {
    "gpt2": gpt2_layers,
    "llama": llama_layers,
    "qwen2": llama_layers,
    "qwen3": llama_layers,
    "mistral": llama_layers,
    "gemma": llama_layers,
    "gemma2": llama_layers,
    "phi3": llama_layers,
    "gpt_neox": gpt_neox_layers,
    "opt": opt_layers,
    "falcon": falcon_layers,
}


def pipeline_layers(model: Any) -> list[nn.Module]:
    """A ``transformers`` causal LM → ``[embedding, one layer per decoder block, head]`` for
    :class:`~zerobubble.Pipeline`, chosen by ``model.config.model_type`` (see :data:`ADAPTERS`).

    The layers share the model's parameters (nothing is copied) and compute its logits under any
    attention implementation, for padded batches too (pass ``attention_mask`` and ``position_ids``
    to ``Pipeline.step`` as keyword arguments, as to the model).  Raises ``TypeError`` for an object
    that is not a ``transformers`` causal LM and ``ValueError`` for an unsupported family.
    """
    family = getattr(getattr(model, "config", None), "model_type", None)
    if not isinstance(family, str) or not isinstance(model, nn.Module):
        raise TypeError(
            "pipeline_layers needs a transformers causal LM (a module with a config), "
            f"not {type(model).__name__}"
        )
    adapter = ADAPTERS.get(family)
    if adapter is None:
        raise ValueError(
            f"no pipeline adapter for model_type {family!r} ({type(model).__name__}); supported: "
            f"{', '.join(sorted(ADAPTERS))}. To pipeline another architecture, write its layers "
            f"as in {ADAPTER_DOCS}"
        )
    if not hasattr(model, "lm_head") and not hasattr(model, "embed_out"):
        raise ValueError(
            f"{type(model).__name__} has no language-model head: pass the ...ForCausalLM model "
            "(AutoModelForCausalLM), not its base model"
        )
    return adapter(model)
