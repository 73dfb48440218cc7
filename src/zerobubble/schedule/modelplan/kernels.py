"""A transformer block's time on one GPU from its sizes: the size-dependent efficiency model.

What :func:`~.cluster.transformer_profile` times a block with (``docs/auto-planning.md``, "A cluster
on paper"), instead of FLOPs at one fixed fraction of the peak:

* each matrix multiplication (:func:`gemm_seconds`) on a roofline: its FLOPs at ``efficiency × peak``
  scaled by the wave quantization of its output tiles over the GPU's multiprocessors, or the bytes
  it moves at the sustained memory bandwidth, whichever is longer, plus a launch latency — so the thin
  tensor-parallel slices of a small model and the head-sized products of attention run further
  from the peak than the large products of a large model;
* the element-wise work of a block (norms, activations, residual adds, dropout, rotary embedding,
  and without flash attention the softmax over the materialized scores): bytes moved at the
  sustained memory bandwidth (:func:`elementwise_bytes`);
* attention: materialized (``eager``: batched products of ``s × d`` by ``d × s``) or flash (its
  FLOPs, halved under the causal mask, at ``efficiency × peak``; its backward recomputes the scores).

``efficiency`` is the one free parameter: the fraction of the datasheet that the software stack
sustains, for the tensor cores (a large, well-shaped product) and the memory (every kernel's bytes,
:attr:`Device.sustained_bandwidth`) alike — the memory-bound share of a small model's time is what
makes its efficiency lower than a large one's.  Everything else is a size or a published hardware
figure.  Pure Python; no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TILE = (256, 128)
"""The output tile of one thread block of a large bf16/fp16 product (cuBLAS's A100 kernels)."""

GEMM_LATENCY = 5e-6
"""Seconds a kernel launch and its tail cost, whatever its size."""

K_OVERHEAD = 128
"""The inner-dimension length a tile's prologue and epilogue cost (filling the 4-stage pipeline of
32-deep slices of the operands, writing the output tile): a tile of depth ``k`` runs at
``k / (k + K_OVERHEAD)`` of its main loop's rate — attention's products of depth ``d = h/heads``
(64–160) run far below the peak, a model's weight products of depth ``h`` near it."""


@dataclass(frozen=True)
class Device:
    """What the model needs of one GPU: ``peak`` FLOP/s, memory ``bandwidth`` in bytes/s (both
    datasheet figures), its multiprocessor count ``sms`` and the fraction of the datasheet the
    kernels sustain (``efficiency``)."""

    peak: float
    bandwidth: float
    sms: int
    efficiency: float

    @property
    def sustained_bandwidth(self) -> float:
        """The bytes/s a kernel moves: the datasheet bandwidth at the same sustained fraction as the
        products' FLOP/s (``docs/auto-planning.md``, "A cluster on paper", why one fraction)."""
        return self.bandwidth * self.efficiency


def wave_efficiency(m: int, n: int, batch: int, sms: int) -> float:
    """The share of the multiprocessors that have work over the product's waves of output tiles
    (``tiles / (waves × sms)``), with the better of the tile's two orientations (a library picks its
    kernel by the shape)."""

    def share(rows: int, columns: int) -> float:
        tiles = batch * math.ceil(m / rows) * math.ceil(n / columns)
        return tiles / (math.ceil(tiles / sms) * sms)

    return max(share(*TILE), share(*TILE[::-1]))


def gemm_seconds(m: float, n: float, k: float, device: Device, batch: int = 1) -> float:
    """One product of an ``m × k`` by a ``k × n`` matrix (``batch`` of them in one kernel), 2-byte
    elements: the slower of its FLOPs (at the rate its waves and depth allow) and its bytes, plus
    :data:`GEMM_LATENCY`."""
    m, n, k = max(1, round(m)), max(1, round(n)), max(1, round(k))
    flops = 2.0 * batch * m * n * k
    rate = device.peak * device.efficiency * wave_efficiency(m, n, batch, device.sms) * k / (k + K_OVERHEAD)
    moved = 2.0 * batch * (m * k + k * n + m * n)
    return GEMM_LATENCY + max(flops / rate, moved / device.sustained_bandwidth)


def product_passes(m: float, n: float, k: float, device: Device) -> tuple[float, float, float]:
    """A linear layer ``[m, k] @ [k, n]``: its forward, input gradient ``[m, n] @ [n, k]`` and
    weight gradient ``[k, m] @ [m, n]``."""
    return (
        gemm_seconds(m, n, k, device),
        gemm_seconds(m, k, n, device),
        gemm_seconds(k, n, m, device),
    )


@dataclass(frozen=True)
class BlockShape:
    """One rank's share of a block at tensor parallelism ``tp`` for ``tokens`` (``sequences × seq_len``)."""

    tokens: int
    seq_len: int
    hidden: int
    kv_hidden: int
    intermediate: int
    heads: int
    gated: bool
    rotary: bool
    dropout: bool
    flash: bool
    tp: int


def block_seconds(block: BlockShape, device: Device) -> tuple[float, float, float]:
    """The forward, input-gradient and weight-gradient seconds of one block on one rank, its
    tensor-parallel collectives left out."""
    t, h, tp = block.tokens, block.hidden, block.tp
    matrices = [
        (t, (h + 2 * block.kv_hidden) / tp, h),  # q, k, v
        (t, h, h / tp),  # attention output
        (t, (2 if block.gated else 1) * block.intermediate / tp, h),  # up (and gate)
        (t, h, block.intermediate / tp),  # down
    ]
    passes = [product_passes(m, n, k, device) for m, n, k in matrices]
    forward, backward_input, backward_weight = (math.fsum(p[i] for p in passes) for i in range(3))
    attention = attention_seconds(block, device)
    moved = [size / device.sustained_bandwidth for size in elementwise_bytes(block)]
    return forward + attention[0] + moved[0], backward_input + attention[1] + moved[1], backward_weight


def attention_seconds(block: BlockShape, device: Device) -> tuple[float, float]:
    """Scores and their mix with the values, forward and backward, for one rank's heads."""
    sequences, s = block.tokens // block.seq_len, block.seq_len
    heads = block.heads // block.tp
    d = block.hidden // block.heads
    if block.flash:
        # causal: the blocks above the diagonal are skipped; the backward recomputes the scores
        flops = 4.0 * sequences * heads * s * s * d / 2
        rate = device.peak * device.efficiency
        return GEMM_LATENCY + flops / rate, GEMM_LATENCY + 2.5 * flops / rate
    batch = sequences * heads
    scores = gemm_seconds(s, s, d, device, batch)  # q @ kᵀ
    mix = gemm_seconds(s, d, s, device, batch)  # p @ v
    backward = gemm_seconds(s, d, s, device, batch) + gemm_seconds(s, d, s, device, batch)  # dq, dk
    backward += gemm_seconds(s, s, d, device, batch) + gemm_seconds(d, s, s, device, batch)  # dp, dv
    return scores + mix, backward


def elementwise_bytes(block: BlockShape) -> tuple[float, float]:
    """Bytes the element-wise kernels of the forward and of the backward move (2-byte elements, 1-byte
    dropout masks; each kernel fused as Megatron's are: it reads its inputs once, writes its output once).

    Per token, forward (backward): two norms, read and write ``h`` — 4h each (read the input and the
    gradient, write the gradient: 6h); two residual adds, read two, write one — 6h (the gradient
    passes through: 0), with dropout 7h, its mask written (5h: read the gradient and the mask, write
    one); the activation over ``f/tp`` (GeLU: 4, backward 6; gated SiLU·up: 6, backward 10 bytes an
    element); rotary embedding of q and k (4, backward 4); without flash attention, over ``heads/tp × s``
    scores a token, the scaled, masked softmax (4, backward 6) and its dropout (5, backward 5).
    """
    t, h, tp, f = block.tokens, block.hidden, block.tp, block.intermediate
    add = (7, 5) if block.dropout else (6, 0)
    activation = (6, 10) if block.gated else (4, 6)
    scores = block.heads / tp * block.seq_len
    attention = ((9, 11) if block.dropout else (4, 6)) if not block.flash else (0, 0)
    rotary = 4 * (h + block.kv_hidden) / tp if block.rotary else 0.0
    forward = 2 * 4 * h + 2 * add[0] * h + activation[0] * f / tp + rotary + attention[0] * scores
    backward = 2 * 6 * h + 2 * add[1] * h + activation[1] * f / tp + rotary + attention[1] * scores
    return t * forward, t * backward


def head_seconds(tokens: int, hidden: int, vocab: int, tp: int, device: Device) -> tuple[float, float, float]:
    """The output layer ``[tokens, h] @ [h, vocab/tp]`` and its cross-entropy (softmax over the
    logits in fp32: read 2, write 4, read 4 bytes a logit forward; twice that backward)."""
    forward, backward_input, backward_weight = product_passes(tokens, vocab / tp, hidden, device)
    loss = 10.0 * tokens * vocab / tp / device.sustained_bandwidth
    return forward + loss, backward_input + 2 * loss, backward_weight
