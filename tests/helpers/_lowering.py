"""Hypothesis strategies shared by the lowering tests: registry schedules, with or without the
output layer's ops, and lowering options."""

from __future__ import annotations

from hypothesis import strategies as st

from zerobubble.schedule import REGISTRY, CostModel, Schedule, ScheduleError, build_schedule
from zerobubble.schedule.compare import SLOW_SCHEDULES
from zerobubble.schedule.grid import Grid
from zerobubble.schedule.lowering import StageBytes
from zerobubble.schedule.sharding import ONCE_PER_STEP, FSDPOptions
from zerobubble.schedule.vocab import add_vocab_ops

FAST = [name for name in REGISTRY if name not in SLOW_SCHEDULES]


@st.composite
def built(draw: st.DrawFn, *, comm: bool = True) -> tuple[Schedule, CostModel]:
    """A registry schedule of 1–4 ranks and 1–8 microbatches (a third with S and T ops) and its costs."""
    name = draw(st.sampled_from(FAST))
    p, m = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    hop = draw(st.floats(0.0, 0.3)) if comm else 0.0
    costs = CostModel(
        f=draw(st.floats(0.5, 2.0)),
        b=draw(st.floats(0.5, 2.0)),
        w=draw(st.floats(0.2, 1.0)),
        comm=hop,
        mem_w=0.3,
        vocab_s=0.4,
        vocab_t=0.3,
        vocab_comm=hop / 2,
        vocab_mem=0.2,
    )
    chunks = 2 if REGISTRY[name].chunks is None else None
    try:
        schedule = build_schedule(name, p, m, costs, chunks=chunks)
    except ScheduleError:  # interleaving needs m a multiple of p
        schedule = build_schedule("1f1b", p, m, costs)
    if draw(st.integers(0, 2)) == 0:
        schedule = add_vocab_ops(schedule, costs)
    return schedule, costs


@st.composite
def fsdp_options(draw: st.DrawFn) -> FSDPOptions:
    """Any FSDP lowering."""
    return FSDPOptions(
        units=draw(st.sampled_from(["chunk", "layer", 1, 2, 3])),
        reshard_after_forward=draw(st.booleans()),
        reshard_after_backward=draw(st.booleans()),
        prefetch=draw(st.integers(0, 3)),
    )


@st.composite
def any_options(draw: st.DrawFn) -> tuple[FSDPOptions, Grid]:
    """Options with their grid: no data parallelism, replicate (some bucket size) or FSDP/HSDP."""
    kind = draw(st.sampled_from(["none", "replicate", "fsdp"]))
    if kind == "none":
        return ONCE_PER_STEP, Grid()
    if kind == "replicate":
        return FSDPOptions(bucket_bytes=draw(st.sampled_from([0.0, 1.0, 2.5]))), Grid(dp=2)
    shard = draw(st.sampled_from([2, 4]))
    grid = Grid(dp=4, sharding="fsdp") if shard == 4 else Grid(dp=4, sharding="hsdp", dp_shard=2)
    return draw(fsdp_options()), grid


def stage_bytes(schedule: Schedule, layers: int = 4) -> StageBytes:
    """``layers`` layers of one byte per stage (the last a little heavier)."""
    return StageBytes(tuple((1.0,) * (layers - 1) + (1.5,) for _ in range(schedule.num_stages)))
