"""Checkpoints with torch.distributed.checkpoint across layouts (issue 28, item 3).

Saved from zb-v on pp 2 × dp 2 and loaded into 1f1b on 4 ranks, into two 2-rank pipelines of other
schedules and partitions and into the unpipelined model (torch's own get_state_dict /
set_state_dict); a checkpoint of the unpipelined model loaded into zb-v on 4 ranks; FSDP shards on a
(dp 2, pp 2) mesh saved and loaded into 1f1b on 4 ranks, and the unpipelined model's checkpoint
loaded into FSDP shards.  Each continues exactly as the uninterrupted float64 run.  The multi-rank
cases share one spawn of four gloo ranks."""

from __future__ import annotations

import pytest
import torch
from _dcp import TIED, cases, layers
from _dist import run_ranks
from torch import nn

from zerobubble.runtime.state.checkpoint import (
    create_optimizer_state,
    load_optimizer_state_by_name,
    optimizer_state_by_name,
)

RESUMED = [
    "1f1b p4 from flat",
    "1f1b p2 [3] from nested",
    "interleaved-1f1b p2 [1, 2, 6] from nested",
    "zb-v p4 from unpipelined",
    "1f1b p4 from fsdp",
    "fsdp 1f1b from unpipelined",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(cases, 4, str(tmp_path_factory.mktemp("dcp")), timeout=400)


@pytest.mark.multiprocess
def test_the_saving_layout_trains_as_the_reference(results):
    trained = [r["trained"] for r in results if "trained" in r]
    # the last stage's rank of each replica; the returned mean loss is float32 (the parameters are not)
    assert len(trained) == 2 and max(trained) <= 1e-6


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", RESUMED)
def test_another_layout_continues_as_the_uninterrupted_run(name, results):
    mine = [r[name] for r in results if name in r]
    assert mine, name
    for result in mine:
        assert result["params"] <= 1e-6, result
        assert result["strict"] == ([], [], []), "every key and state was found"
        assert result["tied"], "both names of the tied parameter hold one value"
    losses = [r["loss"] for r in mine if r["loss"] is not None]
    assert losses and max(losses) <= 1e-6, mine


@pytest.mark.multiprocess
def test_fsdp_saves_its_optimizer_state_as_dtensor_shards(results):
    assert all(r["sharded"] for r in results)


@pytest.mark.multiprocess
def test_the_unpipelined_model_loads_the_pipelines_checkpoint_with_torchs_functions(results):
    result = results[0]["unpipelined from flat"]
    assert result["loss"] <= 1e-6 and result["params"] <= 1e-6, result


@pytest.mark.multiprocess
def test_optimizer_state_is_keyed_by_parameter_name(results):
    everything = set().union(*(r["optim keys"] for r in results))
    model = nn.Sequential(*layers(0))
    assert everything == {name for name, _ in model.named_parameters()}, "the first name of a tie only"
    for r in results:
        assert all(key.startswith(("state.", "param_groups.")) for key in r["flat keys"])
        assert r["groups"] and set(r["groups"][0]) == set(r["optim keys"])
    # zb-v on 2 ranks: rank 0 holds the embedding and the head (one Parameter), rank 1 the middle
    assert TIED[0] in results[0]["optim keys"] and TIED[1] not in results[0]["optim keys"]


@pytest.mark.multiprocess
def test_replicas_are_written_once(results):
    files = results[0]["files"]
    # the same entries as the unpipelined model's save, and two replicas hold every one of them:
    # written by both, the files would be twice the size of the unpipelined model's
    assert files["same keys"]
    assert files["data bytes"] <= 1.1 * files["unpipelined bytes"], files
    assert f"model.{TIED[1]}" in files["keys"] and f"optim.state.{TIED[0]}.exp_avg" in files["keys"]
    assert f"optim.state.{TIED[1]}.exp_avg" not in files["keys"]


# -- one process: the optimizer state by name --------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.Adam(ps, lr=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=0.1, amsgrad=True),
    ],
)
def test_created_state_steps_like_no_state(make):
    """Zero state with step 0 (created so DCP can load in place) steps as a fresh optimizer does."""
    torch.manual_seed(0)
    first, second = nn.Linear(3, 2).double(), nn.Linear(3, 2).double()
    second.load_state_dict(first.state_dict())
    fresh, created = make(first.parameters()), make(second.parameters())
    create_optimizer_state(created)
    assert all(created.state[p] for p in second.parameters())
    for model, optimizer in ((first, fresh), (second, created)):
        model(torch.ones(4, 3, dtype=torch.float64)).square().sum().backward()
        optimizer.step()
    for a, b in zip(first.parameters(), second.parameters()):
        assert torch.equal(a, b)


def test_named_state_round_trips_nested_and_flat():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    optimizer = torch.optim.AdamW(
        [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.5}]
    )
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    names = {id(p): n for n, p in model.named_parameters()}
    for flatten in (False, True):
        state = optimizer_state_by_name(optimizer, names, flatten=flatten)
        other = torch.optim.AdamW(
            [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.1}]
        )
        assert load_optimizer_state_by_name(other, state, names, {}) == []
        assert other.param_groups[1]["lr"] == 0.5
        for p in model.parameters():
            assert torch.equal(other.state[p]["exp_avg"], optimizer.state[p]["exp_avg"])
    with pytest.raises(Exception, match=r"no state for '0\.weight'"):
        state = optimizer_state_by_name(optimizer, names)
        del state["state"]["0.weight"]
        load_optimizer_state_by_name(torch.optim.AdamW(model.parameters()), state, names, {})
