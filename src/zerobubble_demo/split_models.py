"""Small models of several kinds as pipeline layers: what the B/W split is checked and measured on.

:func:`split_model` builds transformers GPT-2 and Llama, a BatchNorm conv net, checkpointed
transformer blocks, ``nn.MultiheadAttention`` blocks and blocks on raw parameters as pipeline
layers with random weights and a batch.  The library's tests check the split on them, and
``zerobubble bench wgrad`` measures it (``zerobubble_bench.split_models``, ``benchmarks/split_guard.py``).
:func:`preserved_torch_state` builds them without changing the caller's RNG state or thread count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .models import GPTConfig, gpt_layers, lm_loss

SPLIT_MODELS = ("gpt2", "llama", "convnet", "checkpointed", "mha", "raw")
"""Models the B/W split is checked on: transformers GPT-2 and Llama, a BatchNorm conv net,
transformer blocks under activation checkpointing (``use_reentrant=False``), and blocks of
``nn.MultiheadAttention`` with a head calling ``F.linear`` on its own weight (projections that
are ``F.linear`` calls on parameters: the generic split's routed closed form), and transformer
blocks written with raw parameters (``x @ weight`` and ``F.layer_norm`` on their own tensors: no
fast path; the generic split routes the products and takes the norms' gradients from B)."""

REFERENCE_MODELS = ("blocks",)
"""Models for the W share only: ``blocks`` is ``checkpointed`` without the checkpointing (the demo
GPT's blocks, which other tests check), so its stages show what recomputing the forward adds to B."""


@contextmanager
def preserved_torch_state() -> Iterator[None]:
    """Run the block with its own seeds and thread count: torch's global CPU RNG state and its
    intra-op thread count are restored afterwards, however the block ends."""
    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            torch.set_num_threads(threads)


@dataclass
class SplitModel:
    """Layers of a model, its loss and one batch (inputs, targets) to pipeline."""

    layers: list[nn.Module]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    inputs: torch.Tensor
    targets: torch.Tensor


def split_model(
    name: str, width: int = 16, batch: int = 8, seq: int = 8, seed: int = 0, blocks: int = 2
) -> SplitModel:
    """``name`` (one of :data:`SPLIT_MODELS`) with random weights (``seed``) and a random batch.

    Two blocks between an embedding and a head (4 layers, enough for 2 ranks × 2 chunks; ``blocks``
    sets the count for ``checkpointed`` and ``blocks``); ``width`` is the hidden size (channels for
    the conv net), ``seq`` the sequence length (image side).
    GPT-2 and Llama need ``transformers`` (random configs: nothing is downloaded).  The caller's
    global RNG state is left as it was.
    """
    with preserved_torch_state():
        return _build_split_model(name, width, batch, seq, seed, blocks)


def _build_split_model(name: str, width: int, batch: int, seq: int, seed: int, blocks: int) -> SplitModel:
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    vocab = 32
    tokens = torch.randint(vocab, (batch, seq), generator=generator)
    targets = torch.randint(vocab, (batch, seq), generator=generator)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        from zerobubble.hf import gpt2_layers

        gpt2 = GPT2Config(
            vocab_size=vocab, n_positions=seq, n_embd=width, n_layer=2, n_head=2, tie_word_embeddings=False,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return SplitModel(gpt2_layers(GPT2LMHeadModel(gpt2)), lm_loss, tokens, targets)
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        from zerobubble.hf import llama_layers

        llama = LlamaConfig(
            vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=seq,
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
        return SplitModel(llama_layers(LlamaForCausalLM(llama)), lm_loss, tokens, targets)
    if name == "convnet":
        images = torch.randn(batch, 3, seq, seq, generator=generator)
        labels = torch.randint(10, (batch,), generator=generator)
        layers = [_conv_bn(3, width), _conv_bn(width, width), _conv_bn(width, width), _ConvHead(width, 10)]
        return SplitModel(layers, F.cross_entropy, images, labels)
    if name in ("checkpointed", "blocks"):
        config = GPTConfig(vocab=vocab, seq_len=seq, dim=width, heads=2, n_layers=blocks)
        embedding, *body, head = gpt_layers(config)
        if name == "checkpointed":
            body = [_Checkpointed(b) for b in body]
        return SplitModel([embedding, *body, head], lm_loss, tokens, targets)
    if name == "mha":
        layers = [
            nn.Embedding(vocab, width),
            AttentionBlock(width),
            AttentionBlock(width),
            _LinearHead(width, vocab),
        ]
        return SplitModel(layers, lm_loss, tokens, targets)
    if name == "raw":
        layers = [nn.Embedding(vocab, width), RawBlock(width), RawBlock(width), _LinearHead(width, vocab)]
        return SplitModel(layers, lm_loss, tokens, targets)
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(SPLIT_MODELS + REFERENCE_MODELS)}")


def _conv_bn(channels_in: int, channels_out: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(channels_in, channels_out, 3, padding=1), nn.BatchNorm2d(channels_out), nn.ReLU()
    )


class _ConvHead(nn.Module):
    """Global average pooling, a learned per-channel scale and a linear classifier.

    The scale is the head's own parameter, so the head takes the generic split (around its
    fast-path ``fc``): the real-model tests cover that path too.
    """

    def __init__(self, channels: int, classes: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(channels))
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)) * self.scale)


class AttentionBlock(nn.Module):
    """Pre-norm ``nn.MultiheadAttention`` (batch first) and an MLP, each with a residual.

    The attention's projections are ``F.linear`` calls on its parameters inside
    ``F.multi_head_attention_forward``: the generic split routes them to the closed form.
    """

    def __init__(self, width: int, heads: int = 2):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class RawBlock(nn.Module):
    """A causal transformer block written as a user might, on its own raw parameters.

    Layer norms through ``F.layer_norm``, projections as ``x @ weight`` (no ``nn.Linear``, no
    ``F.linear``): one module, no fast path.  The default split routes its products to their closed
    form; the generic split alone (no routing) finds its parameters on both sides of the attention
    and of the MLP's activation and starts W at the frontier (``docs/wgrad.md``).
    """

    def __init__(self, width: int, heads: int = 2):
        super().__init__()
        self.heads = heads

        def weight(rows: int, columns: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(rows, columns) / rows**0.5)

        self.norm1_weight, self.norm1_bias = nn.Parameter(torch.ones(width)), nn.Parameter(torch.zeros(width))
        self.norm2_weight, self.norm2_bias = nn.Parameter(torch.ones(width)), nn.Parameter(torch.zeros(width))
        self.qkv, self.qkv_bias = weight(width, 3 * width), nn.Parameter(torch.zeros(3 * width))
        self.out = weight(width, width)
        self.up, self.down = weight(width, 2 * width), weight(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        h = F.layer_norm(x, (width,), self.norm1_weight, self.norm1_bias)
        q, k, v = (h @ self.qkv + self.qkv_bias).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + attended.transpose(1, 2).reshape(batch, length, width) @ self.out
        h = F.layer_norm(x, (width,), self.norm2_weight, self.norm2_bias)
        return x + F.gelu(h @ self.up) @ self.down


class _LinearHead(nn.Module):
    """A final norm and an output projection written as ``F.linear`` on the head's own weight."""

    def __init__(self, width: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.weight = nn.Parameter(torch.randn(vocab, width) / width**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(x), self.weight)


class _Checkpointed(nn.Module):
    """A block whose activations are recomputed in the backward (``use_reentrant=False``)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, use_reentrant=False)
