"""Vocabulary-parallel output layer (LM head + cross-entropy) and token embedding: the math, no collectives.

With vocabulary parallelism each of p ranks holds one contiguous slice of the vocabulary rows
(:func:`shard_bounds`) of the head's and the embedding's weight, so the largest layers of a language
model are spread over the pipeline instead of weighing on its first and last stages.  This module is
the arithmetic of one shard; the pipeline runtime does the collectives between the calls:

* head, one barrier: every shard runs :func:`head_partials` (its logits' max, sum of exponentials and
  label logit, and its two [n, dim] terms of the input gradient); the runtime all-gathers ``stats`` and
  ``parts``; :func:`head_totals` combines the stats exactly (each shard's sum rescaled by exp(m_i − m),
  never exp of a raw logit) into the loss, and :func:`head_input_grad` gives the gradient of the hidden
  states.  :func:`head_weight_grad` (this shard's weight gradient) needs only the totals and can be
  deferred, like any W;
* embedding: :func:`embedding_partial` on every shard, summed by an all-reduce, is the embedding; the
  gradient of the output, given to every shard, yields its rows' gradient in :func:`embedding_weight_grad`.

The modules (:class:`VocabParallelHead`, :class:`VocabParallelEmbedding`) hold the weight and the
options; unsharded, their ``forward`` is the ordinary layer, so a model can be built and checked with
them before the pipeline shards it with ``keep_shard``.  The functions compute without autograd, in the
dtype of their inputs; in float64 they match the unsharded layers to rounding.  Gemma-2's final-logit
soft-capping (c·tanh(logit / c)) and embedding scaling are supported.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import PipelineError

__all__ = [
    "HeadPartials",
    "HeadTotals",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "check_labels",
    "check_tokens",
    "embedding_partial",
    "embedding_weight_grad",
    "head_input_grad",
    "head_partials",
    "head_totals",
    "head_weight_grad",
    "shard_bounds",
]


def shard_bounds(vocab: int, num_shards: int) -> tuple[tuple[int, int], ...]:
    """Contiguous row ranges ``[start, stop)`` of each of ``num_shards`` shards of ``vocab`` rows.

    The first ``vocab % num_shards`` shards get one row more.  Raises :class:`PipelineError` naming
    both sizes if either is below 1 or ``vocab < num_shards`` (a shard would be empty).
    """
    if isinstance(vocab, bool) or isinstance(num_shards, bool) or vocab < 1 or num_shards < 1:
        raise PipelineError(
            f"cannot split a vocabulary of {vocab} rows into {num_shards} shards: both must be integers ≥ 1"
        )
    if vocab < num_shards:
        raise PipelineError(
            f"cannot split a vocabulary of {vocab} rows into {num_shards} shards: some shards would be "
            f"empty; use at most {vocab} shards"
        )
    base, extra = divmod(vocab, num_shards)
    bounds = []
    start = 0
    for index in range(num_shards):
        stop = start + base + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return tuple(bounds)


def _as_weight(
    weight: torch.Tensor, what: str, device: torch.device | str | None, dtype: torch.dtype | None
) -> nn.Parameter:
    """``weight`` as a Parameter (the same object if it is one), checked to be 2-D."""
    if weight.dim() != 2:
        raise PipelineError(f"the {what} weight must be 2-D [vocab, dim]; got shape {tuple(weight.shape)}")
    if dtype is not None and dtype != weight.dtype:
        raise PipelineError(
            f"dtype={dtype} was given with a {what} weight of dtype {weight.dtype}: device and dtype "
            f"apply only to a new weight; convert the weight itself (or the model) instead"
        )
    if device is not None and torch.device(device) != weight.device:
        raise PipelineError(
            f"device={device} was given with a {what} weight on {weight.device}: device and dtype "
            f"apply only to a new weight; move the weight itself (or the model) instead"
        )
    return weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)


def _check_size(value: object, name: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PipelineError(f"the {what}'s {name} must be an integer ≥ 1; got {value!r}")
    return value


class _VocabShard(nn.Module):
    """What the head and the embedding share: a [rows, dim] weight and which vocabulary rows it holds."""

    weight: nn.Parameter
    _kind = "layer"

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight
        self.vocab_size: int = weight.shape[0]
        self.dim: int = weight.shape[1]
        self.vocab_start: int = 0
        self.vocab_stop: int = self.vocab_size
        self.shard: tuple[int, int] | None = None  # (index, count) once keep_shard has run

    def keep_shard(self, index: int, count: int) -> None:
        """Keep only shard ``index`` of ``count`` (:func:`shard_bounds`) of the weight rows.

        Replaces ``self.weight`` by a new Parameter holding a clone of those rows (same dtype, device and
        ``requires_grad``), so a weight tied to another module is no longer shared: shard both.  Raises
        on an already sharded module.
        """
        if self.shard is not None:
            raise PipelineError(
                f"this {self._kind} already keeps shard {self.shard[0]} of {self.shard[1]} (rows "
                f"[{self.vocab_start}, {self.vocab_stop}) of {self.vocab_size}); call keep_shard once, "
                f"on the unsharded module"
            )
        bounds = shard_bounds(self.vocab_size, count)
        if isinstance(index, bool) or not 0 <= index < count:
            raise PipelineError(f"shard index {index} is outside [0, {count}) for {count} shards")
        start, stop = bounds[index]
        rows = self.weight.detach()[start:stop].clone()
        self.weight = nn.Parameter(rows, requires_grad=self.weight.requires_grad)
        self.vocab_start, self.vocab_stop = start, stop
        self.shard = (index, count)

    def share_shard(self, other: _VocabShard) -> None:
        """Hold ``other``'s shard (already kept) as this module's weight: the same Parameter, so a
        head tied to the embedding stays tied after both are sharded.  The sizes must match."""
        if other.shard is None or self.shard is not None:
            raise PipelineError("share_shard takes a sharded module and is called on an unsharded one")
        if (other.vocab_size, other.dim) != (self.vocab_size, self.dim):
            raise PipelineError(
                f"cannot tie a {self._kind} of {self.vocab_size}×{self.dim} to a {other._kind} of "
                f"{other.vocab_size}×{other.dim}"
            )
        self.weight = other.weight
        self.vocab_start, self.vocab_stop, self.shard = other.vocab_start, other.vocab_stop, other.shard

    def _require_unsharded(self) -> None:
        if (self.vocab_start, self.vocab_stop) != (0, self.vocab_size):
            raise PipelineError(
                f"forward of a sharded {self._kind} (rows [{self.vocab_start}, {self.vocab_stop}) of "
                f"{self.vocab_size}) cannot compute the whole layer; the pipeline runtime combines the "
                f"shards, or call forward before keep_shard"
            )

    def extra_repr(self) -> str:
        """The sizes and options, for ``repr``."""
        return f"vocab_size={self.vocab_size}, dim={self.dim}, rows=[{self.vocab_start}, {self.vocab_stop})"


class VocabParallelHead(_VocabShard):
    """Output projection + exact cross-entropy over the whole vocabulary, shardable by vocabulary rows.

    ``VocabParallelHead(dim, vocab)`` makes a new [vocab, dim] weight initialised like
    ``nn.Linear(dim, vocab, bias=False)``; ``VocabParallelHead(weight)`` uses a [vocab, dim] tensor (an
    ``nn.Parameter`` is kept as the same object, so a tied embedding stays tied until sharded; a plain
    tensor becomes a trainable Parameter sharing its storage).  ``softcap=c`` applies Gemma-2's
    final-logit soft-capping c·tanh(logit / c); ``ignore_index`` labels have no loss.
    """

    _kind = "head"

    def __init__(
        self,
        weight_or_dim: torch.Tensor | nn.Parameter | int,
        vocab: int | None = None,
        *,
        ignore_index: int = -100,
        softcap: float | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if isinstance(weight_or_dim, torch.Tensor):
            weight = _as_weight(weight_or_dim, "head", device, dtype)
            if vocab is not None and vocab != weight.shape[0]:
                raise PipelineError(
                    f"vocab={vocab} disagrees with the head weight's {weight.shape[0]} rows "
                    f"(shape {tuple(weight.shape)} is [vocab, dim]); pass vocab=None or the weight's rows"
                )
        else:
            dim = _check_size(weight_or_dim, "dim", "head")
            if vocab is None:
                raise PipelineError(f"VocabParallelHead({dim}) needs the vocabulary size: pass vocab")
            vocab = _check_size(vocab, "vocab", "head")
            weight = nn.Parameter(torch.empty(vocab, dim, device=device, dtype=dtype))
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))  # as nn.Linear.reset_parameters
        if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
            raise PipelineError(f"softcap must be a finite number > 0 or None; got {softcap!r}")
        super().__init__(weight)
        self.ignore_index = int(ignore_index)
        self.softcap = None if softcap is None else float(softcap)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, ignore_index: int = -100, softcap: float | None = None
    ) -> VocabParallelHead:
        """A head using ``linear.weight`` (the same Parameter); a linear layer with a bias is refused."""
        if linear.bias is not None:
            raise PipelineError(
                f"cannot make a vocabulary-parallel head from nn.Linear({linear.in_features}, "
                f"{linear.out_features}) with a bias: the head has none; build the Linear with bias=False"
            )
        return cls(linear.weight, ignore_index=ignore_index, softcap=softcap)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This shard's logits of ``hidden`` [..., dim], softcap applied: [..., rows] (with autograd)."""
        logits = F.linear(hidden, self.weight)
        if self.softcap is not None:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return logits

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Unsharded use only (raises if sharded): the mean cross-entropy of ``hidden`` [..., dim] against
        ``labels`` [...], as ``F.cross_entropy`` over the flattened logits with ``ignore_index``; without
        ``labels``, the logits [..., vocab].

        The plain model ``schedule="auto"`` weighs (:func:`~.runner.plain_model`) calls it for the logits:
        through ``forward`` the weight-gradient split defers the head's weight gradient to W, where a
        direct :meth:`logits` call would compute it in B."""
        self._require_unsharded()
        if labels is None:
            return self.logits(hidden)
        check_labels(labels, self.vocab_size, self.ignore_index)
        logits = self.logits(hidden)
        return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=self.ignore_index)

    def extra_repr(self) -> str:
        """The sizes and options, for ``repr``."""
        return f"{super().extra_repr()}, ignore_index={self.ignore_index}, softcap={self.softcap}"


class VocabParallelEmbedding(_VocabShard):
    """Token embedding shardable by vocabulary rows; each shard looks up its own tokens, zeros elsewhere.

    ``VocabParallelEmbedding(vocab, dim)`` makes a new weight initialised like ``nn.Embedding``;
    ``VocabParallelEmbedding(weight)`` uses a [vocab, dim] tensor (a Parameter kept as the same object).
    ``padding_idx`` is as for ``nn.Embedding`` (that row gets no gradient); ``scale`` multiplies the
    looked-up rows, and so their gradient (Gemma multiplies embeddings by sqrt(hidden size)).
    """

    _kind = "embedding"

    def __init__(
        self,
        vocab_or_weight: int | torch.Tensor | nn.Parameter,
        dim: int | None = None,
        *,
        padding_idx: int | None = None,
        scale: float | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        new = not isinstance(vocab_or_weight, torch.Tensor)
        if isinstance(vocab_or_weight, torch.Tensor):
            weight = _as_weight(vocab_or_weight, "embedding", device, dtype)
            if dim is not None and dim != weight.shape[1]:
                raise PipelineError(
                    f"dim={dim} disagrees with the embedding weight's {weight.shape[1]} columns "
                    f"(shape {tuple(weight.shape)} is [vocab, dim]); pass dim=None or the weight's columns"
                )
        else:
            vocab = _check_size(vocab_or_weight, "vocab", "embedding")
            if dim is None:
                raise PipelineError(f"VocabParallelEmbedding({vocab}) needs the embedding size: pass dim")
            dim = _check_size(dim, "dim", "embedding")
            weight = nn.Parameter(torch.empty(vocab, dim, device=device, dtype=dtype))
            nn.init.normal_(weight)  # as nn.Embedding.reset_parameters
        padding_idx = _padding_index(padding_idx, weight.shape[0])
        if new and padding_idx is not None:
            with torch.no_grad():
                weight[padding_idx].fill_(0)
        if scale is not None and not math.isfinite(scale):
            raise PipelineError(f"the embedding's scale must be a finite number or None; got {scale!r}")
        super().__init__(weight)
        self.padding_idx = padding_idx
        self.scale = None if scale is None else float(scale)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, *, scale: float | None = None) -> VocabParallelEmbedding:
        """An embedding using ``embedding.weight`` (the same Parameter) and its ``padding_idx``; refuses
        ``max_norm``, ``sparse`` and ``scale_grad_by_freq``, which a sharded lookup cannot reproduce."""
        refused = [
            f"{name}={value}"
            for name, value, default in (
                ("max_norm", embedding.max_norm, None),
                ("sparse", embedding.sparse, False),
                ("scale_grad_by_freq", embedding.scale_grad_by_freq, False),
            )
            if value != default
        ]
        if refused:
            raise PipelineError(
                f"cannot make a vocabulary-parallel embedding from nn.Embedding({embedding.num_embeddings}, "
                f"{embedding.embedding_dim}) with {', '.join(refused)}: not supported by the sharded "
                f"lookup; build the nn.Embedding without them"
            )
        return cls(embedding.weight, padding_idx=embedding.padding_idx, scale=scale)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Unsharded use only (raises if sharded): ``F.embedding(tokens, weight, padding_idx) * scale``."""
        self._require_unsharded()
        _check_ids(tokens, self.vocab_size, None, "token")
        rows = F.embedding(tokens, self.weight, self.padding_idx)
        return rows if self.scale is None else rows * self.scale

    def extra_repr(self) -> str:
        """The sizes and options, for ``repr``."""
        return f"{super().extra_repr()}, padding_idx={self.padding_idx}, scale={self.scale}"


def _padding_index(padding_idx: int | None, vocab: int) -> int | None:
    """``padding_idx`` as a row of the full vocabulary (a negative one counts from the end)."""
    if padding_idx is None:
        return None
    if isinstance(padding_idx, bool) or not -vocab <= padding_idx < vocab:
        raise PipelineError(f"padding_idx {padding_idx!r} is outside [-{vocab}, {vocab}) for {vocab} tokens")
    return padding_idx % vocab


def _check_ids(ids: torch.Tensor, vocab: int, ignore_index: int | None, what: str) -> None:
    """Raise if ``ids`` is not an integer tensor or holds a value outside [0, vocab) (other than ignore)."""
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise PipelineError(f"{what}s must be an integer tensor (torch.long); got dtype {ids.dtype}")
    bad = (ids < 0) | (ids >= vocab)
    if ignore_index is not None:
        bad &= ids != ignore_index
    if bool(bad.any()):
        where = torch.nonzero(bad)
        position = tuple(where[0].tolist())
        value = int(ids[position].item())
        allowed = "" if ignore_index is None else f", and is not ignore_index {ignore_index}"
        raise PipelineError(
            f"{what} {value} at position {list(position)} is outside the vocabulary of {vocab} tokens "
            f"[0, {vocab}){allowed} ({len(where)} such {what}s of {ids.numel()}); {what}s must be ids of "
            f"the full vocabulary"
        )


def check_labels(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Raise :class:`PipelineError` if ``labels`` is not an integer tensor, or if a label is outside
    [0, vocab) and is not ``ignore_index``; the message names the first bad value, its position and the
    vocabulary size."""
    _check_ids(labels, vocab, ignore_index, "label")


def check_tokens(tokens: torch.Tensor, vocab: int) -> None:
    """Raise :class:`PipelineError` if ``tokens`` is not an integer tensor, or if a token is outside
    [0, vocab); the message names the first bad value, its position and the vocabulary size."""
    _check_ids(tokens, vocab, None, "token")


class HeadPartials(NamedTuple):
    """What one shard of the head contributes to a batch of n tokens (:func:`head_partials`).

    ``stats`` [n, 3]: the local max m_i of the logits, the local sum of exp(logit − m_i) and the label's
    logit (0 where the label is not in this shard or is ignored); ``parts`` [n, 2·dim]: A_i (the
    exponentials times the softcap derivative, @ W_i) and L_i (W_i's row at the label times the softcap
    derivative there; 0 elsewhere); ``logits`` [n, rows]: the softcapped logits, for the weight gradient.
    """

    stats: torch.Tensor
    parts: torch.Tensor
    logits: torch.Tensor


class HeadTotals(NamedTuple):
    """The shards' statistics combined (:func:`head_totals`).

    ``max`` [n] and ``sum_exp`` [n] (of exp(logit − max)) are over the whole vocabulary; ``loss`` is the
    0-d mean cross-entropy over the non-ignored tokens (nan if there are none, as ``F.cross_entropy``);
    ``weight`` [n] is each token's factor in the gradient: 1/valid count, or 0 for an ignored token.
    """

    max: torch.Tensor
    sum_exp: torch.Tensor
    loss: torch.Tensor
    weight: torch.Tensor


def _check_head_inputs(head: VocabParallelHead, hidden: torch.Tensor, labels: torch.Tensor) -> None:
    if hidden.dim() != 2 or hidden.shape[1] != head.dim:
        raise PipelineError(
            f"the head's hidden states must be 2-D [n, {head.dim}] (flatten the batch dimensions); got "
            f"shape {tuple(hidden.shape)}"
        )
    if labels.shape != hidden.shape[:1]:
        raise PipelineError(
            f"the head's labels must have shape [{hidden.shape[0]}], one per hidden row; got "
            f"{tuple(labels.shape)}"
        )
    if hidden.dtype != head.weight.dtype:
        raise PipelineError(
            f"the hidden states are {hidden.dtype} but the head weight is {head.weight.dtype}; the head "
            f"computes in one dtype: convert one of them"
        )


def _label_columns(
    labels: torch.Tensor, start: int, stop: int, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inside, column)``: whether each label is a (non-ignored) row of [start, stop), and its column
    in the shard (0 where it is not, so that the column is always a valid index)."""
    labels = labels.long()
    inside = (labels >= start) & (labels < stop) & (labels != ignore_index)
    return inside, torch.where(inside, labels - start, 0)


@torch.no_grad()
def head_partials(
    head: VocabParallelHead, hidden: torch.Tensor, labels: torch.Tensor, *, checked: bool = False
) -> HeadPartials:
    """The 'S pass' of the one-barrier vocabulary-parallel head: all that this shard contributes.

    ``hidden`` [n, dim] (2-D, already flattened) and ``labels`` [n] of the FULL vocabulary (checked with
    :func:`check_labels` unless the caller did, ``checked``: the check reads the labels on the host);
    computed from this shard's rows only, without autograd.
    """
    _check_head_inputs(head, hidden, labels)
    if not checked:
        check_labels(labels, head.vocab_size, head.ignore_index)
    weight = head.weight.detach()
    logits = F.linear(hidden, weight)
    slope = None  # d softcapped / d logit, 1 − tanh²
    if head.softcap is not None:
        tanh = torch.tanh(logits / head.softcap)
        logits = head.softcap * tanh
        slope = 1 - tanh * tanh
    local_max = logits.amax(dim=1)
    exp = torch.exp(logits - local_max[:, None])
    inside, column = _label_columns(labels, head.vocab_start, head.vocab_stop, head.ignore_index)
    label_logit = torch.where(inside, logits.gather(1, column[:, None]).squeeze(1), 0)
    label_rows = weight[column]
    if slope is not None:
        label_rows = label_rows * slope.gather(1, column[:, None])
        exp_parts = (exp * slope) @ weight
    else:
        exp_parts = exp @ weight
    label_part = torch.where(inside[:, None], label_rows, 0)
    stats = torch.stack([local_max, exp.sum(dim=1), label_logit], dim=1)
    return HeadPartials(stats, torch.cat([exp_parts, label_part], dim=1), logits)


def _check_stats(stats: torch.Tensor, n: int) -> None:
    if stats.dim() != 3 or stats.shape[1:] != (n, 3):
        raise PipelineError(
            f"the gathered head stats must be [shards, {n}, 3] (every shard's HeadPartials.stats, "
            f"stacked); got shape {tuple(stats.shape)}"
        )


@torch.no_grad()
def head_totals(stats: torch.Tensor, labels: torch.Tensor, *, ignore_index: int) -> HeadTotals:
    """Combine every shard's statistics exactly: the loss and what the gradients need.

    ``stats`` [p, n, 3] is every shard's :attr:`HeadPartials.stats` (an all-gather); ``labels`` [n].  Each
    shard's sum is rescaled by exp(m_i − m) to the global max m.
    """
    if labels.dim() != 1:
        raise PipelineError(f"the head's labels must be 1-D [n]; got shape {tuple(labels.shape)}")
    _check_stats(stats, labels.shape[0])
    local_max, local_sum, label_logit = stats.unbind(dim=2)
    total_max = local_max.amax(dim=0)
    sum_exp = (local_sum * torch.exp(local_max - total_max)).sum(dim=0)
    valid = labels != ignore_index
    count = valid.sum()
    token_loss = torch.log(sum_exp) + total_max - label_logit.sum(dim=0)
    loss = torch.where(valid, token_loss, 0).sum() / count  # 0 / 0 = nan when every token is ignored
    weight = valid.to(stats.dtype) / count.clamp(min=1)
    return HeadTotals(total_max, sum_exp, loss, weight)


@torch.no_grad()
def head_input_grad(
    stats: torch.Tensor, parts: torch.Tensor, totals: HeadTotals, *, scale: float
) -> torch.Tensor:
    """The gradient of ``scale * loss`` with respect to the hidden states, [n, dim].

    ``stats`` [p, n, 3] and ``parts`` [p, n, 2·dim] gather every shard's partials: the gradient is
    (Σ_i exp(m_i − m)·A_i / sum_exp − Σ_i L_i) times ``totals.weight`` per token, times ``scale``.
    """
    n = totals.max.shape[0]
    _check_stats(stats, n)
    if parts.dim() != 3 or parts.shape[:2] != stats.shape[:2] or parts.shape[2] % 2:
        raise PipelineError(
            f"the gathered head parts must be [{stats.shape[0]}, {n}, 2·dim] like the stats "
            f"{tuple(stats.shape)}; got shape {tuple(parts.shape)}"
        )
    exp_parts, label_parts = parts.chunk(2, dim=2)
    rescale = torch.exp(stats[..., 0] - totals.max)
    grad = (rescale[..., None] * exp_parts).sum(dim=0) / totals.sum_exp[:, None] - label_parts.sum(dim=0)
    return grad * (totals.weight * scale)[:, None]


@torch.no_grad()
def head_weight_grad(
    head: VocabParallelHead,
    partials_logits: torch.Tensor,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    totals: HeadTotals,
    *,
    scale: float,
) -> torch.Tensor:
    """This shard's gradient of ``scale * loss`` with respect to ``head.weight``, [rows, dim].

    (softmax − onehot), times the softcap derivative and each token's weight, transposed @ ``hidden``;
    ``partials_logits`` is :attr:`HeadPartials.logits`.  The head's W: it can be deferred.
    """
    _check_head_inputs(head, hidden, labels)
    rows = head.vocab_stop - head.vocab_start
    if partials_logits.shape != (hidden.shape[0], rows):
        raise PipelineError(
            f"the saved logits must be [{hidden.shape[0]}, {rows}] (this shard's HeadPartials.logits); "
            f"got shape {tuple(partials_logits.shape)}"
        )
    grad = torch.exp(partials_logits - totals.max[:, None]) / totals.sum_exp[:, None]
    inside, column = _label_columns(labels, head.vocab_start, head.vocab_stop, head.ignore_index)
    grad.scatter_add_(1, column[:, None], -inside.to(grad.dtype)[:, None])
    if head.softcap is not None:
        tanh = partials_logits / head.softcap
        grad *= 1 - tanh * tanh
    grad *= (totals.weight * scale)[:, None]
    return grad.T @ hidden


def _embedding_rows(
    embedding: VocabParallelEmbedding, tokens: torch.Tensor, checked: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the tokens (unless ``checked``); ``(inside, row)``: whether each token is in this shard,
    and its row there (0 where it is not, so that the row is always a valid index)."""
    if not checked:
        check_tokens(tokens, embedding.vocab_size)
    tokens = tokens.long()
    inside = (tokens >= embedding.vocab_start) & (tokens < embedding.vocab_stop)
    return inside, torch.where(inside, tokens - embedding.vocab_start, 0)


@torch.no_grad()
def embedding_partial(
    embedding: VocabParallelEmbedding, tokens: torch.Tensor, *, checked: bool = False
) -> torch.Tensor:
    """This shard's contribution to the embedding of ``tokens`` (any shape), ``tokens.shape + (dim,)``.

    Its rows (times ``scale``) where the token is in [vocab_start, vocab_stop), zeros elsewhere: the sum
    over the shards is the full embedding.  Raises if a token is outside [0, vocab_size), unless the
    caller checked them (``checked``, :func:`check_tokens`).
    """
    inside, row = _embedding_rows(embedding, tokens, checked)
    rows = F.embedding(row, embedding.weight.detach())
    if embedding.scale is not None:
        rows = rows * embedding.scale
    return torch.where(inside[..., None], rows, 0)


@torch.no_grad()
def embedding_weight_grad(
    embedding: VocabParallelEmbedding, tokens: torch.Tensor, grad: torch.Tensor
) -> torch.Tensor:
    """This shard's weight gradient [rows, dim], given ``grad`` of the full embedding output
    (``tokens.shape + (dim,)``): ``grad * scale`` added into the rows of this shard's tokens; the
    ``padding_idx`` row gets none."""
    if grad.shape != (*tokens.shape, embedding.dim):
        raise PipelineError(
            f"the embedding output's gradient must have shape {(*tokens.shape, embedding.dim)} (the tokens' "
            f"shape + (dim,)); got {tuple(grad.shape)}"
        )
    inside, row = _embedding_rows(embedding, tokens)
    if embedding.padding_idx is not None:
        inside &= tokens != embedding.padding_idx
    if embedding.scale is not None:
        grad = grad * embedding.scale
    weight = embedding.weight
    total = torch.zeros(weight.shape, dtype=grad.dtype, device=weight.device)
    return total.index_add_(0, row[inside], grad[inside])
