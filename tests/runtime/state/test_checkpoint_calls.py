"""Checkpoints of a model with a tied embedding/head interchange with the unpipelined model, and calls
whose arguments differ between ranks are refused on every rank before any message moves (issue 25,
items 6 and 7).  The multi-rank cases run in one spawn of two gloo ranks."""

from __future__ import annotations

import re

import pytest
from _checkpoint_calls import TIED, cases
from _dist import run_ranks

from zerobubble.runtime.parallel.consistency import CallSignature, explain_calls

SCHEDULES = ["1f1b", "interleaved-1f1b", "zb-v"]
SECONDS = 3.0  # a refused call is refused at once; the bound leaves room for the loaded 2-core machine


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(cases, 2, str(tmp_path_factory.mktemp("checkpoints")), timeout=240)


# -- item 6: checkpoints ---------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", SCHEDULES)
def test_the_ranks_state_dicts_merge_into_the_unpipelined_state_dict(name, results):
    first, second = (r[name] for r in results)
    assert first["disjoint"], "the ranks of one pipeline hold disjoint keys"
    for result in (first, second):
        assert result["full keys"], "full_state_dict has the unpipelined keys, in its order"
        assert result["full is the union"], "full_state_dict is the union of the ranks' state_dict()"
        assert result["full holds copies"], "full_state_dict does not share storage with the parameters"
        assert result["trained"] <= 1e-5, result["trained"]
        assert result["tied copies"]
        assert result["unpipelined strict load"] == ([], [])
        assert result["unpipelined round trip"] and result["union strict load"]
        assert result["saved files merge"] and result["own file unchanged"]
        assert result["own file reloads"] == ([], [])
    keys = first["own keys"] + second["own keys"]
    assert TIED[0] in keys and TIED[1] in keys, "the tied parameter appears under both of its names"
    assert "0.scale" in keys and "1.version" in keys and "0.cache" not in keys, "persistent buffers only"


@pytest.mark.multiprocess
def test_the_alias_sits_with_its_layer(results):
    ranks = {key: rank for rank, r in enumerate(results) for key in r["1f1b"]["own keys"]}
    assert ranks[TIED[0]] == 0 and ranks[TIED[1]] == 1  # 1f1b: embedding on rank 0, head on rank 1
    ranks = {key: rank for rank, r in enumerate(results) for key in r["zb-v"]["own keys"]}
    assert ranks[TIED[0]] == ranks[TIED[1]] == 0  # zb-v: rank 0 holds the first and the last stage


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", SCHEDULES)
def test_the_unpipelined_state_dict_loads_strictly_on_every_rank(name, results):
    for r in results:
        result = r[name]
        assert result["pipe strict load"] == ([], [])
        assert result["pipe round trip"], "values, buffers and both copies of the tie as loaded"
        assert result["grads after load"] <= 1e-5, result["grads after load"]
        holds_loss = result["evaluate after load"] is not None
        assert not holds_loss or result["evaluate after load"] <= 1e-5
    assert sum(r[name]["evaluate after load"] is not None for r in results) == 1


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", SCHEDULES)
def test_bad_checkpoints_raise_naming_the_keys_and_load_nothing(name, results):
    for r in results:
        errors = r[name]["errors"]
        holds = "2.fc.bias" in r[name]["own keys"]
        if holds:
            assert errors["missing"][0] == "error" and "'2.fc.bias'" in errors["missing"][1]
            assert "missing keys of rank" in errors["missing"][1]
            assert errors["missing lenient"] == ("loaded", ["2.fc.bias"], [])
        else:
            assert errors["missing"] == ("loaded", [], [])
        assert errors["missing unchanged"] == holds, "a refused load changes nothing"
        assert errors["unexpected"][0] == "error" and "'9.bogus'" in errors["unexpected"][1]
        assert errors["unexpected unchanged"]
        assert errors["unexpected lenient"] == ("loaded", [], ["9.bogus"])
        conflict = errors["tie conflict"]
        assert conflict[0] == "error" and f"{TIED[0]!r} and {TIED[1]!r}" in conflict[1]
        assert errors["tie conflict unchanged"]
        if "1.fc.weight" in r[name]["own keys"]:
            assert (
                errors["shape"][0] == "error"
                and "1.fc.weight: [3, 3] in the state dict" in errors["shape"][1]
            )
            assert errors["shape unchanged"]
        assert errors["no alias"] == ("loaded", [], [])
        assert errors["no alias sets both copies"]


# -- item 7: calls whose arguments differ between ranks --------------------------------------------------


def _refused(message: str) -> str:
    match = re.match(r"error after ([0-9.]+)s: (.*)", message, re.DOTALL)
    assert match, message
    assert float(match.group(1)) < SECONDS, message
    return match.group(2)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "case, everywhere",
    [
        (
            "batch size",
            "the inputs passed to step() differ between ranks: batch size 8 on rank 0 but 16 on rank 1",
        ),
        ("dtype", "[8, 3] int64 on rank 0 but [8, 3] int32 on rank 1"),
        ("shape", "[8, 3] int64 on rank 0 but [8, 2] int64 on rank 1"),
        ("step and evaluate", "rank 1 called evaluate() while rank 0 called step()"),
        ("loss scale", "rank 1 passed loss_scale=1024 to step() but rank 0 passed 1"),
    ],
)
def test_arguments_that_differ_are_refused_on_every_rank(case, everywhere, results):
    for r in results:
        message = _refused(r["calls"][case])
        assert everywhere in message and "the Pipeline stays usable" in message, message


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "case, culprit, own",
    [
        ("no targets on the last rank", 1, "rank 1 holds the last stage: pass the targets to step()"),
        ("no_grad on one rank", 1, "use pipe.evaluate(inputs, targets)"),
        ("batch that does not split on one rank", 0, "does not split into 4 equal microbatches"),
        ("dict on one rank", 0, "the inputs are a dict (tokens)"),
        ("evaluate without targets", 1, "rank 1 holds the last stage: pass the targets to evaluate()"),
        ("zb-v without targets", 0, "rank 0 holds the last stage: pass the targets to step()"),
    ],
)
def test_an_argument_error_on_one_rank_stops_every_rank(case, culprit, own, results):
    for rank, r in enumerate(results):
        message = _refused(r["calls"][case])
        assert own in message, message
        if rank != culprit:
            assert message.startswith(f"rank {culprit} cannot run "), message


@pytest.mark.multiprocess
def test_the_pipeline_stays_usable_after_refused_calls(results):
    first, second = (r["calls"] for r in results)
    for r in (first, second):
        assert r["each rank its part"].startswith("no error"), r["each rank its part"]
        assert r["correct step after"] <= 1e-5, r["correct step after"]
        assert r["zb-v correct step"].startswith("no error"), r["zb-v correct step"]
    assert first["loss after"] is None and second["loss after"] is not None
    assert first["zb-v correct step"] == "no error: True"


@pytest.mark.multiprocess
def test_data_parallel_replicas_are_compared_too(results):
    for r in results:
        message = _refused(r["calls"]["replica batch size"])
        assert "batch size 8 on rank 0 (pipeline rank 0 of replica 0) but 16 on rank 1" in message, message
    losses = {r["calls"]["replica correct step"] for r in results}
    assert len(losses) == 1 and next(iter(losses)).startswith("no error"), losses


@pytest.mark.multiprocess
def test_the_check_can_be_turned_off_on_every_rank_alike(results):
    first, second = (r["calls"] for r in results)
    assert first["without the check"] == "no error: False" and second["without the check"] == "no error: True"
    for r in (first, second):
        message = _refused(r["check_calls differs"])
        assert "rank 1 differs from rank 0 in its check_calls: False there but True on rank 0" in message


# -- the message, without processes -----------------------------------------------------------------------


def test_explain_calls_names_the_first_difference():
    base = CallSignature("step", 1.0, (((8, 3), "int64"),), (((8, 3), "int64"),))
    assert explain_calls([base, base]).startswith("the ranks' calls differ")
    only_targets = CallSignature("step", 1.0, None, (((8, 3), "int64"),))
    assert "differ" in explain_calls([base, only_targets])  # nothing to compare: the fallback text
    two = CallSignature("step", 1.0, (((8, 3), "int64"), ((8,), "float32")), None)
    three = CallSignature("step", 1.0, (((8, 3), "int64"), ((4,), "float32")), None)
    assert "([8, 3] int64, [8] float32) on rank 0 but ([8, 3] int64, [4] float32) on rank 1" in explain_calls(
        [two, three]
    )
    failed = CallSignature("step", problem="boom")
    assert explain_calls([base, failed, failed]).startswith("rank 1 cannot run step(): boom")


@pytest.mark.multiprocess
def test_the_exchange_on_three_ranks():
    from _checkpoint_calls import three_rank_exchange

    for r in run_ranks(three_rank_exchange, 3, timeout=120):
        assert r["max"] == [2, 10, 0]
        assert r["same"] is None and r["only rank 2 passes inputs"] is None and r["again"] is None
        assert "batch size 8 on rank 0 but 4 on rank 2" in r["rank 2 differs"]
        assert r["rank 1 fails"].startswith("rank 1 cannot run step(): a local error")
        assert r["seconds"] < SECONDS


@pytest.mark.parametrize("size", range(1, 10))
def test_recursive_doubling_reaches_every_rank(size):
    """The max-reduce's transfers, run on threads with queues for channels: every rank gets the max."""
    import queue
    import threading

    import torch

    from zerobubble.runtime.parallel.consistency import CallCheck

    channels = {(a, b): queue.Queue() for a in range(size) for b in range(size)}
    results: dict[int, list[int]] = {}

    def run(rank: int) -> None:
        check = object.__new__(CallCheck)
        check.rank, check.size = rank, size

        def transfer(operation, tensor, peer, what):
            if operation.__name__ == "isend":
                channels[rank, peer].put(tensor.clone())
            else:
                tensor.copy_(channels[peer, rank].get(timeout=10))

        def swap(mine, theirs, peer, what):
            channels[rank, peer].put(mine.clone())
            theirs.copy_(channels[peer, rank].get(timeout=10))

        check._transfer, check._swap = transfer, swap
        values = torch.tensor([rank, -rank, 7 * rank % size], dtype=torch.int64)
        results[rank] = check._max_reduce(values, "test").tolist()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    expected = [size - 1, 0, max(7 * r % size for r in range(size))]
    assert results == dict.fromkeys(range(size), expected)
    assert all(channel.empty() for channel in channels.values()), "every message was received"
