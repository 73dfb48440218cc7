"""Expert parallelism on a (pp 2, ep 2) mesh of four gloo ranks (issue 48, items 1 and 2).

Each ``ep`` rank runs its half of the batch; the experts are sharded over ``ep`` as DTensors and the
routed tokens cross it by all-to-all.  The MoE families (Mixtral, Qwen2-MoE with its shared
expert, Qwen3-MoE), with 1F1B and ZB-V (the experts' weights B/W-split), with the router's aux loss
and without, dualpipe-v also with ``overlap="threads"``, train like the model in one process on the
whole batch (float64, three clipped AdamW steps) and the split guard finds no mismatch; DCP
checkpoints go from (pp 2, ep 2) to (pp 2, dp 2) and to the unpipelined cut and back; (pp 1, dp 2,
ep 2) reduces the experts over dp only; wrong layouts are refused on every rank.  With
``data_parallel="fsdp"`` FSDP2 shards the rest over every replica, the experts stay ep's
(``_expert_fsdp.py``).  One spawn serves all.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from _dist import run_ranks
from _expert_fsdp import FSDP_CASES, TP_CASES
from _expert_parallel import all_cases
from torch import nn

from zerobubble.hf import pipeline_layers
from zerobubble.runtime import PipelineError
from zerobubble.schedule.grid import Grid

TRAINED = [
    ("mixtral", "1f1b", True),
    ("mixtral", "zb-v", False),
    ("qwen2_moe", "zb-v", True),
    ("qwen3_moe", "1f1b", False),
    ("qwen3_moe", "zb-v", True),
    ("mixtral", "dualpipe-v", False),
    ("mixtral", "dualpipe-v threads", False),  # overlap="threads": each pair's halves on two threads
    ("mixtral", "auto", False),  # planned: the experts' all-to-all timed on the ep ranks, dualpipe-v weighed
]


def _key(case) -> str:
    family, schedule, aux = case
    return f"{family} {schedule} {'aux' if aux else 'no-aux'}"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(all_cases, 4, str(tmp_path_factory.mktemp("ep")), TRAINED, timeout=500)


def test_the_ep_dimension_is_a_replica_dimension_not_one_inside_a_stage():
    grid = Grid.of_mesh(("pp", "ep"), (2, 2))
    assert (grid.pp, grid.dp, grid.ep, grid.tp, grid.replicas, grid.size) == (2, 1, 2, 1, 2, 4)
    placed = grid.on_mesh([0, 1, 2, 3], [1, 1])  # rank 3: pipeline rank 1 of replica (ep) 1
    assert (placed.pipeline_rank, placed.dp_index, placed.replica_ranks(1)) == (1, 1, [1, 3])
    three = Grid.of_mesh(("pp", "dp", "ep", "tp"), (2, 2, 2, 2))
    assert (three.dp, three.ep, three.tp, three.replicas, three.replica_dims) == (2, 2, 2, 4, ("dp", "ep"))
    assert three.describe() == "dp 2 × ep 2 (replicated) × tp 2"
    assert Grid.of_mesh(("pp", "ep"), (2, 2), data_parallel="fsdp").describe() == "ep 2 (FSDP2) × tp 1"


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", TRAINED, ids=_key)
def test_pp2_ep2_trains_like_the_model_on_the_whole_batch(case, results):
    from _hf_moe import moe_model

    family, schedule, aux = case
    mine = [r["trained"][_key(case)] for r in results]
    losses = [m["losses"] for m in mine if m["losses"]]
    assert len(losses) == 2 and all(len(each) == 3 and max(each) <= 1e-12 for each in losses), losses
    covered = set().union(*(m["params"] for m in mine))
    whole = nn.Sequential(*pipeline_layers(moe_model(family, aux)))
    assert covered == {name for name, _ in whole.named_parameters()}
    # a named schedule's even cut gives each rank MoE blocks; auto's measured cut may leave one none
    assert all(m["experts"] for m in mine) if schedule != "auto" else any(m["experts"] for m in mine)
    for m in mine:
        worst = max(m["params"].items(), key=lambda item: item[1])
        assert worst[1] <= 1e-10, worst  # the routers, the experts (full tensors), everything
        assert m["mismatches"] == [], "the split guard found no mismatch"
        assert all("experts" in name for name in m["experts"])  # DTensors
        if not m["experts"]:  # no MoE block on this rank: nothing to exchange, split or report
            assert m["exchanges"] == (0, 0) and not m["report"] and m["groups"] == 0, m
            continue
        deferred = m["schedule"] not in ("1f1b", "gpipe", "interleaved-1f1b")  # auto's winner may be one
        assert bool(m["report"]) == deferred  # zb-v, dualpipe-v: the experts' W deferred
        sent, expected = m["exchanges"]
        assert sent == expected, "one dispatch and one combine per F and per B: W sends nothing"
        assert m["groups"] == 2, "a forward's exchanges over one group, a backward's over another"
        threaded = schedule.endswith("threads")
        assert m["threads"] == (["MainThread", "zerobubble-pair"] if threaded else ["MainThread"])
        assert all(path == "generic" and verified for _, path, verified in m["report"])


@pytest.mark.multiprocess
def test_pp1_dp2_ep2_reduces_the_experts_over_dp_only(results):
    assert sorted(r["dp ep"]["replica"] for r in results) == [0, 1, 2, 3]  # four shards of the batch
    for r in results:
        assert len(r["dp ep"]["losses"]) == 3 and max(r["dp ep"]["losses"]) <= 1e-12
        assert max(r["dp ep"]["params"].values()) <= 1e-10


@pytest.mark.multiprocess
def test_the_expert_weights_are_dtensor_shards_of_the_whole(results):
    for r in results:
        saved = r["checkpoints"]
        assert saved["mismatches"] == []
        for placements, shape in saved["expert entries"].values():
            assert placements == "(Shard(dim=0),)" and shape[0] == 2  # 4 experts over 2 ranks
        assert saved["full tensors"] <= 1e-12  # full_tensor() is the reference's whole weight
        assert saved["optimizer DTensors"] == 2 * len(saved["expert entries"])  # AdamW's two moments


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["1f1b pp2 dp2 from ep", "zb-v pp2 ep2 from unpipelined"])
def test_dcp_checkpoints_cross_layouts_and_continue_exactly(name, results):
    mine = [r["checkpoints"][name] for r in results]
    for result in mine:
        assert result["strict"] == ([], [], []), "every key and state was found"
        assert result["params"] <= 1e-12, result
    losses = [m["loss"] for m in mine if m["loss"] is not None]
    assert len(losses) == 2 and max(losses) <= 1e-12, mine
    assert results[0]["checkpoints"]["unpipelined from ep"] <= 1e-12


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("dense", "no mixture-of-experts layer"),
        ("three experts", "holds 3 experts"),
    ],
)
def test_wrong_layouts_are_refused_on_every_rank(case, says, results):
    assert all(says in r["refused"][case] for r in results), [r["refused"][case] for r in results]


@pytest.mark.multiprocess
def test_auto_times_the_experts_all_to_all_and_weighs_dualpipe_v(results):
    """``schedule="auto"`` on (pp 2, ep 2): each MoE block's exchange is timed on its ep ranks (the
    embedding and the head have none), dualpipe-v is a candidate and the reason says what the
    all-to-all costs and how much of it dualpipe-v hides; the run is exact (the trained test above)."""
    plans = [r["trained"][_key(("mixtral", "auto", False))]["plan"] for r in results]
    assert all(plan == plans[0] for plan in plans), "every rank runs the same plan"
    plan = plans[0]
    measured = plan["all_to_all"]
    assert measured[0] == 0 and measured[-1] == 0 and all(t > 0 for t in measured[1:-1]), measured
    assert "dualpipe-v" in plan["candidates"], plan["candidates"]
    assert "experts: expert all-to-all" in plan["reason"] and "dualpipe-v" in plan["reason"], plan["reason"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["zb-v", "dualpipe-v"])
def test_the_vocabulary_parallel_ends_run_on_the_ep_replicas(schedule, results):
    """Qwen3-MoE with its head and embedding vocabulary-parallel over each replica's pipeline ranks,
    the experts over ep: three clipped steps equal the model in one process on the whole batch."""
    mine = [r["vocab"][schedule] for r in results]
    losses = [m["losses"] for m in mine if m["losses"]]
    assert len(losses) >= 2 and all(len(each) == 3 and max(each) <= 1e-12 for each in losses), losses
    for m in mine:
        worst = max(m["params"].items(), key=lambda item: item[1])
        assert worst[1] <= 1e-10, worst
        assert m["mismatches"] == []
        assert m["replicas"] == 2, "pipe.data_parallel counts the ep replicas (each its share of the batch)"


FSDP_TRAINED = [case[0] for case in FSDP_CASES] + ["1f1b mixtral pp1 dp2 ep2"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", FSDP_TRAINED)
def test_fsdp_shards_all_but_the_experts_over_the_replicas_and_trains_exactly(name, results):
    """data_parallel="fsdp" on (pp 2, ep 2), and on (pp 1, dp 2, ep 2) over the four replicas'
    column: three clipped steps equal one process on the whole batch (without the experts' own
    average, or with the experts' norm counted on every dp row, they drift by 1e-3 to 1e-1)."""
    mine = [r["fsdp"]["trained"][name] for r in results]
    losses = [m["losses"] for m in mine if m["losses"]]
    assert len(losses) >= 2 and all(len(each) == 3 and max(each) <= 1e-12 for each in losses), losses
    for m in mine:
        worst = max(m["params"].items(), key=lambda item: item[1])
        assert worst[1] <= 1e-10, worst
        assert m["mismatches"] == [] and m["sharded"] == "fsdp"
        kinds = m["kinds"]
        assert kinds["fsdp"] and not kinds["plain"], kinds  # every parameter but the experts FSDP2's
        assert all("experts" in each for each in kinds["experts"])
        assert not any(".experts." in each for each in kinds["fsdp"]), "FSDP2 leaves the routed experts alone"
        if name.startswith("auto"):  # planned for FSDP2 over the replicas, the all-to-all timed
            assert "FSDP" in m["plan"] and "experts: expert all-to-all" in m["plan"], m["plan"]
    # a named schedule's even cut gives each rank MoE blocks; auto's measured cut may leave one none
    holding = [bool(m["kinds"]["experts"]) for m in mine]
    assert all(holding) if not name.startswith("auto") else any(holding), holding


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["replicate from fsdp", "fsdp from replicate"])
def test_fsdp_and_replicated_checkpoints_resume_in_each_other(name, results):
    mine = [r["fsdp"]["checkpoints"][name] for r in results]
    for result in mine:
        assert result["strict"] == ([], [], []), "every key and state was found"
        assert result["params"] <= 1e-12, result
    losses = [m["loss"] for m in mine if m["loss"] is not None]
    assert len(losses) == 2 and max(losses) <= 1e-12, mine


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("case", "says"),
    [("hsdp", "data_parallel='hsdp'"), ("threads", 'drop overlap="threads"')],
)
def test_what_expert_parallelism_with_sharding_refuses(case, says, results):
    said = [r["fsdp"]["refused"][case] for r in results]
    assert all(says in each for each in said), said


def test_fsdp_with_ep_shards_over_the_replicas():
    """The grid: "fsdp" beside "ep" shards over every replica (as the runtime lowers it, its ``dp``
    counting them all: FSDP2's unshards and reduce-scatters); "hsdp" needs its pair of dimensions."""
    from dataclasses import replace

    alone = Grid.of_mesh(("pp", "ep"), (2, 2), data_parallel="fsdp")
    both = Grid.of_mesh(("pp", "dp", "ep"), (1, 2, 2), data_parallel="fsdp")
    assert (alone.sharding, alone.replicas, both.replicas) == ("fsdp", 2, 4)
    lowered = [replace(grid, dp=grid.replicas) for grid in (alone, both)]
    assert [(grid.dp_mode, grid.shard) for grid in lowered] == [("fsdp", 2), ("fsdp", 4)]
    with pytest.raises(PipelineError, match='shards along "dp_shard"'):
        Grid.of_mesh(("pp", "dp", "ep"), (1, 2, 2), data_parallel="hsdp")


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [case[0] for case in TP_CASES])
def test_tensor_parallel_attention_beside_ep_trains_exactly(name, results):
    """(pp 1, ep 2, tp 2): the attention cut over tp, the experts over ep; replicated with 1F1B and
    FSDP2 with ZB-V (the experts' W deferred): three clipped steps equal one process."""
    for r in results:
        mine = r["fsdp"]["tensor parallel"][name]
        assert len(mine["losses"]) == 3 and max(mine["losses"]) <= 1e-12, mine["losses"]
        worst = max(mine["params"].items(), key=lambda item: item[1])
        assert worst[1] <= 1e-10, worst
        assert mine["mismatches"] == []
        experts = {each: dims for each, dims in mine["meshes"].items() if "experts" in each}
        attention = {each: dims for each, dims in mine["meshes"].items() if "q_proj" in each}
        assert experts and all(dims == ("ep",) for dims in experts.values()), experts
        assert attention and all("tp" in dims for dims in attention.values()), attention
        assert bool(mine["deferred"]) == name.startswith("zb-v")
