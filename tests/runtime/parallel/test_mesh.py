"""A Pipeline on a DeviceMesh, or on one slice of it, on 4 gloo ranks (one spawn for every case).

* ``mesh=`` with (pp 2, dp 2): the replicas' gradients equal one process on the whole batch;
  dimensions in either order and under other names (``mesh_dims``); a tie across the pipeline.
* ``group=mesh["pp"].get_group()``: two independent pipelines on the two slices build and train
  (this hung when every channel was a world-synchronised ``new_group``), even after ranks created
  different numbers of groups beforehand.
* How many groups a Pipeline creates: the same on every rank, a constant (not the world size).
* Bad meshes and ``data_parallel`` values raise a clear error before any collective.
"""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _dist import reference, relative_error, rich_batch, rich_layers, run_ranks, token_loss
from _safety import TIED_NAMES, tied_layers
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from zerobubble.runtime import PipelineError
from zerobubble.runtime.launch import init_distributed
from zerobubble.runtime.parallel.groups import equalize_group_counts, group_count
from zerobubble.runtime.parallel.mesh import mesh_groups
from zerobubble.schedule.grid import Grid


def _worst_error(pipe, expected: dict[str, torch.Tensor]) -> float:
    return max(relative_error(p.grad, expected[name]) for name, p in pipe.named_parameters())


def _replicated_case(mesh, dims, seed: int, schedule: str) -> dict:
    """One step of the mesh's replicas, each on its shard: the worst gradient error vs the whole batch."""
    from zerobubble import Pipeline

    inputs, targets = rich_batch(8, seed=seed)
    _, expected = reference(rich_layers(seed=seed), inputs, targets)
    equalize_group_counts(mesh_groups(mesh), timeout=timedelta(seconds=60))  # none left to pad below
    before = group_count()
    pipe = Pipeline(
        rich_layers(seed=seed),
        mesh=mesh,
        mesh_dims=dims,
        schedule=schedule,
        microbatches=2,
        loss_fn=token_loss,
        timeout=60,
    )
    created = group_count() - before
    shard = slice(4 * pipe.layout.grid.dp_index, 4 * pipe.layout.grid.dp_index + 4)
    loss = pipe.step(inputs[shard], targets[shard])
    return {
        "error": _worst_error(pipe, expected),
        "created": created,
        "replicas": pipe.data_parallel,
        "loss": None if loss is None else float(loss),
        "label": pipe.layout.grid.rank_name(pipe.layout.grid.everyone.index(dist.get_rank())),
    }


def _slice_case() -> dict:
    """``group=mesh["pp"].get_group()`` on (dp 2, pp 2): each slice its own pipeline and batch."""
    from zerobubble import Pipeline

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dist.new_group([0, 1])  # world-synchronised: only ranks 0 and 1 count it, so the counts now differ
    uneven = group_count()
    replica = mesh.get_local_rank("dp")
    inputs, targets = rich_batch(4, seed=10 + replica)
    _, expected = reference(rich_layers(seed=3), inputs, targets)
    before = group_count()
    pipe = Pipeline(
        rich_layers(seed=3),
        group=mesh.get_group("pp"),
        schedule="zb-h1",
        microbatches=2,
        loss_fn=token_loss,
        timeout=60,
    )
    pipe.step(inputs, targets)
    return {"error": _worst_error(pipe, expected), "uneven": uneven, "created": group_count() - before}


def _tied_case(mesh) -> dict:
    """A head tied to the embedding across the pipeline, on the mesh's replicas."""
    from zerobubble import Pipeline

    generator = torch.Generator().manual_seed(4)
    inputs = torch.randint(11, (8, 3), generator=generator)
    targets = torch.randint(11, (8, 3), generator=generator)
    model = nn.Sequential(*tied_layers(5))
    token_loss(model(inputs), targets).backward()
    expected = {name: p.grad for name, p in model.named_parameters()}
    before = group_count()
    pipe = Pipeline(
        tied_layers(5), mesh=mesh, schedule="1f1b", microbatches=2, loss_fn=token_loss, timeout=60
    )
    counts = (before, group_count())
    shard = slice(4 * pipe.layout.grid.dp_index, 4 * pipe.layout.grid.dp_index + 4)
    pipe.step(inputs[shard], targets[shard])
    grads = dict(pipe.named_parameters())
    tied = [name for name in TIED_NAMES if name in grads]
    head = expected[TIED_NAMES[0]]  # named_parameters() lists a tied parameter once, by its first name
    return {"tied": tied, "error": max(relative_error(grads[n].grad, head) for n in tied), "counts": counts}


def _error_of(build) -> str:
    try:
        build()
    except PipelineError as error:
        return str(error)
    return "no error"


def mesh_worker() -> dict:
    init_distributed(backend="gloo", timeout=60)
    torch.set_default_dtype(torch.float64)
    from zerobubble import Pipeline

    results = {"slice": _slice_case()}
    pp_dp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    results["tied"] = _tied_case(pp_dp)  # first: the slices left their ranks with unequal group counts
    results["pp-dp"] = _replicated_case(pp_dp, None, seed=1, schedule="zb-v")
    renamed = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "pipe"))
    results["renamed"] = _replicated_case(renamed, {"pp": "pipe", "dp": "data"}, seed=2, schedule="zb-h1")
    results["bad-count"] = _error_of(
        lambda: Pipeline(rich_layers(0), mesh=pp_dp, data_parallel=4, loss_fn=token_loss)
    )
    return results


@pytest.fixture(scope="module")
def outcomes() -> list[dict]:
    return run_ranks(mesh_worker, 4)


def test_mesh_replicas_equal_one_process_on_the_whole_batch(outcomes):
    for results in outcomes:
        for case in ("pp-dp", "renamed"):
            assert results[case]["replicas"] == 2
            assert results[case]["error"] < 1e-9, (case, results[case])


def test_mesh_ranks_are_named_by_their_coordinates(outcomes):
    assert [results["pp-dp"]["label"] for results in outcomes] == [
        f"rank {rank} (pp {rank // 2}, dp {rank % 2})" for rank in range(4)
    ]
    assert outcomes[1]["renamed"]["label"] == "rank 1 (data 0, pipe 1)"


def test_a_pipeline_on_each_slice_of_a_mesh_builds_and_trains(outcomes):
    assert {results["slice"]["uneven"] for results in outcomes[:2]} != {
        results["slice"]["uneven"] for results in outcomes[2:]
    }, "the case must start from unequal group counts"
    for results in outcomes:
        assert results["slice"]["error"] < 1e-9


def test_a_pipeline_creates_a_few_groups_on_every_rank_whatever_the_world(outcomes):
    # control, ties, the call check, two channel groups, and with mesh= the mesh-wide group; in the
    # slice case the counts differ between the slices, which is fine: only a group's members must agree
    assert {results["pp-dp"]["created"] for results in outcomes} == {6}
    assert [results["slice"]["created"] for results in outcomes] == [5, 5, 5, 5]


def test_ranks_that_belong_to_different_numbers_of_groups_are_evened_out_first(outcomes):
    before = [results["tied"]["counts"][0] for results in outcomes]
    after = [results["tied"]["counts"][1] for results in outcomes]
    assert before[0] == before[1] == before[2] + 1 == before[3] + 1
    assert len(set(after)) == 1 and after[0] == before[0] + 6


def test_a_tie_across_the_pipeline_is_summed_on_a_mesh(outcomes):
    holders = [results["tied"]["tied"] for results in outcomes]
    assert holders == [["0.embed.weight"], ["0.embed.weight"], ["5.weight"], ["5.weight"]]
    for results in outcomes:
        assert results["tied"]["error"] < 1e-9


def test_a_replica_count_other_than_the_mesh_s_is_refused(outcomes):
    for results in outcomes:
        assert "the replica count comes from the mesh (2 along dp)" in results["bad-count"]


def _grid(*names: str, shape: tuple[int, ...] = (), roles=None, data_parallel=None) -> Grid:
    """What the Pipeline reads of a DeviceMesh with these dimension names (and sizes): its grid."""
    return Grid.of_mesh(names, shape or (2,) * len(names), roles=roles, data_parallel=data_parallel)


def test_mesh_dims_name_the_roles_and_refuse_what_does_not_fit():
    assert _grid("pp", "dp", "tp").roles == (("pp", "pp"), ("dp", "dp"), ("tp", "tp"))
    assert dict(_grid("tp", "pp", "dp").roles) == dict(_grid("pp", "dp", "tp").roles)
    grid = _grid("pipe", "tp", roles={"pp": "pipe"})
    assert (grid.dim("pp"), grid.dim("dp"), grid.dim("tp")) == ("pipe", None, "tp")
    for names, roles, message in [
        (("dp", "tp"), None, "none is named 'pp' for the pipeline; name one \"pp\""),
        (("pp",), {"cp": "pp"}, "unknown roles ['cp']"),
        (("pp", "dp"), {"dp": "data"}, "the mesh has no dimension 'data'"),
        (("pp", "dp"), {"dp": "pp"}, "one dimension cannot play two roles"),
        ((), None, "needs a DeviceMesh with named dimensions"),
    ]:
        with pytest.raises(PipelineError) as error:
            _grid(*names, roles=roles)
        assert message in str(error.value)


def test_a_data_parallel_mode_needs_a_mesh():
    with pytest.raises(PipelineError, match=r"data_parallel='fsdp' names how a mesh"):
        Grid.flat(4, "fsdp")


def test_hsdp_runs_on_the_replicate_and_shard_pair_and_each_mode_names_what_it_needs():
    shape = (2, 3, 2, 2)
    hsdp = _grid("pp", "dp_replicate", "dp_shard", "tp", shape=shape, data_parallel="hsdp")
    assert hsdp.data_dims == ("dp_replicate", "dp_shard") and hsdp.dim("dp") is None
    assert (hsdp.pp * hsdp.dp, hsdp.dp, hsdp.sharding, hsdp.dp_shard) == (12, 6, "hsdp", 2)
    replicated = _grid("pp", "dp_replicate", "dp_shard", "tp", shape=shape, data_parallel="replicate")
    assert (replicated.pp * replicated.dp, replicated.dp, replicated.sharding) == (12, 6, None)
    alone = _grid("pp", "dp_shard", shape=(2, 4), data_parallel="fsdp")  # torchtitan's name alone
    assert (alone.pp * alone.dp, alone.dp, alone.sharding) == (8, 4, "fsdp")
    renamed = _grid("pipe", "rows", "cols", roles={"pp": "pipe", "dp_replicate": "rows", "dp_shard": "cols"})
    assert renamed.data_dims == ("rows", "cols")
    full = ("pp", "dp_replicate", "dp_shard", "tp")
    for names, dims_shape, mode, message in [
        (full, shape, "fsdp", 'pass data_parallel="hsdp" to shard within a row'),
        (("pp", "dp"), (), "hsdp", 'mesh_dim_names=("pp", "dp_replicate", "dp_shard"[, "tp"])'),
        (("pp", "dp_replicate"), (), "fsdp", 'add a "dp" dimension'),
        (full, shape, 4, "the replica count comes from the mesh (6 along dp_replicate × dp_shard)"),
    ]:
        with pytest.raises(PipelineError, match=re.escape(message)):
            _grid(*names, shape=dims_shape, data_parallel=mode)
    with pytest.raises(PipelineError, match='one "dp" dimension or along the pair'):
        _grid("pp", "dp", "dp_shard")
