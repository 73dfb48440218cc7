"""The vocabulary ops' placement against the partition reference at the paper's published shapes,
and the deeper warm-up: valid and never slower than the schedule's own warm-up alone."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerobubble.schedule import CostModel, build_schedule, simulate, transformer_costs, validate_schedule
from zerobubble.schedule.vocab import (
    add_vocab_ops,
    default_policies,
    head_costs,
    partition_reference,
    refined_policies,
    work_bound,
)

#: (hidden, heads, layers, vocabulary, ranks), as ``zerobubble bench vocab --published`` has them.
PUBLISHED = {"Llama 3 8B": (4096, 32, 32, 128256, 8), "Qwen2.5 1.5B": (1536, 12, 28, 151936, 4)}


def published_costs(shape: str, seq: int = 4096) -> tuple[CostModel, int]:
    """Per-rank costs in ms at 400 TFLOP/s and 100 GB/s links, the head 1.6× its FLOPs."""
    hidden, heads, layers, vocab, ranks = PUBLISHED[shape]
    hop = seq * hidden * 2 / 1e8
    block = transformer_costs(
        hidden, heads, seq, 1, layers_per_stage=layers / ranks, flops_per_time_unit=4e11, comm=hop
    )
    head = head_costs(hidden=hidden, vocab=vocab, tokens=seq, shards=ranks, flops_per_time_unit=4e11)
    return block.replace(
        vocab_s=head.vocab_s * 1.6, vocab_t=head.vocab_t * 1.6, vocab_mem=head.vocab_mem, vocab_comm=3 * hop
    ), ranks


REACHED = [(shape, name) for shape in PUBLISHED for name in ("1f1b", "zb-h1", "zb-2p", "zb-v")]
"""Every published shape and schedule reaches 0.98 of its partition reference (docs/schedulers.md)."""


@pytest.mark.parametrize(("shape", "name"), REACHED)
def test_the_placement_reaches_its_partition_reference(shape, name):
    costs, p = published_costs(shape)
    schedule = build_schedule(name, p, 4 * p, costs, vocab_parallel=True)
    timeline = simulate(schedule, costs)
    ratio = partition_reference(name, p, 4 * p, costs) / timeline.iteration_time
    assert ratio >= 0.98, (shape, name, ratio)
    assert work_bound(name, p, 4 * p, costs) <= timeline.iteration_time  # a true lower bound
    assert all(
        peak <= limit * (1 + 1e-9) for peak, limit in zip(timeline.peak_memory, timeline.costs.memory_limit)
    )


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(["1f1b", "zb-h1", "zb-v"]),
    p=st.integers(2, 4),
    m=st.integers(2, 10),
    head=st.floats(0.05, 2.0),
    backward=st.floats(0.5, 2.0),
)
def test_the_deeper_warm_up_is_valid_and_never_slower(name, p, m, head, backward):
    costs = CostModel(f=1.0, b=backward, w=1.0, comm=0.05, vocab_s=head, vocab_t=head / 2, vocab_comm=0.1)
    base = build_schedule(name, p, m, costs)
    shallow = tuple(policy for policy in default_policies(m) if not policy.deeper)
    shallow += tuple(q for policy in shallow for q in refined_policies(policy))[:8]
    before = simulate(add_vocab_ops(base, costs, policies=shallow), costs).iteration_time
    now = add_vocab_ops(base, costs, policies=shallow + tuple(default_policies(m)))
    validate_schedule(now, costs)
    assert simulate(now, costs).iteration_time <= before * (1 + 0.002) + 1e-9
