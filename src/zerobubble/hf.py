"""Pipeline layers cut from Hugging Face ``transformers`` causal language models, weights shared.

:class:`~zerobubble.Pipeline` takes a list of layers, each called with the previous layer's output
(a tuple is unpacked).  :func:`pipeline_layers` cuts a ``transformers`` causal LM into such a list
without copying a weight: an embedding, one layer per decoder block and a head, computing what the
model's ``forward`` computes (``docs/transformers.md``: the families, and how to write an adapter).
Between layers travel the hidden states, and for rotary families the tables ``(cos, sin)`` the
embedding computes once.  Each decoder layer rebuilds its causal (or sliding-window) mask and the
position ids from the hidden states' shape with ``transformers``' own mask helpers, so every
attention implementation gets the model's mask and no ``seq × seq`` tensor crosses a stage.

Padded batches: the layers take ``attention_mask`` (2-D, 1 = keep) and ``position_ids`` as keyword
arguments (``Pipeline.step(input_ids, targets=labels, attention_mask=mask)``), used as the model
uses them (OPT's positions and Falcon's ALiBi follow the mask; position ids without a mask mark
packed sequences where the family detects them).  No KV cache.  A tied head keeps its Parameter
shared with the token embedding, across ranks too.

``pipeline_layers(model, vocab_parallel=True)`` gives :class:`VocabParallelParts` instead: the token
embedding and the head as the vocabulary-parallel layers ``Pipeline(layers, head=, embedding=)``
shards over the ranks, and layers between them: the first takes the embedded tokens, the last
returns the final-norm hidden states the head projects.  ``transformers`` is imported only when a
layer runs; nothing here downloads anything.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, overload

import torch
import torch.nn.functional as F
from torch import nn

from .runtime import PipelineError
from .runtime.vocab.layers import VocabParallelEmbedding, VocabParallelHead

__all__ = [
    "ADAPTERS",
    "ADAPTER_DOCS",
    "DecoderLayer",
    "FalconDecoderLayer",
    "FinalNorm",
    "GPT2Embedding",
    "LMHead",
    "OPTDecoderLayer",
    "OPTEmbedding",
    "RotaryDecoderLayer",
    "RotaryEmbedding",
    "VocabParallelParts",
    "causal_mask",
    "falcon_layers",
    "falcon_mask",
    "gpt2_layers",
    "gpt_neox_layers",
    "llama_layers",
    "moe_layers",
    "opt_layers",
    "pipeline_layers",
    "vocab_parallel_parts",
    "with_router_aux_loss",
]

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

    ``embed`` is the model's own embedding module (Gemma's scales by √hidden inside it), or ``None``
    for a layer that takes the embedded tokens ``(batch, seq, dim)`` instead (vocabulary-parallel);
    ``dropout`` the embedding dropout where the family has one (GPT-NeoX).
    """

    def __init__(self, embed: nn.Module | None, rotary: nn.Module, *, dropout: nn.Module | None = None):
        super().__init__()
        self.embed_tokens, self.rotary_emb = embed, rotary  # the names llama_layers always gave them
        self.dropout = dropout if dropout is not None else nn.Identity()

    def forward(
        self, tokens: torch.Tensor, *, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        embedded = tokens if self.embed_tokens is None else self.embed_tokens(tokens)
        hidden = self.dropout(embedded)
        cos, sin = self.rotary_emb(hidden, _positions(tokens, position_ids))
        return hidden, cos, sin

    def without_tokens(self) -> tuple[nn.Module | None, RotaryEmbedding]:
        """``(token embedding, this layer taking the embedded tokens)``, sharing every module."""
        return self.embed_tokens, RotaryEmbedding(None, self.rotary_emb, dropout=self.dropout)


class GPT2Embedding(nn.Module):
    """Token and position embeddings of a ``GPT2Model`` (its ``wte``, ``wpe`` and dropout).

    ``embedded``: without ``wte``, taking the embedded tokens ``(batch, seq, dim)`` instead.
    """

    def __init__(self, transformer: Any, *, embedded: bool = False):
        super().__init__()
        self.wte = None if embedded else transformer.wte
        self.wpe, self.drop = transformer.wpe, transformer.drop

    def forward(self, tokens: torch.Tensor, *, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        embedded = tokens if self.wte is None else self.wte(tokens)
        return self.drop(embedded + self.wpe(_positions(tokens, position_ids)))

    def without_tokens(self) -> tuple[nn.Module | None, GPT2Embedding]:
        """``(token embedding, this layer taking the embedded tokens)``, sharing every module."""
        return self.wte, GPT2Embedding(self, embedded=True)


class OPTEmbedding(nn.Module):
    """Token and learned position embeddings of an ``OPTDecoder``, with its ``project_in`` if any
    (the positions counted along the padding mask, as ``OPTDecoder`` counts them).

    ``embedded``: without ``embed_tokens``, taking the embedded tokens ``(batch, seq, dim)`` instead
    (before ``project_in``); the positions follow their first two dimensions.
    """

    def __init__(self, decoder: Any, *, embedded: bool = False):
        super().__init__()
        self.embed_tokens = None if embedded else decoder.embed_tokens
        self.embed_positions = decoder.embed_positions
        self.project_in = decoder.project_in if decoder.project_in is not None else nn.Identity()

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ids = position_ids if position_ids is not None else _opt_positions(attention_mask, tokens)
        shape = tokens.shape[:2]  # (batch, seq) of the tokens or of their embedding
        positions = self.embed_positions(torch.ones(shape, device=tokens.device), 0, position_ids=ids)
        embedded = tokens if self.embed_tokens is None else self.embed_tokens(tokens)
        return self.project_in(embedded) + positions

    def without_tokens(self) -> tuple[nn.Module | None, OPTEmbedding]:
        """``(token embedding, this layer taking the embedded tokens)``, sharing every module."""
        return self.embed_tokens, OPTEmbedding(self, embedded=True)


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


class FinalNorm(nn.Module):
    """The final norm (and OPT's ``project_out``) of a vocabulary-parallel cut: ``hidden → hidden``,
    the states the vocabulary-parallel head projects; extra inputs (the rotary tables) are dropped."""

    def __init__(self, norm: nn.Module | None, *, project: nn.Module | None = None):
        super().__init__()
        self.norm = norm if norm is not None else nn.Identity()
        self.project = project if project is not None else nn.Identity()

    def forward(self, hidden: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
        return self.project(self.norm(hidden))


class LMHead(FinalNorm):
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
        super().__init__(norm, project=project)
        self.head, self.softcap = head, softcap

    def forward(self, hidden: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
        logits = self.head(super().forward(hidden))
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
    if family in ("mistral", "phi3", "mixtral", "qwen3_moe"):  # one mask for all: windowed if set
        return [getattr(config, "sliding_window", None) is not None] * count
    types = getattr(config, "layer_types", None)
    if family in ("qwen2", "qwen3", "gemma2", "qwen2_moe") and types is not None:
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


def moe_layers(model: Any) -> list[nn.Module]:
    """Mixtral, Qwen2-MoE, Qwen3-MoE → ``[embedding, decoder layers, head]``; a model asking for its
    load-balancing loss gets a head returning ``(logits, aux term)`` (:func:`with_router_aux_loss`)."""
    from .hf_moe import moe_layers as cut  # it builds on this module's layers

    return cut(model)


def with_router_aux_loss(loss_fn: Callable[[Any, Any], torch.Tensor]) -> Callable[[Any, Any], torch.Tensor]:
    """``loss_fn`` for a cut whose head returns ``(logits, aux term)`` (a mixture-of-experts model
    asking for its load-balancing loss): ``loss_fn(logits, targets) + aux term``, as the model adds
    it to its loss; any other output goes to ``loss_fn`` unchanged."""

    def loss(output: Any, targets: Any) -> torch.Tensor:
        if isinstance(output, tuple) and len(output) == 2 and output[1].dim() == 0:
            return loss_fn(output[0], targets) + output[1]
        return loss_fn(output, targets)

    return loss


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
    "mixtral": moe_layers,
    "qwen2_moe": moe_layers,
    "qwen3_moe": moe_layers,
}


class VocabParallelParts(NamedTuple):
    """A causal LM cut for ``Pipeline(layers, head=head, embedding=embedding)``
    (:func:`pipeline_layers` with ``vocab_parallel=True``), every Parameter the model's own.

    ``embedding``: the token embedding (its scale too: Gemma's √hidden); ``layers``: the layer
    taking the embedded tokens, one per decoder block, and :class:`FinalNorm`; ``head``: the output
    projection (Gemma 2's soft-capping too), holding the embedding's Parameter when they are tied.
    """

    embedding: VocabParallelEmbedding
    layers: list[nn.Module]
    head: VocabParallelHead


@overload
def pipeline_layers(model: Any, *, vocab_parallel: Literal[False] = False) -> list[nn.Module]: ...
@overload
def pipeline_layers(model: Any, *, vocab_parallel: Literal[True]) -> VocabParallelParts: ...
@overload
def pipeline_layers(model: Any, *, vocab_parallel: bool) -> list[nn.Module] | VocabParallelParts: ...


def pipeline_layers(model: Any, *, vocab_parallel: bool = False) -> list[nn.Module] | VocabParallelParts:
    """A ``transformers`` causal LM → ``[embedding, one layer per decoder block, head]`` for
    :class:`~zerobubble.Pipeline`, chosen by ``model.config.model_type`` (see :data:`ADAPTERS`).

    The layers share the model's parameters (nothing is copied) and compute its logits under any
    attention implementation, for padded batches too (pass ``attention_mask`` and ``position_ids``
    to ``Pipeline.step`` as keyword arguments, as to the model).  ``vocab_parallel=True`` gives the
    :class:`VocabParallelParts` of the vocabulary-parallel Pipeline instead (its head computes the
    logits and the cross-entropy), for the model in the dtype it will train in (Gemma's embedding
    scale is read in it).  Raises ``TypeError`` for an object that is not a ``transformers`` causal
    LM and ``ValueError`` for an unsupported family (or one the vocabulary-parallel layers cannot
    reproduce: a head with a bias, an embedding other than a scaled lookup).
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
    layers = adapter(model)
    return vocab_parallel_parts(layers, family) if vocab_parallel else layers


def vocab_parallel_parts(layers: list[nn.Module], family: str) -> VocabParallelParts:
    """The :class:`VocabParallelParts` of an adapter's ``layers`` (``family`` names it in errors):
    the token embedding taken out of the first layer, the head's projection out of the last."""
    first, last = layers[0], layers[-1]
    if hasattr(last, "router_aux_loss_coef"):
        raise ValueError(
            f"the {family} head adds the router's load-balancing loss (config.output_router_logits): "
            "the vocabulary-parallel head computes the cross-entropy alone; set "
            "model.config.output_router_logits = False, or cut without vocab_parallel"
        )
    if not isinstance(first, (RotaryEmbedding, GPT2Embedding, OPTEmbedding)) or not isinstance(last, LMHead):
        raise ValueError(
            f"the {family} layers ({type(first).__name__} … {type(last).__name__}) are not cut with "
            "this module's embedding layers and LMHead: vocab_parallel needs them"
        )
    tokens, embedded = first.without_tokens()
    embedding = _vocab_embedding(tokens, family)
    if not isinstance(last.head, nn.Linear) or last.head.bias is not None:
        what = "has a bias" if isinstance(last.head, nn.Linear) else f"is a {type(last.head).__name__}"
        raise ValueError(
            f"the {family} language-model head {what}: a vocabulary-parallel head is a Linear "
            "without bias (use pipeline_layers(model) without vocab_parallel)"
        )
    head = VocabParallelHead.from_linear(last.head, softcap=last.softcap)
    final = FinalNorm(last.norm, project=last.project)
    return VocabParallelParts(embedding, [embedded, *layers[1:-1], final], head)


def _vocab_embedding(module: nn.Module | None, family: str) -> VocabParallelEmbedding:
    """``module`` as a :class:`VocabParallelEmbedding` with its ``embed_scale`` (Gemma's), in its
    weight's dtype as the model multiplies; refused unless a probe lookup is reproduced exactly."""
    if not isinstance(module, nn.Embedding):
        raise ValueError(
            f"the {family} token embedding is a {type(module).__name__}, not an nn.Embedding: "
            "the vocabulary-parallel lookup cannot reproduce it"
        )
    scale = getattr(module, "embed_scale", None)  # Gemma's: a 0-d buffer, cast to the weight's dtype
    if isinstance(scale, torch.Tensor):
        scale = float(scale.to(module.weight.dtype))
    elif not isinstance(scale, (int, float)):
        scale = None
    try:
        embedding = VocabParallelEmbedding.from_embedding(module, scale=scale)
    except PipelineError as error:
        raise ValueError(f"the {family} token embedding: {error}") from error
    if not module.weight.is_meta:
        probe = torch.arange(min(module.num_embeddings, 8), device=module.weight.device)
        with torch.no_grad():
            expected, rows = module(probe), F.embedding(probe, module.weight)
        rows = rows if scale is None else rows * scale
        if expected.shape != rows.shape or not torch.isclose(expected, rows, 0, 0, equal_nan=True).all():
            raise ValueError(
                f"the {family} token embedding ({type(module).__name__}) is not a lookup times a "
                f"scale ({scale}): the vocabulary-parallel lookup cannot reproduce it"
            )
    return embedding
