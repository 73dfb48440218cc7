"""Vocabulary-parallel checkpoints through torch.distributed.checkpoint (issue 45, item 3).

Saved from zb-h1 on 2 ranks (an untied V=1001 model and a tied V=13 one, on two sub-groups) and
loaded into zb-v on 2 ranks, 1f1b and zb-h1 on 4 ranks (the rows cut elsewhere), the unpipelined
model (torch's get_state_dict / set_state_dict); the unpipelined model's checkpoint loaded into 1f1b
on 2 ranks.  Each continues for two clipped AdamW steps as the uninterrupted float64 run, and each
rank writes only its own rows: the files are the unpipelined model's size.  One spawn of 4 ranks."""

from __future__ import annotations

import pytest
from _dist import run_ranks
from _vocab_dcp import MAX_NORM, VOCAB_KEYS, cases

RESUMED = ["zb-v p2", "1f1b p4", "zb-h1 p4", "1f1b p2 from unpipelined"]
EXACT = 1e-12


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(cases, 4, str(tmp_path_factory.mktemp("vocab-dcp")), timeout=300)


@pytest.mark.multiprocess
def test_every_step_clips_and_the_saving_layout_trains_as_the_reference(results):
    for norms in results[0]["norms"].values():
        assert min(norms) > MAX_NORM, norms
    trained = [r["trained"] for r in results if "trained" in r]
    assert len(trained) == 2 and max(trained) <= EXACT, trained


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", RESUMED)
def test_another_layout_continues_as_the_uninterrupted_run(name, results):
    mine = [r[name] for r in results]
    for result in mine:
        assert result["params"] <= EXACT, result
        assert result["strict"] == ([], [], []), "every key and state was found"
        assert result["tied"], "a tied weight's names hold one value, an untied one's two"
    losses = [r["loss"] for r in mine if r["loss"] is not None]
    assert losses and max(losses) <= EXACT, mine


@pytest.mark.multiprocess
def test_the_rows_are_cut_by_the_new_layout(results):
    # V=1001 over 4 ranks by shard_bounds, not torch.chunk's 251 251 251 248
    assert [r["1f1b p4"]["rows"] for r in results] == [[0, 251], [251, 501], [501, 751], [751, 1001]]
    assert [r["zb-h1 p4"]["rows"] for r in results] == [[0, 4], [4, 7], [7, 10], [10, 13]]


@pytest.mark.multiprocess
def test_the_unpipelined_model_loads_the_pipelines_checkpoint_with_torchs_functions(results):
    for result in (results[0]["unpipelined"], results[1]["unpipelined"]):  # untied, tied
        assert result["loss"] <= EXACT and result["params"] <= EXACT, result


@pytest.mark.multiprocess
def test_each_rank_writes_its_own_rows_once(results):
    untied, tied = results[0]["files"], results[2]["files"]
    for files in (untied, tied):
        assert files["same keys"], files  # the unpipelined model's keys, tied alias included
        assert f"model.{VOCAB_KEYS[1]}" in files["keys"] and f"model.{VOCAB_KEYS[0]}" in files["keys"]
    # two shards of the head, each rank's rows, none gathered to an owner
    assert untied["head chunks"] == [((0, 0), (501, 6)), ((501, 0), (500, 6))]
    assert tied["head chunks"] == [((0, 0), (7, 6)), ((7, 0), (6, 6))]
    # the two 1001-row weights and their AdamW moments are 6 x 1001 x 6 float64 (288 kB): a second
    # copy of them (gathered to an owner, or written by every rank) would add as much
    copy = 6 * 1001 * 6 * 8
    assert abs(untied["data bytes"] - untied["unpipelined bytes"]) <= copy / 10, untied
    assert abs(tied["data bytes"] - tied["unpipelined bytes"]) <= 0.02 * tied["unpipelined bytes"], tied
    # a tied weight's optimizer state under its first name only, as torch names a shared parameter
    assert "optim.state.vocab_embedding.weight.exp_avg" in tied["keys"]
    assert "optim.state.vocab_head.weight.exp_avg" not in tied["keys"]


@pytest.mark.multiprocess
def test_the_state_dicts_hold_dtensor_shards_of_the_vocabulary_rows(results):
    for result in results:
        assert f"model.{VOCAB_KEYS[0]}" not in result["shards"]  # the dict itself is not prefixed
        assert set(VOCAB_KEYS) <= set(result["shards"]), result["shards"]
        assert any(key.endswith(".exp_avg") for key in result["shards"]), result["shards"]


@pytest.mark.multiprocess
def test_rows_that_are_not_this_ranks_are_refused_and_nothing_loads(results):
    for rank, result in enumerate(results):
        shard, shape, strict, state = result["refused"]
        assert "holds rows [" in shard and f"this rank holds rows [{[0, 4, 7, 10][rank]}," in shard, shard
        assert "[12, 6] in the state dict" in shape and "[13, 6]" in shape, shape
        assert "'no.such.key'" in strict and "nothing was loaded" in strict, strict
        assert state == "unchanged"
