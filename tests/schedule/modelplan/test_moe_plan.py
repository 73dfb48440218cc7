"""The planner's mixture-of-experts path (schedule/modelplan/moe.py): sizes against published counts
and a hand formula, the all-to-all as CostModel.a2a, dualpipe-v chosen when it hides the all-to-all
and not otherwise, ep sizes under the memory budget, the reason text and the CLI."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerobubble.cli import main
from zerobubble.schedule import ScheduleError
from zerobubble.schedule.modelplan import LayerProfile, ModelProfile, plan, stage_costs
from zerobubble.schedule.modelplan.cluster import Cluster, ClusterSearch, cluster_grids
from zerobubble.schedule.modelplan.moe import (
    PRESETS,
    MoERank,
    MoEShape,
    all_to_all_seconds,
    ep_sizes,
    hidden_share,
    moe_profile,
    moe_reason,
    moe_shape,
    plan_moe_cluster,
)
from zerobubble.schedule.modelplan.search import default_schedules

CLUSTER = Cluster(nodes=2, gpus=8, intra=300e9, inter=25e9)


@pytest.mark.parametrize(
    ("name", "total", "active"),
    [("mixtral-8x7b", 46.7e9, 12.9e9), ("deepseek-v3-like", 671e9, 37e9)],
)
def test_parameters_match_the_published_counts(name, total, active):
    shape = MoEShape.from_config(PRESETS[name])
    assert shape.parameters == pytest.approx(total, rel=0.02)
    assert shape.active_parameters == pytest.approx(active, rel=0.03)


def _shape(h: int, f: int, e: int, k: int, s: int, layers: int, dense: int) -> MoEShape:
    return MoEShape(
        layers=layers, hidden=64 * h, intermediate=4 * 64 * h, heads=h, kv_heads=h, vocab=1000,
        gated=True, experts=e, top_k=min(k, e), shared_experts=s, expert_intermediate=32 * f,
        dense_layers=min(dense, layers - 1),
    )  # fmt: skip


shapes = st.builds(
    _shape,
    st.integers(1, 8),
    st.integers(1, 64),
    st.integers(1, 64),
    st.integers(1, 8),
    st.integers(0, 2),
    st.integers(1, 12),
    st.integers(0, 4),
)


@settings(max_examples=40, deadline=None)
@given(shapes)
def test_parameters_and_flops_follow_the_hand_formula(shape):
    h, f, e, k, s = shape.hidden, shape.expert_intermediate, shape.experts, shape.top_k, shape.shared_experts
    attention = 4 * h * h + 2 * h  # q, k, v, o (as many kv heads as heads) and two norms
    expert = 3 * h * f
    dense = attention + 3 * h * shape.intermediate
    moe_layers = shape.layers - shape.dense_layers
    embeddings = 2 * shape.vocab * h
    total = shape.dense_layers * dense + moe_layers * (attention + h * e + (e + s) * expert) + embeddings
    active = shape.dense_layers * dense + moe_layers * (attention + h * e + (k + s) * expert) + embeddings
    assert shape.parameters == total and shape.active_parameters == active
    assert shape.flops_per_token(128) == 6 * active + 12 * shape.layers * h * 128


@settings(max_examples=20, deadline=None)
@given(shapes, st.sampled_from([1, 2, 4, 8]), st.booleans())
def test_a_rank_holds_its_share_of_the_experts(shape, ep, sharded):
    if shape.experts % ep:
        with pytest.raises(ScheduleError, match="does not divide"):
            moe_profile(shape, CLUSTER, 128, 1, False, MoERank(ep=ep))
        return
    profile = moe_profile(shape, CLUSTER, 128, 1, False, MoERank(ep=ep, sharded=sharded))
    block = profile.layers[-2] if shape.moe_layers > 1 else profile.layers[-1]
    routed = shape.experts * shape.expert_parameters
    if block.name == "moe-block":
        own = shape.moe_block_parameters() - routed + routed // ep
        assert block.parameter_bytes == 2 * own
        # sharded: FSDP shards the experts over dp/ep, so the shards add up to every expert's bytes
        assert block.static_bytes == 16 * (shape.moe_block_parameters() if sharded else own)
    moe_blocks = [layer for layer in profile.layers if "moe-block" in layer.name]
    assert len(moe_blocks) == shape.moe_layers
    assert all((layer.all_to_all > 0) == (ep > 1) for layer in moe_blocks)


def test_the_all_to_all_is_dispatch_plus_combine_of_top_k_tokens():
    one_node = all_to_all_seconds(4096, 4096, 2, 8, CLUSTER)
    volume = 2 * 4096 * 2 * 4096 * 7 / 8  # bf16, top-2, 7/8 of it leaves the rank
    assert one_node == pytest.approx(2 * (CLUSTER.latency + volume / CLUSTER.intra))
    assert all_to_all_seconds(4096, 4096, 2, 1, CLUSTER) == 0.0
    assert all_to_all_seconds(4096, 4096, 4, 8, CLUSTER) > one_node
    assert all_to_all_seconds(4096, 4096, 2, 16, CLUSTER) > 5 * one_node  # half of it between nodes


def moe_layers(ranks: int, ratio: float) -> ModelProfile:
    layer = LayerProfile(
        "moe", 1e-3, 1e-3, 1e-3, activation_bytes=1e6, weight_input_bytes=5e5, all_to_all=ratio * 1e-3
    )
    return ModelProfile((layer,) * (4 * ranks))


def test_the_all_to_all_reaches_the_cost_model():
    costs = stage_costs(moe_layers(2, 0.5), (2, 4, 6), 4)
    assert tuple(costs.a2a) == (1e-3,) * 4
    assert stage_costs(moe_layers(2, 0.0), (2, 4, 6), 4).a2a == 0.0  # dense: as before
    assert "dualpipe-v" in default_schedules(moe_layers(2, 0.5))
    assert "dualpipe-v" not in default_schedules(moe_layers(2, 0.0))


@settings(max_examples=8, deadline=None)
@given(st.sampled_from([2, 4]), st.integers(2, 4), st.floats(0.7, 1.5))
def test_dualpipe_v_wins_when_the_all_to_all_is_as_long_as_the_compute(ranks, per_rank, ratio):
    microbatches = per_rank * ranks
    names = ["1f1b", "zb-h1", "zb-v", "dualpipe-v"]
    chosen = plan(moe_layers(ranks, ratio), ranks, microbatches, schedules=names)
    assert chosen.winner.schedule == "dualpipe-v"
    zb_v = next(c for c in chosen.candidates if c.schedule == "zb-v")
    assert zb_v.period > chosen.winner.period and hidden_share(zb_v) == 0.0
    assert 0.0 < hidden_share(chosen.winner) <= 1.0
    assert f"dualpipe-v hides {hidden_share(chosen.winner):.2f}" in moe_reason(chosen)
    without = plan(moe_layers(ranks, 0.0), ranks, microbatches, schedules=names)
    assert without.winner.schedule != "dualpipe-v"
    assert "no all-to-all" in moe_reason(without)


def test_dualpipe_v_is_weighed_with_a_vocabulary_parallel_head():
    """With the all-to-all as long as the compute, dualpipe-v with the head vocabulary-parallel is
    planned (its S and T around the pairs) and wins over zb-v, the reason saying why."""
    chosen = plan(moe_layers(2, 1.0), 2, 8, head="vocab-parallel", schedules=["zb-v", "dualpipe-v"])
    dualpipe = next(c for c in chosen.candidates if c.schedule == "dualpipe-v")
    assert dualpipe.period is not None and dualpipe.vocab_parallel
    assert chosen.winner is dualpipe and "dualpipe-v hides" in chosen.reason, chosen.reason


SMALL = MoEShape(
    layers=8, hidden=2048, intermediate=8192, heads=16, kv_heads=16, vocab=32000, gated=True,
    experts=16, top_k=2, expert_intermediate=4096,
)  # fmt: skip


def test_ep_sizes_divide_the_experts_and_the_replicas():
    grid = next(g for g in cluster_grids(SMALL, CLUSTER) if g.dp == 16)
    assert ep_sizes(SMALL, grid) == [1, 2, 4, 8, 16]
    assert ep_sizes(MoEShape.from_config(PRESETS["mixtral-8x7b"]), grid) == [1, 2, 4, 8]


def test_the_ep_chosen_fits_the_memory_budget():
    """Replicated, the experts fill a GPU unless ep divides them: only large ep sizes fit."""
    budget = 12 * 2**30
    cluster = Cluster(nodes=1, gpus=8, intra=300e9, inter=25e9, memory=budget)
    grids = [g for g in cluster_grids(SMALL, cluster, sharding=None) if g.pp == 1 and g.tp == 1]
    search = ClusterSearch(("1f1b",), refine=0)
    options = plan_moe_cluster(SMALL, cluster, 8 * 2048, 2048, layouts=grids, search=search)
    fitting = [o for o in options if o.plan is not None]
    assert fitting and all(o.memory <= budget for o in fitting)
    assert {o.ep for o in options if o.plan is None} >= {1}
    assert all(o.ep > 1 for o in fitting)
    assert options[0].plan is not None and options[0].row()["ep"] == options[0].ep


def test_moe_shape_from_the_command_line_values():
    dense = {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "vocab_size": 1000}
    assert moe_shape(dense) is None
    shape = moe_shape(dense, experts=8, top_k=2, shared=1, dense_layers=1, ffn=256)
    assert shape is not None
    assert (shape.experts, shape.top_k, shape.shared_experts, shape.dense_layers) == (8, 2, 1, 1)
    assert shape.expert_intermediate == 256
    mixtral = moe_shape(PRESETS["mixtral-8x7b"], top_k=1)
    assert mixtral is not None and mixtral.top_k == 1 and mixtral.experts == 8
    with pytest.raises(ScheduleError, match="top-k"):
        moe_shape(dense, experts=2, top_k=3)


def test_plan_cluster_of_a_moe_on_the_command_line(capsys, tmp_path):
    config = tmp_path / "config.json"
    sizes = {"hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8, "vocab_size": 8000}
    config.write_text(json.dumps(sizes))
    argv = [
        "plan", "--cluster", "nodes=1,gpus=4,intra=300GB/s,inter=25GB/s", "--model", str(config),
        "--tokens-per-step", str(16 * 1024), "--seq-len", "1024", "--moe-experts", "8", "--moe-top-k", "2",
        "--schedules", "1f1b,zb-v,dualpipe-v",
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "active: top-2 of 8 experts" in out and "   ep  " in out and "experts: expert all-to-all" in out
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    assert {row["ep"] for row in rows} == {1, 2, 4}


def test_plan_of_a_profile_with_all_to_all_says_what_dualpipe_v_hides(capsys, tmp_path):
    path = tmp_path / "moe.json"
    moe_layers(2, 1.0).save(path)
    assert main(["plan", "--profile", str(path), "--ranks", "2", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "* dualpipe-v" in out and "dualpipe-v hides" in out
    assert "experts: expert all-to-all 2.000 ms" in out
