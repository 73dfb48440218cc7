"""``plan --cluster`` prunes layouts by a lower bound: the fastest ``keep`` are those of the full search.

A layout's step is at least its busiest GPU's compute (the lowered program runs each rank's compute
parts one after another on its compute stream, whatever its communication waits for); generated
clusters (hypothesis) check that bound against every simulated candidate, and that the pruned search
returns the exhaustive search's fastest layouts, plans and reasons unchanged.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zerobubble.schedule.modelplan.cluster import Cluster, ClusterSearch, TransformerShape, plan_cluster
from zerobubble.schedule.modelplan.cluster_text import cluster_table


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
    for option in exhaustive:  # the bound: no simulated candidate beats the busiest GPU's compute
        if option.plan is not None:
            assert option.plan.winner.timeline is not None
            bound = option.plan.winner.timeline.ideal
            assert option.step_time >= bound * (1 - 1e-12)
            for _options, time, _peak in option.plan.comm.tried if option.plan.comm else ():
                assert time >= bound * (1 - 1e-12)
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


def test_pruned_layouts_are_named_in_the_table():
    shape, cluster = _shape(1024, 8), Cluster.parse("nodes=2,gpus=4,intra=300GB/s,inter=25GB/s,memory=4GiB")
    options = plan_cluster(shape, cluster, 32 * 2048, 2048, search=ClusterSearch(refine=0, keep=1))
    pruned = [o for o in options if o.pruned]
    assert pruned and options[0].plan is not None
    assert f"({len(pruned)} layouts not simulated" in cluster_table(options, 1)
