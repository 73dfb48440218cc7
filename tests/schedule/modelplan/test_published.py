"""The cluster planner against published runs, and the FSDP-unit memory model's properties.

Every prediction is computed here by the code from the shipped runs file (model sizes, layouts,
published figures): torchtitan's Llama 3 70B on 64 A100 (FSDP, pp 1, full recomputation) fits 80 GiB
with per-layer units resharded after the forward and lands within ±15 % of its tokens/s; every row
of Narayanan et al.'s Table 1 lands within 10 % of its teraFLOP/s from one efficiency calibrated on
one row — the documented one, and whichever row it is (the spread over anchors docs/auto-planning.md
states).  The memory model of FSDP units is checked on generated layers (hypothesis).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerobubble.schedule.grid import Grid
from zerobubble.schedule.modelplan import LayerProfile
from zerobubble.schedule.modelplan.cluster import (
    CALIBRATED_EFFICIENCY,
    ClusterSearch,
    TransformerShape,
    plan_cluster,
)
from zerobubble.schedule.modelplan.published import (
    anchor_spreads,
    calibrate,
    load_runs,
    predict,
    predict_all,
    run_cluster,
    run_grid,
)
from zerobubble.schedule.modelplan.sharding import exposed_seconds
from zerobubble.schedule.sharding import ONCE_PER_STEP, FSDPOptions

DATA = load_runs()
FAST = ClusterSearch(refine=0)
OWN = ClusterSearch(refine=0, choose_sharding=False)
RUNS = {run["name"]: run for run in DATA["runs"]}


@pytest.fixture(scope="module")
def predictions():
    efficiency, found = predict_all(DATA)
    return efficiency, {p.run["name"]: p for p in found}


def test_the_calibrated_efficiency_is_the_clusters_default(predictions):
    efficiency, by_name = predictions
    assert math.isclose(efficiency, CALIBRATED_EFFICIENCY, abs_tol=5e-4)
    assert math.isclose(by_name[DATA["calibrate_on"]].ratio, 1.0, abs_tol=2e-3)


def test_every_megatron_table1_row_is_predicted_within_ten_percent(predictions):
    _, by_name = predictions
    rows = [p for name, p in by_name.items() if name.startswith("Megatron-LM")]
    assert len(rows) == 10
    off = {p.run["name"]: round(p.ratio, 3) for p in rows if not 0.9 <= p.ratio <= 1.1}
    assert not off, off


ANCHOR_BAND = (0.9, 1.1)
"""Where docs/auto-planning.md § 8 says every Table 1 row lands whichever row is the anchor."""


def _within(ratio: float, band: tuple[float, float] = ANCHOR_BAND) -> bool:
    return band[0] <= ratio <= band[1]


def test_every_row_stays_within_ten_percent_at_the_extreme_anchors(predictions):
    # Each ratio grows with the efficiency, so the efficiencies of all anchors lie between those of
    # the rows predicted lowest and highest; at those two, every row stays in the band (and the
    # 70B run within 15 %), hence at any anchor.  The exhaustive check is the slow test below.
    _, by_name = predictions
    rows = [p for p in by_name.values() if p.run["metric"] == "megatron_tflops"]
    lowest, highest = min(rows, key=lambda p: p.ratio), max(rows, key=lambda p: p.ratio)
    for anchor in (lowest.run, highest.run):
        efficiency, found = predict_all(DATA, calibrate(anchor, DATA["cluster"]))
        off = {p.run["name"]: round(p.ratio, 3) for p in found[:10] if not _within(p.ratio)}
        assert not off, (anchor["name"], efficiency, off)
        llama = next(p for p in found if p.run["name"] == "torchtitan Llama 3 70B")
        assert _within(llama.ratio, (0.85, 1.15)) and llama.option.memory <= 80 * 2**30


@pytest.mark.slow
def test_every_anchor_keeps_every_row_within_ten_percent_and_70b_within_fifteen():
    spreads = anchor_spreads(DATA)
    assert len(spreads) == 10
    for spread in spreads:
        assert _within(spread.low.ratio) and _within(spread.high.ratio), spread.anchor
        llama = next(p for p in spread.predictions if p.run["name"] == "torchtitan Llama 3 70B")
        assert _within(llama.ratio, (0.85, 1.15)) and llama.option.memory <= 80 * 2**30, spread.anchor


def test_torchtitan_llama3_70b_fits_with_per_layer_units_and_its_throughput_is_within_15_percent():
    run = RUNS["torchtitan Llama 3 70B"]
    shape = TransformerShape.from_config(run["model"])
    cluster = run_cluster(run, DATA["cluster"], CALIBRATED_EFFICIENCY)
    grid = Grid(dp=64, sharding="fsdp", pp=1)  # the published layout; the planner chooses the sharding
    (option,) = plan_cluster(shape, cluster, 524288, 8192, recompute=True, layouts=[grid], search=FAST)
    assert option.plan is not None and option.memory <= 80 * 2**30
    assert option.data_parallel.startswith("FSDP per-layer units, reshard after forward")
    assert 0.85 <= option.tokens_per_second / run["published"] <= 1.15
    # the chooser's reason: the choice, its step and peak against the GPU's memory, the candidates
    # tied with it and the rule that kept it, the runner-up
    assert option.reason.startswith(option.data_parallel + ": step ")
    assert (
        "GiB of 80.00 GiB" in option.reason and "; next " in option.reason and "+0.000 s" not in option.reason
    )
    runtime = replace(run_grid(run), comm=ONCE_PER_STEP)
    own = plan_cluster(shape, cluster, 524288, 8192, recompute=True, layouts=[runtime], search=OWN)
    assert own[0].plan is not None and own[0].memory > 80 * 2**30


def test_the_published_layouts_sharding_is_predicted_as_published():
    run = RUNS["torchtitan Llama 3 70B"]
    found = predict(run, DATA["cluster"], CALIBRATED_EFFICIENCY)
    assert found.option.data_parallel == run_grid(run).comm.describe(run_grid(run).dp_mode)


# -- the memory model of FSDP units ------------------------------------------------------------------

layer_values = st.builds(
    LayerProfile,
    name=st.just("layer"),
    forward=st.floats(1e-4, 1.0),
    backward_input=st.floats(1e-4, 1.0),
    backward_weight=st.floats(0.0, 1.0),
    parameter_bytes=st.floats(0.0, 1e9),
    gradient_bytes=st.floats(0.0, 1e9),
    optimizer_bytes=st.floats(0.0, 2e9),
)
layer_lists = st.lists(layer_values, min_size=1, max_size=12)
grids = st.builds(
    Grid,
    dp=st.sampled_from([2, 4, 8]),
    tp=st.sampled_from([1, 2]),
    sharding=st.just("fsdp"),
    comm=st.builds(
        FSDPOptions,
        prefetch=st.integers(0, 3),
        reshard_after_forward=st.booleans(),
        reshard_after_backward=st.just(True),
    ),
)


def with_units(grid: Grid, units: str | int, **choices) -> Grid:
    """``grid`` with its record's units (and other fields) changed."""
    return replace(grid, comm=replace(grid.comm, units=units, **choices))


@settings(max_examples=80, deadline=None)
@given(layers=layer_lists, grid=grids, size=st.sampled_from([1, 2, 3]))
def test_per_layer_units_never_hold_more_than_per_chunk(layers, grid, size):
    per_layer = with_units(grid, "layer").held_bytes(layers)
    grouped = with_units(grid, size).held_bytes(layers)
    per_chunk = with_units(grid, "chunk").held_bytes(layers)
    assert per_layer <= grouped * (1 + 1e-12) + 1e-6
    assert grouped <= per_chunk * (1 + 1e-12) + 1e-6


@settings(max_examples=80, deadline=None)
@given(layers=layer_lists, grid=grids, size=st.sampled_from([1, 2, "chunk"]))
def test_more_prefetch_never_holds_less_and_resharding_never_more(layers, grid, size):
    unit = with_units(grid, size)
    deeper = with_units(unit, size, prefetch=unit.comm.prefetch + 1)
    assert deeper.held_bytes(layers) >= unit.held_bytes(layers) * (1 - 1e-12) - 1e-6
    resharded = with_units(unit, size, reshard_after_forward=True).held_bytes(layers)
    kept = with_units(unit, size, reshard_after_forward=False).held_bytes(layers)
    assert resharded <= kept * (1 + 1e-12) + 1e-6


@settings(max_examples=80, deadline=None)
@given(
    compute=st.lists(st.floats(1e-3, 1.0), min_size=1, max_size=10),
    gather=st.floats(0.0, 1.0),
    depth=st.integers(0, 3),
)
def test_collectives_hide_behind_compute_only_when_prefetched(compute, gather, depth):
    before, after = [gather] * len(compute), [0.0] * len(compute)
    exposed = exposed_seconds(compute, before, after, depth)
    assert exposed >= gather * (1 - 1e-12) - 1e-12  # the first gather is never hidden
    assert exposed <= gather * len(compute) * (1 + 1e-12) + 1e-12  # at worst every gather waits
    if depth == 0:
        assert math.isclose(exposed, gather * len(compute), rel_tol=1e-9, abs_tol=1e-12)
    deeper = exposed_seconds(compute, before, after, depth + 1)
    assert deeper <= exposed * (1 + 1e-9) + 1e-12
