"""``plan --cluster`` prunes layouts by lower bounds: the fastest ``keep`` are those of the full search.

A layout's step is at least its busiest GPU's compute (the lowered program runs each rank's compute
parts one after another on its compute stream, whatever its communication waits for); generated
clusters (hypothesis), dense and mixtures of experts over every ep size, check that bound against
every simulated candidate, and that the pruned search returns the exhaustive search's fastest
layouts, plans and reasons unchanged.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zerobubble.errors import ScheduleError
from zerobubble.schedule.modelplan.cluster import (
    Cluster,
    ClusterSearch,
    TransformerShape,
    plan_cluster,
)
from zerobubble.schedule.modelplan.cluster_text import cluster_table
from zerobubble.schedule.modelplan.moe import MoEShape, plan_moe_cluster


def _shape(hidden: int, layers: int) -> TransformerShape:
    return TransformerShape.from_config(
        {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": 8,
         "num_key_value_heads": 8, "intermediate_size": 3 * hidden, "vocab_size": 32000}
    )  # fmt: skip


clusters = st.fixed_dictionaries(
    {
        "hidden": st.sampled_from([512, 1024, 2048]),
        "layers": st.sampled_from([4, 6, 8]),
        "nodes": st.sampled_from([1, 2]),
        "gpus": st.sampled_from([2, 4]),
        "memory": st.sampled_from(["2GiB", "4GiB", "16GiB"]),
        "inter": st.sampled_from(["5GB/s", "25GB/s"]),
        "sequences": st.sampled_from([8, 16, 32]),
        "keep": st.integers(1, 4),
    }
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters)
def test_the_pruned_search_keeps_the_exhaustive_fastest_layouts(case):
    shape = _shape(case["hidden"], case["layers"])
    cluster = Cluster.parse(f"nodes={case['nodes']},gpus={case['gpus']},intra=300GB/s,inter={case['inter']},"
                            f"memory={case['memory']}")  # fmt: skip
    sizes, keep = (case["sequences"] * 1024, 1024), case["keep"]
    exhaustive = plan_cluster(shape, cluster, *sizes, search=ClusterSearch(refine=0))
    pruned = plan_cluster(shape, cluster, *sizes, search=ClusterSearch(refine=0, keep=keep))
    _check_bounds(exhaustive)
    _check_same_fastest(exhaustive, pruned, keep)


def _check_bounds(exhaustive) -> None:
    """No simulated candidate beats its busiest GPU's compute."""
    for option in exhaustive:
        if option.plan is not None:
            assert option.plan.winner.timeline is not None
            bound = option.plan.winner.timeline.ideal
            assert option.step_time >= bound * (1 - 1e-12)
            for _options, time, _peak in option.plan.comm.tried if option.plan.comm else ():
                assert time >= bound * (1 - 1e-12)


def _check_same_fastest(exhaustive, pruned, keep) -> None:
    simulated = [o for o in exhaustive if o.plan is not None]
    top = min(keep, len(simulated))
    assert [o.row() for o in pruned[:top]] == [o.row() for o in simulated[:top]]
    assert [o.plan.reason for o in pruned[:top]] == [o.plan.reason for o in simulated[:top]]  # type: ignore[union-attr]
    assert (
        cluster_table(pruned, keep).splitlines()[: top + 1]
        == cluster_table(exhaustive, keep).splitlines()[: top + 1]
    )
    assert len(pruned) == len(exhaustive)
    assert all(o.plan is None and o.note.startswith("not simulated") for o in pruned if o.pruned)


moe_clusters = st.fixed_dictionaries(
    {
        "experts": st.sampled_from([4, 8, 16]),
        "top_k": st.sampled_from([1, 2]),
        "layers": st.sampled_from([4, 6]),
        "gpus": st.sampled_from([4, 8]),
        "memory": st.sampled_from(["4GiB", "16GiB"]),
        "sequences": st.sampled_from([16, 32]),
        "keep": st.integers(1, 4),
    }
)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(moe_clusters)
def test_the_pruned_moe_search_keeps_the_exhaustive_fastest_layouts(case):
    """Every layout × every ep size: the pruned search (some not even planned) keeps the fastest."""
    shape = MoEShape(
        layers=case["layers"], hidden=1024, intermediate=4096, heads=8, kv_heads=8, vocab=32000,
        gated=True, experts=case["experts"], top_k=case["top_k"], expert_intermediate=1024,
    )  # fmt: skip
    cluster = Cluster.parse(f"nodes=1,gpus={case['gpus']},intra=300GB/s,inter=25GB/s,memory={case['memory']}")
    sizes, keep = (case["sequences"] * 1024, 1024), case["keep"]
    search = ClusterSearch(("1f1b", "zb-v", "dualpipe-v"), refine=0)
    exhaustive = plan_moe_cluster(shape, cluster, *sizes, search=search)
    pruned = plan_moe_cluster(
        shape, cluster, *sizes, search=ClusterSearch(search.schedules, refine=0, keep=keep)
    )
    _check_bounds(exhaustive)
    _check_same_fastest(exhaustive, pruned, keep)


def test_pruned_layouts_are_named_in_the_table():
    shape, cluster = _shape(1024, 8), Cluster.parse("nodes=2,gpus=4,intra=300GB/s,inter=25GB/s,memory=4GiB")
    options = plan_cluster(shape, cluster, 32 * 2048, 2048, search=ClusterSearch(refine=0, keep=1))
    pruned = [o for o in options if o.pruned]
    assert pruned and options[0].plan is not None
    assert f"({len(pruned)} layouts not simulated" in cluster_table(options, 1)


def test_the_moe_search_prunes_layouts_of_every_ep():
    """16 GPUs × every ep size: with ``keep=3`` some planned layouts are not simulated, and the
    three fastest are exact."""
    shape = MoEShape(
        layers=6, hidden=1024, intermediate=4096, heads=8, kv_heads=8, vocab=32000, gated=True,
        experts=16, top_k=2, expert_intermediate=1024,
    )  # fmt: skip
    cluster = Cluster.parse("nodes=2,gpus=8,intra=300GB/s,inter=25GB/s,memory=16GiB")
    schedules = ("1f1b", "zb-v", "dualpipe-v")
    exhaustive = plan_moe_cluster(shape, cluster, 64 * 1024, 1024, search=ClusterSearch(schedules, refine=0))
    kept = ClusterSearch(schedules, refine=0, keep=3)
    pruned = plan_moe_cluster(shape, cluster, 64 * 1024, 1024, search=kept)
    assert {o.ep for o in pruned if o.pruned} >= {1, 2}, "layouts of several ep sizes pruned"
    _check_same_fastest(exhaustive, pruned, 3)
    # planned by two worker processes: the same options, row for row, reason for reason
    parallel = plan_moe_cluster(shape, cluster, 64 * 1024, 1024, search=replace(kept, jobs=2))
    assert [(o.row(), o.pruned) for o in parallel] == [(o.row(), o.pruned) for o in pruned]
    with pytest.raises(ScheduleError, match="jobs=0"):
        ClusterSearch(jobs=0)


def test_a_layout_over_the_budget_ranks_after_those_within_it():
    """``ClusterOption.fits`` False (no sharding record fits): ranked after every layout within the
    budget whatever its step, its memory marked ``!`` in the table; the best line says so when no
    layout fits."""
    from zerobubble.schedule.modelplan.cluster_text import best_layout_text

    shape, cluster = _shape(1024, 8), Cluster.parse("nodes=1,gpus=4,intra=300GB/s,inter=25GB/s,memory=4GiB")
    options = plan_cluster(shape, cluster, 16 * 1024, 1024, search=ClusterSearch(refine=0))
    planned = [o for o in options if o.plan is not None]
    assert len(planned) >= 2 and all(o.fits for o in planned)
    over = replace(planned[0], fits=False)  # the fastest, over the budget
    ranked = sorted([over, *planned[1:]], key=lambda o: o.rank)
    assert ranked[-1] is over and ranked[0] is planned[1]
    table = cluster_table(ranked, len(ranked)).splitlines()
    rows = table[1 : len(ranked) + 1]  # after the header, in rank order
    assert [row.count("B!") for row in rows] == [0] * (len(ranked) - 1) + [1], rows
    assert "(!: over the memory budget" in table[len(ranked) + 1]
    assert "over the memory budget" not in best_layout_text(ranked)
    assert "over the memory budget: no layout fits it" in best_layout_text([over])
