"""A small GPT-style language model and a synthetic corpus that needs no download.

:func:`gpt_layers` returns the model as a list of layers in order — embedding, ``n_layers``
pre-norm transformer blocks, final norm with the LM head — ready to be cut into pipeline stages.
All projections are ``nn.Linear``, so the B/W split applies to them.

:class:`MarkovCorpus` generates token sequences from a seeded sparse Markov chain: each token has a
few likely successors, so the next-token loss can fall from ``ln(vocab)`` to near the chain's
entropy — a learnable task whose progress is visible within a few dozen steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import ConfigError


@dataclass(frozen=True)
class GPTConfig:
    """Size of the model: vocabulary, context length, width, heads and depth.

    ``fused_qkv`` projects q, k and v with one Linear (the default); False gives each its own, so
    that a column-wise tensor-parallel split keeps whole heads of each (:func:`tensor_parallel`).
    """

    vocab: int = 64
    seq_len: int = 32
    dim: int = 64
    heads: int = 4
    n_layers: int = 4
    fused_qkv: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab", "seq_len", "dim", "heads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"GPTConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.n_layers < 0 or self.dim % self.heads:
            raise ConfigError(
                f"GPTConfig needs n_layers >= 0 and dim divisible by heads; got n_layers={self.n_layers}, "
                f"dim={self.dim}, heads={self.heads}"
            )


class Embedding(nn.Module):
    """Token plus learned position embedding."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.tokens = nn.Embedding(config.vocab, config.dim)
        self.positions = nn.Embedding(config.seq_len, config.dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tokens(tokens) + self.positions(positions)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, each with a residual."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.dim // config.heads
        self.norm1 = nn.LayerNorm(config.dim)
        if config.fused_qkv:
            self.qkv = nn.Linear(config.dim, 3 * config.dim)
        else:
            self.q, self.k, self.v = (nn.Linear(config.dim, config.dim) for _ in range(3))
        self.proj = nn.Linear(config.dim, config.dim)
        self.norm2 = nn.LayerNorm(config.dim)
        self.fc = nn.Linear(config.dim, 4 * config.dim)
        self.out = nn.Linear(4 * config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(self._attention(self.norm1(x)))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        if hasattr(self, "qkv"):
            q, k, v = self.qkv(x).split(dim, dim=-1)
        else:  # separate projections: under tensor parallelism each holds this rank's heads
            q, k, v = self.q(x), self.k(x), self.v(x)
        q, k, v = (t.view(batch, length, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(batch, length, -1)


class Head(nn.Module):
    """Final norm and the projection to vocabulary logits."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.norm = nn.LayerNorm(config.dim)
        self.logits = nn.Linear(config.dim, config.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(self.norm(x))


def gpt_layers(config: GPTConfig) -> list[nn.Module]:
    """The model as layers in order: embedding, blocks, head (``n_layers + 2`` modules)."""
    return [Embedding(config), *(Block(config) for _ in range(config.n_layers)), Head(config)]


def tensor_parallel(layer: nn.Module, mesh: Any) -> nn.Module:
    """The Pipeline's ``parallelize=`` for these layers: each :class:`Block` split Megatron-style over
    the mesh's ``"tp"`` dimension (q, k, v and ``fc`` by columns, ``proj`` and ``out`` by rows, so a
    block needs two all-reduces forward and two backward); the embedding and the head stay whole.
    Needs ``fused_qkv=False`` (columns of a fused projection would mix q, k and v)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if not isinstance(layer, Block):
        return layer
    if hasattr(layer, "qkv"):
        raise ConfigError("tensor parallelism needs GPTConfig(fused_qkv=False): separate q, k, v")
    column, row = ColwiseParallel, RowwiseParallel
    plan = {"q": column(), "k": column(), "v": column(), "proj": row(), "fc": column(), "out": row()}
    return parallelize_module(layer, mesh["tp"], plan)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of the batch."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class MarkovCorpus:
    """Token sequences from a seeded sparse Markov chain (``branching`` successors per token).

    ``entropy`` is the chain's per-token entropy in nats: the loss a perfect model reaches.
    """

    def __init__(self, vocab: int, seq_len: int, seed: int = 0, branching: int = 2):
        generator = torch.Generator().manual_seed(seed)
        self.vocab, self.seq_len = vocab, seq_len
        self.successors = torch.stack(
            # clone: a slice keeps its whole permutation's storage alive (vocab² values in all)
            [torch.randperm(vocab, generator=generator)[:branching].clone() for _ in range(vocab)]
        )
        weights = torch.rand(branching, generator=generator) + 0.5
        self.probabilities = weights / weights.sum()
        self.entropy = float(-(self.probabilities * self.probabilities.log()).sum())
        self._generator = torch.Generator().manual_seed(seed + 1)

    def batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of shape ``[batch_size, seq_len]``: targets are inputs shifted by one."""
        tokens = torch.empty(batch_size, self.seq_len + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(self.vocab, (batch_size,), generator=self._generator)
        choices = torch.multinomial(
            self.probabilities.expand(batch_size, -1),
            self.seq_len,
            replacement=True,
            generator=self._generator,
        )
        for position in range(self.seq_len):
            tokens[:, position + 1] = self.successors[tokens[:, position], choices[:, position]]
        return tokens[:, :-1], tokens[:, 1:]

    @property
    def initial_loss(self) -> float:
        """``ln(vocab)``: the loss of a model that knows nothing."""
        return math.log(self.vocab)
