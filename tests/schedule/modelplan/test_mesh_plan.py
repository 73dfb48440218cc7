"""The planner on a mesh: each stage on dp × tp ranks (``MeshLayout``).

The layout's arithmetic is checked against its definition on generated layers (hypothesis), and the
plan against the budget: one that fits only sharded is planned sharded, one that fits nothing is
refused with the numbers.
"""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerobubble.schedule import ScheduleError
from zerobubble.schedule.modelplan import LayerProfile, Link, MeshLayout, ModelProfile, parse_mesh, plan
from zerobubble.schedule.modelplan.cluster import Cluster, TransformerShape, plan_cluster
from zerobubble.schedule.modelplan.cluster_text import best_layout_text

MIB = 2**20


def _layers(count: int = 8, params: float = 4e6) -> tuple[LayerProfile, ...]:
    sizes = {"activation_bytes": 1e6, "weight_input_bytes": 5e5, "output_bytes": 1e5}
    state = {"parameter_bytes": params, "gradient_bytes": params, "optimizer_bytes": 2 * params}
    return tuple(LayerProfile(f"block{i}", 1e-3, 1e-3, 1e-3, **sizes, **state) for i in range(count))


PROFILE = ModelProfile(_layers(), comm_latency=1e-5, comm_bandwidth=1e10)
LINK = Link(latency=1e-5, bandwidth=1e10)

layer_values = st.builds(
    LayerProfile,
    name=st.just("layer"),
    forward=st.floats(1e-5, 1.0),
    backward_input=st.floats(1e-5, 1.0),
    backward_weight=st.floats(0.0, 1.0),
    activation_bytes=st.floats(0.0, 1e9),
    weight_input_bytes=st.floats(0.0, 1e9),
    parameter_bytes=st.floats(0.0, 1e9),
    gradient_bytes=st.floats(0.0, 1e9),
    optimizer_bytes=st.floats(0.0, 2e9),
    output_bytes=st.floats(0.0, 1e8),
)


@settings(max_examples=60, deadline=None)
@given(layer=layer_values, tp=st.sampled_from([1, 2, 4, 8]), dp=st.sampled_from([2, 4, 8]))
def test_sharding_divides_the_bytes_as_the_runtime_holds_them(layer, tp, dp):
    replicated = MeshLayout(dp=dp, tp=tp)
    fsdp = MeshLayout(dp=dp, tp=tp, sharding="fsdp")
    p, g, o = (value / tp for value in (layer.parameter_bytes, layer.gradient_bytes, layer.optimizer_bytes))
    assert math.isclose(replicated.static_bytes(layer), p + g + o, rel_tol=1e-12, abs_tol=1e-6)
    # in the step: whole parameters and their shards, whole gradients, sharded optimizer state
    assert math.isclose(fsdp.static_bytes(layer), p + p / dp + g + o / dp, rel_tol=1e-12, abs_tol=1e-6)
    assert math.isclose(
        fsdp.resident_bytes(layer), layer.static_bytes / (dp * tp), rel_tol=1e-12, abs_tol=1e-6
    )
    if dp > 2:  # HSDP over rows of 2: the shards of a row, copied across the rows
        hsdp = MeshLayout(dp=dp, tp=tp, sharding="hsdp", dp_shard=2)
        assert math.isclose(hsdp.static_bytes(layer), p + p / 2 + g + o / 2, rel_tol=1e-12, abs_tol=1e-6)


@settings(max_examples=60, deadline=None)
@given(layer=layer_values, tp=st.sampled_from([2, 4, 8]))
def test_tensor_parallelism_divides_compute_and_adds_its_all_reduces(layer, tp):
    layout = MeshLayout(tp=tp, tp_link=LINK)
    (mine,) = layout.per_rank(ModelProfile((layer,))).layers
    reduce = 2 * LINK.time(2 * (tp - 1) / tp * layer.output_bytes)
    assert math.isclose(mine.forward, layer.forward / tp + reduce, rel_tol=1e-12)
    assert math.isclose(mine.backward_input, layer.backward_input / tp + reduce, rel_tol=1e-12)
    assert math.isclose(mine.backward_weight, layer.backward_weight / tp, rel_tol=1e-12, abs_tol=1e-300)
    kept = 1 - 24 / 34 + 24 / 34 / tp
    assert math.isclose(mine.activation_bytes, layer.activation_bytes * kept, rel_tol=1e-12, abs_tol=1e-6)
    assert mine.output_bytes == layer.output_bytes  # each tp rank's pipeline sends the whole activation


def test_the_step_collectives_follow_the_ring_volumes():
    layers = _layers(2)
    params = grads = 8e6
    fsdp = MeshLayout(dp=4, sharding="fsdp", dp_link=LINK)
    expected = LINK.time(3 / 4 * params) + LINK.time(3 / 4 * grads)
    assert math.isclose(fsdp.step_seconds(layers), expected, rel_tol=1e-12)
    hsdp = MeshLayout(dp=4, sharding="hsdp", dp_shard=2, dp_link=LINK)
    expected = LINK.time(params / 2) + LINK.time(grads / 2) + LINK.time(2 * (1 / 2) * grads / 2)
    assert math.isclose(hsdp.step_seconds(layers), expected, rel_tol=1e-12)
    replicated = MeshLayout(dp=4, dp_link=LINK)
    assert math.isclose(replicated.step_seconds(layers), LINK.time(2 * 3 / 4 * grads), rel_tol=1e-12)
    assert MeshLayout(tp=4).step_seconds(layers) == 0.0


def test_a_budget_that_fits_only_sharded_is_planned_and_the_reason_says_the_memory():
    budget = 40 * MIB
    with pytest.raises(ScheduleError, match=r"rank \d needs [\d.]+ MiB \(\d+ bytes\) against the budget"):
        plan(PROFILE, 2, 8, budget)
    with pytest.raises(ScheduleError, match=r"each stage on dp 2 \(replicated\) × tp 1"):
        plan(PROFILE, 2, 8, budget, layout=MeshLayout(dp=2, dp_link=LINK))
    sharded = plan(PROFILE, 2, 8, budget, layout=MeshLayout(dp=2, tp=2, sharding="fsdp", dp_link=LINK))
    assert sharded.winner.fits and max(sharded.winner.peak_bytes) <= budget
    assert "on dp 2 (FSDP2) × tp 2 the busiest rank holds" in sharded.reason
    assert "of parameters, gradients and optimizer state in the step" in sharded.reason
    # the collectives are in the period: the same plan with a slower data-parallel link is slower
    slow = plan(
        PROFILE, 2, 8, budget, layout=MeshLayout(dp=2, tp=2, sharding="fsdp", dp_link=Link(1e-5, 1e9))
    )
    assert slow.predicted_iteration_time > sharded.predicted_iteration_time


def test_a_budget_that_fits_nothing_even_sharded_is_refused_with_the_numbers():
    layout = MeshLayout(dp=8, tp=8, sharding="fsdp", dp_link=LINK, tp_link=LINK)
    with pytest.raises(ScheduleError) as error:
        plan(PROFILE, 2, 8, 2 * MIB, layout=layout)
    text = str(error.value)
    assert (
        "no schedule fits the memory budget of 2.00 MiB per rank (each stage on dp 8 (FSDP2) × tp 8)" in text
    )
    assert "against the budget of 2097152 bytes" in text


def test_layouts_and_mesh_texts_are_checked():
    assert parse_mesh("pp=2,dp=2,tp=2") == {"pp": 2, "dp": 2, "tp": 2, "dp_replicate": 1, "dp_shard": 1}
    assert parse_mesh("pp=4, dp_replicate=2, dp_shard=4")["dp_shard"] == 4
    for text, message in [
        ("pp=2,cp=2", "NAME one of pp, dp, tp, dp_replicate, dp_shard"),
        ("pp=0", "SIZE ≥ 1"),
        ("pp=2,dp=2,dp_shard=2", "not both"),
    ]:
        with pytest.raises(ScheduleError, match=message):
            parse_mesh(text)
    for kwargs, message in [
        ({"dp": 1, "sharding": "fsdp"}, "give dp ≥ 2"),
        ({"dp": 4, "sharding": "hsdp", "dp_shard": 3}, "proper divisor"),
        ({"dp": 2, "sharding": "zero3"}, "choose replicate, fsdp or hsdp"),
    ]:
        with pytest.raises(ScheduleError, match=message):
            MeshLayout(**kwargs)
    with pytest.raises(ScheduleError, match="vocabulary-parallel head is planned on pipeline ranks alone"):
        plan(PROFILE, 2, 8, head="both", layout=MeshLayout(tp=2))


# -- a cluster on paper ----------------------------------------------------------------------------

LLAMA3_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
}  # fmt: skip
A100S = "nodes=8,gpus=8,intra=300GB/s,inter=25GB/s,flops=312e12,memory=80GiB,efficiency=0.6"


def test_a_model_config_gives_its_parameter_count():
    assert round(TransformerShape.from_config(LLAMA3_8B).parameters / 1e9, 2) == 8.03  # Llama 3 8B
    gpt2 = TransformerShape.from_config({"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
                                         "vocab_size": 50257})  # fmt: skip
    assert not gpt2.gated and gpt2.intermediate == 4 * 768
    assert 0.12e9 < gpt2.parameters < 0.17e9  # 124M with a tied head; ours counts it untied
    with pytest.raises(ScheduleError, match="needs hidden_size"):
        TransformerShape.from_config({"model_type": "llama"})


def test_every_layout_of_the_cluster_is_planned_and_ranked_by_throughput():
    shape, cluster = TransformerShape.from_config(LLAMA3_8B), Cluster.parse(A100S)
    options = plan_cluster(shape, cluster, 64 * 8192, 8192, recompute=True)
    fitting = [o for o in options if o.plan is not None]
    assert fitting and all(o.pp * o.dp * o.tp == 64 and o.tp <= 8 for o in options)
    speeds = [o.tokens_per_second for o in fitting]
    assert speeds == sorted(speeds, reverse=True)
    for option in fitting:  # throughput is the step's tokens over the step with the chosen sharding
        assert option.plan is not None and option.memory <= cluster.memory
        assert math.isclose(option.tokens_per_second, 64 * 8192 / option.step_time / 64, rel_tol=1e-12)
        # the FLOPs run (flash attention skips the masked half; the forward twice) at most at the efficiency
        executed = shape.flops_per_token(8192) - 6 * shape.layers * shape.hidden * 8192
        assert 0 < option.tokens_per_second * executed * 4 / 3 / cluster.flops < cluster.efficiency
    assert "best: pp " in best_layout_text(options)


def test_the_planned_step_is_at_least_the_compute_on_one_gpu():
    """No layout predicts less than each GPU's share of the FLOPs at the given efficiency (attention's
    FLOPs halved: flash attention skips the masked half)."""
    shape, cluster = TransformerShape.from_config(LLAMA3_8B), Cluster.parse(A100S)
    attention = 12 * shape.layers * shape.hidden * 8192 / 2
    flops = (shape.flops_per_token(8192) - attention) * 64 * 8192 / 64
    floor = flops / (cluster.flops * cluster.efficiency)
    for option in plan_cluster(shape, cluster, 64 * 8192, 8192):
        if option.plan is not None:
            assert option.step_time >= floor * 0.999, option.row()


def test_cluster_texts_are_checked():
    assert Cluster.parse("nodes=2,gpus=8,intra=300GB/s,inter=25GB/s").size == 16
    for text, message in [
        ("nodes=2,gpus=8", "lacks intra, inter"),
        ("nodes=2,gpus=8,intra=fast,inter=25GB/s", "intra='fast'"),
        ("nodes=2,gpus=8,intra=300GB/s,inter=25GB/s,efficiency=2", "efficiency at most 1"),
        ("nodes=2,gpus=8,intra=300GB/s,inter=25GB/s,cores=3", "the fields are nodes"),
    ]:
        with pytest.raises(ScheduleError, match=re.escape(message)):
            Cluster.parse(text)


def test_tensor_parallelism_splits_or_replicates_whole_key_value_heads():
    """tp divides the kv heads, or is a multiple of them (each replicated over its group); 3 kv heads
    cannot go over 2 or 4 ranks, 2 kv heads can go over 1, 2, 4 or 8."""
    from zerobubble.schedule.modelplan.cluster import cluster_grids

    cluster = Cluster.parse("nodes=1,gpus=8,intra=300GB/s,inter=25GB/s")

    def tps(kv_heads: int) -> set[int]:
        config = {**LLAMA3_8B, "num_attention_heads": 24, "num_key_value_heads": kv_heads}
        return {grid.tp for grid in cluster_grids(TransformerShape.from_config(config), cluster)}

    assert tps(3) == {
        1
    }  # 24 heads: tp ∈ {1, 2, 4, 8} divides them; 3 kv heads neither divide nor are divided
    assert tps(2) == {1, 2, 4, 8}
    assert tps(8) == {1, 2, 4, 8}
