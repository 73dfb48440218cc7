"""The grid (``zerobubble.schedule.grid``): one torch-free record of the device layout.

For generated mesh shapes, role names and ``data_parallel`` modes, the :class:`Grid` built from the
mesh's names and sizes alone agrees with the semantics the Pipeline had before it: the sizes multiply
to the rank count, sharding and ``dp_shard`` as the mode and the dimensions say, and the invalid
combinations refused with the same messages.  A placed grid's ``global_rank`` and ``rank_name`` find
each rank again, and ``mesh_layout(parse_mesh(...))`` is the planner's grid of the text.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerobubble.errors import PipelineError, ScheduleError
from zerobubble.schedule.grid import Grid
from zerobubble.schedule.modelplan import Link, MeshLayout, mesh_layout, parse_mesh

DATA_LAYOUTS = ((), ("dp",), ("dp_replicate", "dp_shard"), ("dp_shard",), ("dp_replicate",))
MODES = (None, "replicate", "fsdp", "hsdp", 1, 2, 4)


@st.composite
def meshes(draw):
    """``(names, sizes, roles)``: a pipeline dimension, a data-parallel layout, maybe ``tp`` and a
    dimension of the user's own, in any order, some renamed through ``roles``."""
    names = ["pp", *draw(st.sampled_from(DATA_LAYOUTS))]
    names += [name for name in ("tp", "cp") if draw(st.booleans())]
    names = draw(st.permutations(names))
    sizes = [draw(st.integers(1, 3)) for _ in names]
    roles = {}
    for role in ("pp", "dp", "dp_replicate", "dp_shard", "tp"):
        if role in names and draw(st.booleans()):
            roles[role] = f"my_{role}"
    renamed = [f"my_{name}" if name in roles else name for name in names]
    return renamed, sizes, roles


def _expected(names, sizes, roles, mode):
    """What the Pipeline made of such a mesh before the grid: ``(pp, dp, tp, sharding)`` or the
    message it raised."""
    role_of = {roles.get(role, role): role for role in ("pp", "dp", "dp_replicate", "dp_shard", "tp")}
    by_role = {role_of.get(name, name): size for name, size in zip(names, sizes)}
    data = [role for role in ("dp", "dp_replicate", "dp_shard") if role in by_role]
    replicas = math.prod(by_role[role] for role in data)
    inside = math.prod(size for role, size in by_role.items() if role != "pp" and role not in data)
    if mode == "fsdp" and (len(data) != 1 or "dp_replicate" in data):
        return 'data_parallel="fsdp" shards over'
    if mode == "hsdp" and data != ["dp_replicate", "dp_shard"]:
        return 'data_parallel="hsdp" shards along'
    if isinstance(mode, int) and mode != replicas:
        return "the replica count comes from the mesh"
    sharding = mode if mode in ("fsdp", "hsdp") else None
    return by_role["pp"], replicas, inside, sharding, by_role.get("dp_shard") if sharding == "hsdp" else None


@settings(max_examples=150, deadline=None)
@given(meshes(), st.sampled_from(MODES))
def test_a_mesh_s_grid_has_the_sizes_and_sharding_it_had(mesh, mode):
    names, sizes, roles = mesh
    expected = _expected(names, sizes, roles, mode)
    if isinstance(expected, str):
        with pytest.raises(PipelineError, match=expected):
            Grid.of_mesh(names, sizes, roles=roles, data_parallel=mode)
        return
    grid = Grid.of_mesh(names, sizes, roles=roles, data_parallel=mode)
    assert (grid.pp, grid.dp, grid.tp, grid.sharding, grid.dp_shard) == expected
    assert grid.size == math.prod(sizes)
    assert grid.dim("pp") == roles.get("pp", "pp")


def test_roles_that_do_not_fit_the_mesh_are_refused_with_their_messages():
    for names, roles, message in [
        (("dp", "tp"), None, "none is named 'pp' for the pipeline"),
        (("pp",), {"cp": "pp"}, "unknown roles ['cp']"),
        (("pp", "dp"), {"dp": "data"}, "the mesh has no dimension 'data'"),
        (("pp", "dp"), {"dp": "pp"}, "one dimension cannot play two roles"),
        ((), None, "needs a DeviceMesh with named dimensions"),
        (("pp", "dp", "dp_shard"), None, 'one "dp" dimension or along the pair'),
    ]:
        with pytest.raises(PipelineError) as error:
            Grid.of_mesh(names, [2] * len(names), roles=roles)
        assert message in str(error.value)


@settings(max_examples=100, deadline=None)
@given(meshes(), st.randoms(use_true_random=False))
def test_every_rank_of_a_placed_mesh_grid_is_found_again(mesh, rng):
    names, sizes, roles = mesh
    grid = Grid.of_mesh(names, sizes, roles=roles)
    ranks = list(range(100, 100 + math.prod(sizes)))
    rng.shuffle(ranks)  # any global ranks, in any order over the mesh
    strides = [math.prod(sizes[axis + 1 :]) for axis in range(len(sizes))]
    for flat, rank in enumerate(ranks):
        coordinate = [flat // stride % size for stride, size in zip(strides, sizes)]
        placed = grid.on_mesh(ranks, coordinate)
        assert placed.global_rank(placed.pipeline_rank) == rank
        assert rank in placed.replica_ranks(placed.dp_index)
        assert len(placed.span) == grid.pp * grid.dp and placed.everyone == tuple(sorted(ranks))
        label = ", ".join(f"{name} {i}" for name, i in zip(names, coordinate))
        assert placed.rank_name(placed.everyone.index(rank)) == f"rank {rank} ({label})"


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 10**6))
def test_a_flat_grid_splits_the_group_into_replicas_and_finds_each_rank(pp, dp, seed):
    ranks = random.Random(seed).sample(range(64), pp * dp)
    grid = Grid.flat(pp * dp, dp)
    assert (grid.pp, grid.dp, grid.tp, grid.sharding) == (pp, dp, 1, None)
    for group_rank, rank in enumerate(ranks):
        placed = grid.on_group(ranks, group_rank)
        assert placed.global_rank(placed.pipeline_rank, placed.dp_index) == rank
        name = placed.rank_name(placed.everyone.index(rank))
        if dp == 1:
            assert name == f"rank {rank}"
        else:
            assert name == f"rank {rank} (pipeline rank {group_rank % pp} of replica {group_rank // pp})"


def test_a_flat_grid_refuses_what_it_refused():
    for size, data_parallel, message in [
        (4, "fsdp", 'names how a mesh\'s "dp" dimension holds the parameters'),
        (4, 3, "data_parallel=3 does not divide the 4 ranks"),
        (4, 0, "data_parallel must be a positive integer"),
        (4, True, "data_parallel must be a positive integer"),
    ]:
        with pytest.raises(PipelineError) as error:
            Grid.flat(size, data_parallel)
        assert message in str(error.value)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 4),
    st.sampled_from(((1, 1, 1), (2, 1, 1), (4, 1, 1), (1, 2, 2), (1, 3, 2), (1, 2, 4))),
    st.integers(1, 4),
    st.sampled_from(("replicate", "fsdp", "hsdp")),
)
def test_a_mesh_text_is_the_planner_s_grid(pp, data, tp, mode):
    dp, replicate, shard = data
    parts = [f"pp={pp}", f"dp={dp}", f"tp={tp}"]
    if replicate * shard > 1:
        parts[1:2] = [f"dp_replicate={replicate}", f"dp_shard={shard}"]
    text = ",".join(parts)
    hsdp = replicate * shard > 1
    if (mode == "hsdp") != hsdp and not (mode == "replicate" and hsdp):
        with pytest.raises(ScheduleError, match="hsdp runs on dp_replicate= and dp_shard="):
            mesh_layout(parse_mesh(text), mode)
        return
    link = Link(1e-5, 1e9)
    grid = mesh_layout(parse_mesh(text), mode, link)
    replicas = dp * replicate * shard
    sharding = None if mode == "replicate" or replicas == 1 else mode
    assert grid == MeshLayout(
        dp=replicas,
        tp=tp,
        sharding=sharding,
        dp_shard=shard if sharding == "hsdp" else None,
        tp_link=link,
        dp_link=link,
        pp=pp,
    )
    assert grid.pp * grid.dp * grid.tp == pp * replicas * tp


def test_the_planner_s_checks_hold_without_a_mesh_and_a_stage_grid_applies_them():
    for kwargs, message in [
        ({"dp": 1, "sharding": "fsdp"}, "give dp ≥ 2"),
        ({"dp": 4, "sharding": "hsdp", "dp_shard": 3}, "proper divisor"),
        ({"dp": 2, "sharding": "zero3"}, "choose replicate, fsdp or hsdp"),
        ({"dp": 0}, "dp and tp must be at least 1"),
    ]:
        with pytest.raises(ScheduleError, match=message):
            Grid(**kwargs)
    one_replica = Grid.of_mesh(("pp", "dp"), (4, 1), data_parallel="fsdp")  # the runtime refuses it later
    assert one_replica.sharding == "fsdp"
    with pytest.raises(ScheduleError, match="give dp ≥ 2"):
        one_replica.stage_grid(parallelized=False)
    three_d = Grid.of_mesh(("pp", "dp", "tp"), (2, 2, 2), data_parallel="fsdp")
    assert three_d.stage_grid(parallelized=True) == Grid(dp=2, tp=2, sharding="fsdp", pp=2)
    assert three_d.stage_grid(parallelized=False).tp == 1
