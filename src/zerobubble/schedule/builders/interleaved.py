"""Interleaved 1F1B (Narayanan et al., 2021, Megatron-LM): v chunks per rank in loop placement.

Microbatches go through the chunks in groups of p: rank r first runs chunk 0 for microbatches 0..p−1,
then chunk 1 for the same group, and so on.  The warm-up is Megatron's, (p−r−1)·2 + (v−1)·p
forwards, after which forwards and fused backwards alternate.  The bubble shrinks to
(p−1)(T_F+T_B+T_W)/v at the price of p·M_B + (p−1)·M_B/v peak memory and v× the transfers.
"""

from __future__ import annotations

from ..costs import CostModel
from ..ir import BW, F, Op, Placement, Schedule, ScheduleError
from .one_f_one_b import rank_program as one_f_one_b_program


def _chunk_and_microbatch(index: int, stages: int, chunks: int, backward: bool) -> tuple[int, int]:
    group = index // stages
    chunk = group % chunks
    if backward:
        chunk = chunks - 1 - chunk
    microbatch = (index // (stages * chunks)) * stages + index % stages
    return chunk, microbatch


def rank_program(rank: int, stages: int, microbatches: int, chunks: int) -> list[Op]:
    """The interleaved program of one rank: Megatron's warm-up, steady 1F1B, cool-down."""
    total = microbatches * chunks
    warmup = min((stages - rank - 1) * 2 + (chunks - 1) * stages, total)

    def forward(index: int) -> Op:
        chunk, j = _chunk_and_microbatch(index, stages, chunks, backward=False)
        return F(chunk * stages + rank, j)

    def backward(index: int) -> Op:
        chunk, j = _chunk_and_microbatch(index, stages, chunks, backward=True)
        return BW(chunk * stages + rank, j)

    program = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        program += [forward(warmup + k), backward(k)]
    program += [backward(k) for k in range(total - warmup, total)]
    return program


def build(stages: int, microbatches: int, costs: CostModel, chunks: int = 2) -> Schedule:
    """Interleaved 1F1B; ``microbatches`` must be a multiple of ``stages`` when ``chunks > 1``."""
    if chunks == 1:
        programs = [one_f_one_b_program(rank, stages, microbatches) for rank in range(stages)]
    else:
        if microbatches % stages:
            raise ScheduleError(
                f"interleaved-1f1b needs the microbatch count to be a multiple of the stage count "
                f"(Megatron's grouping); got {microbatches} microbatches for {stages} stages — "
                f"use {((microbatches + stages - 1) // stages) * stages}, or chunks=1"
            )
        programs = [rank_program(rank, stages, microbatches, chunks) for rank in range(stages)]
    return Schedule("interleaved-1f1b", Placement.loop(stages, chunks), microbatches, programs)
