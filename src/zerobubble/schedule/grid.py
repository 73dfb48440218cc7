"""The device layout, as one torch-free record: a :class:`Grid`.

A Pipeline runs on ``pp × dp × ep × tp`` ranks: ``pp`` pipeline ranks, ``dp`` data-parallel replicas
(HSDP: rows × ``dp_shard``), ``ep`` expert-parallel ranks (replicas too, holding disjoint experts),
``tp`` ranks inside each stage.  A :class:`Grid` holds those sizes, how
the replicas hold the parameters (``sharding``), which dimension of a ``DeviceMesh`` plays each role
(:data:`ROLES`), this rank's place once known (pipeline rank, replica, the ranks of the grid) and the
links the planner times collectives with.  Who reads it (``docs/architecture.md``):

* the planner (:func:`~.modelplan.plan`, ``plan --mesh``, ``plan --cluster``): the sizes, the
  links and the cost arithmetic of the methods :meth:`Grid.per_rank` .. :meth:`Grid.memory_text`
  (``docs/auto-planning.md``, "Planning on a mesh"); ``MeshLayout`` is its earlier name;
* the runtime: :meth:`Grid.of_mesh` / :meth:`Grid.flat` check the Pipeline's ``mesh=``,
  ``mesh_dims=`` and ``data_parallel=`` from the mesh's names and sizes alone, and
  ``runtime.parallel.data_parallel.build_layout`` creates every process group from the grid.

Pure Python; no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field, replace
from itertools import product
from typing import TYPE_CHECKING, Any

from ..errors import PipelineError, ScheduleError
from .sharding import ONCE_PER_STEP, FSDPOptions

if TYPE_CHECKING:
    from .modelplan.profile import LayerProfile, ModelProfile

ROLES = {
    "pp": "the pipeline: its stages, in rank order along the dimension",
    "dp": "the data-parallel replicas, replicated or FSDP2-sharded",
    "dp_replicate": "HSDP's rows, each holding the same shards",
    "dp_shard": "HSDP's (or FSDP2's) shards within a row",
    "tp": "tensor parallelism: ranks inside a stage, running parallelize's layers",
    "ep": "expert parallelism: replicas, each with its own batch, holding disjoint experts",
}
"""The roles a mesh dimension plays, by their default dimension name.  Every dimension that is not
the pipeline's, a data-parallel one nor the expert-parallel one lives inside a stage (``tp``, or any
the user adds).  The ``ep`` ranks are replicas of the pipeline (``Grid.replicas``): each runs its own
batch shard, the experts' tokens cross them by all-to-all, every other parameter is replicated."""

DATA_ROLES = ("dp", "dp_replicate", "dp_shard")
"""The data-parallel roles: one ``dp`` dimension, or HSDP's ``dp_replicate × dp_shard`` pair."""

SHARDINGS = (None, "fsdp", "hsdp")
"""How data-parallel replicas hold the parameters: None (replicated, gradients all-reduced),
``"fsdp"`` (FSDP2: sharded over every replica) or ``"hsdp"`` (FSDP2 on a 2-D data-parallel mesh:
sharded along ``dp_shard``, replicated along ``dp_replicate``)."""

DATA_PARALLEL_MODES = ("replicate", "fsdp", "hsdp")
"""The same, as the Pipeline's ``data_parallel=`` on a mesh and the command line name them."""

TP_ACTIVATION_SHARE = 24 / 34
"""The share of a transformer block's activations that tensor parallelism divides: 24 of the
``34·s·b·h`` bytes per block that Korthikanti et al. (2022, "Reducing Activation Recomputation in
Large Transformer Models", eq. 2) count without the attention scores."""


@dataclass(frozen=True)
class Link:
    """A collective's link: ``latency + bytes / bandwidth`` seconds per message (bandwidth 0: no
    size term)."""

    latency: float = 0.0
    bandwidth: float = 0.0

    def time(self, volume: float) -> float:
        """Seconds for ``volume`` bytes on the link (0 for none)."""
        if volume <= 0:
            return 0.0
        return self.latency + (volume / self.bandwidth if self.bandwidth > 0 else 0.0)


@dataclass(frozen=True)
class Grid:
    """The ``pp × dp × ep × tp`` ranks of a Pipeline, and this rank's place among them (module docstring).

    ``dp`` counts every data-parallel replica (HSDP: rows × ``dp_shard``); ``sharding`` is None
    (replicated), ``"fsdp"`` (sharded over all ``dp``) or ``"hsdp"`` (sharded over ``dp_shard``,
    replicated across the rows); ``tp_link`` and ``dp_link`` time the planner's collectives.  On a
    mesh, ``dims`` lists its dimensions ``(name, size)`` in order and ``roles`` the ``(role, name)``
    of each role it has.  Once placed, ``span`` lists the grid's global ranks in group-rank order
    (``dp_index · pp + pipeline_rank``), ``everyone`` every rank of the Pipeline (on a mesh, those
    inside the stages too) and ``labels`` names a global rank by its mesh coordinates.
    """

    dp: int = 1
    tp: int = 1
    sharding: str | None = None
    dp_shard: int | None = None
    tp_link: Link = Link()
    dp_link: Link = Link()
    tp_collectives: int = 2
    tp_activation_share: float = TP_ACTIVATION_SHARE
    _: KW_ONLY
    pp: int = 1
    dims: tuple[tuple[str, int], ...] = ()
    roles: tuple[tuple[str, str], ...] = ()
    pipeline_rank: int = 0
    dp_index: int = 0
    span: tuple[int, ...] = ()
    everyone: tuple[int, ...] = ()
    labels: Mapping[int, str] = field(default_factory=dict, compare=False)
    # how the replicas communicate (sharding.FSDPOptions: units, resharding, prefetch, buckets),
    # read by the planner's closed form (modelplan/sharding.py); ``split_compute`` False: the
    # profile's times are already one tensor-parallel rank's (collectives included)
    comm: FSDPOptions = ONCE_PER_STEP
    split_compute: bool = True

    def __post_init__(self) -> None:
        if self.dp < 1 or self.tp < 1:
            raise ScheduleError(f"dp and tp must be at least 1, got dp={self.dp}, tp={self.tp}")
        if self.sharding not in SHARDINGS:
            raise ScheduleError(f"sharding {self.sharding!r}: choose replicate, fsdp or hsdp")
        if not self.dims:  # a mesh's grid keeps what its sizes say; the runtime checks it (check_sharding)
            _check_planned_sharding(self)

    # -- constructors --------------------------------------------------------------------------------

    @classmethod
    def flat(cls, world_size: int, data_parallel: int | str | None) -> Grid:
        """``world_size`` ranks running ``data_parallel`` pipeline replicas (None: 1), no mesh."""
        if isinstance(data_parallel, str):
            raise PipelineError(
                f'data_parallel={data_parallel!r} names how a mesh\'s "dp" dimension holds the parameters: '
                'pass mesh=init_device_mesh(..., mesh_dim_names=("pp", "dp")) too, or an integer '
                "replica count"
            )
        replicas = 1 if data_parallel is None else data_parallel
        return cls(dp=replicas, pp=pipeline_size_of(world_size, replicas))

    @classmethod
    def of_mesh(
        cls,
        dim_names: Sequence[str],
        dim_sizes: Sequence[int],
        *,
        roles: Mapping[str, str] | None = None,
        data_parallel: int | str | None = None,
    ) -> Grid:
        """The grid of a mesh with these dimensions, ``roles`` mapping a role to a dimension name
        (``mesh_dims=``) and ``data_parallel`` ``"replicate"`` (None), ``"fsdp"``, ``"hsdp"`` or the
        mesh's replica count; refuses what does not fit with :class:`PipelineError`."""
        role_dims = mesh_roles(dim_names, roles)
        sizes = dict(zip(dim_names, map(int, dim_sizes)))
        data = _data_dims(role_dims)
        replicas = math.prod(sizes[name] for name in data)
        sharding = _sharding_of(data_parallel, role_dims, list(dim_names), replicas)
        shard = role_dims["dp_shard"]
        outside = {role_dims["pp"], role_dims["ep"], *data}
        inside = [size for name, size in sizes.items() if name not in outside]
        return cls(
            dp=replicas,
            tp=math.prod(inside),
            sharding=sharding,
            dp_shard=sizes[shard] if sharding == "hsdp" and shard is not None else None,
            pp=sizes[str(role_dims["pp"])],
            dims=tuple(sizes.items()),
            roles=tuple((role, name) for role, name in role_dims.items() if name is not None),
        )

    # -- what it is ----------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Every rank of the grid: ``pp · dp · ep · tp``."""
        return self.pp * self.replicas * self.tp

    @property
    def replicas(self) -> int:
        """The pipeline replicas, each running its own share of the batch: ``dp · ep`` (the
        expert-parallel ranks are replicas whose experts differ, :data:`ROLES`)."""
        return self.dp * self.ep

    @property
    def shard(self) -> int:
        """Ranks a parameter is cut over (1: replicated)."""
        if self.sharding == "hsdp":
            return self.dp_shard or self.dp
        return self.dp if self.sharding == "fsdp" else 1

    @property
    def dp_mode(self) -> str:
        """How the replicas communicate: ``"none"`` (one replica), ``"replicate"`` (gradients
        all-reduced) or ``"fsdp"`` (parameters sharded: FSDP, and HSDP across rows too)."""
        if self.dp == 1:
            return "none"
        return "replicate" if self.shard == 1 else "fsdp"

    @property
    def trivial(self) -> bool:
        """One rank per stage: nothing to change."""
        return self.replicas == 1 and self.tp == 1

    def describe(self) -> str:
        """``dp 4 (HSDP, 2 rows × 2 shards) × tp 2``."""
        mode = {None: "replicated", "fsdp": "FSDP2"}.get(self.sharding)
        if mode is None:
            mode = f"HSDP, {self.dp // self.shard} rows × {self.shard} shards"
        if self.ep > 1:  # the ep ranks are replicas too: "dp 2 × ep 2 (FSDP2)", "ep 2 (replicated)"
            replicas = f"dp {self.dp} × ep {self.ep}" if self.dp > 1 else f"ep {self.ep}"
            return f"{replicas} ({mode}) × tp {self.tp}"
        return f"dp {self.dp} ({mode}) × tp {self.tp}"

    @property
    def ep(self) -> int:
        """The size of the mesh's expert-parallel dimension (1 without one): with ``ep > 1`` the
        lowering gives every F and B its all-to-all on the rank's ``ep`` link, and the runtime shards
        the experts over it (``docs/runtime.md``, "Expert parallelism")."""
        name = self.dim("ep")
        return dict(self.dims).get(name, 1) if name is not None else 1

    def dim(self, role: str) -> str | None:
        """The name of the mesh dimension playing ``role`` (None: no mesh, or none plays it)."""
        return dict(self.roles).get(role)

    @property
    def data_dims(self) -> tuple[str, ...]:
        """The data-parallel dimensions, outermost first: ``(dp,)``, ``(dp_replicate, dp_shard)``
        (either alone when the mesh has only one of them), or none."""
        return _data_dims(dict(self.roles))

    @property
    def replica_dims(self) -> tuple[str, ...]:
        """The dimensions the pipeline replicas run along, outermost first: :attr:`data_dims`, then
        the expert-parallel one (the replica index is row-major over them)."""
        ep = self.dim("ep")
        return self.data_dims + ((ep,) if ep is not None else ())

    def stage_grid(self, *, parallelized: bool) -> Grid:
        """What the planner plans each stage on: the replicas and how they hold the parameters, and
        the ranks inside a stage when ``parallelize`` runs its layers over them (else 1: each runs
        whole layers).  The planner's checks apply (:class:`ScheduleError`)."""
        tp = self.tp if parallelized else 1
        # FSDP2 beside "ep" shards over every replica; the planner counts the experts alike (exact
        # with no "dp" dimension: they are cut over "ep"; with one, their share is dp times more)
        dp = self.replicas if self.sharding and self.ep > 1 else self.dp
        return Grid(dp=dp, tp=tp, sharding=self.sharding, dp_shard=self.dp_shard, pp=self.pp)

    # -- this rank's place -----------------------------------------------------------------------------

    def on_group(self, ranks: Sequence[int], group_rank: int) -> Grid:
        """Placed at ``group_rank`` of a process group of global ``ranks`` (no mesh): replica
        ``group_rank // pp``."""
        dp_index, pipeline_rank = divmod(group_rank, self.pp)
        span = tuple(int(rank) for rank in ranks)
        return replace(
            self, pipeline_rank=pipeline_rank, dp_index=dp_index, span=span, everyone=tuple(sorted(span))
        )

    def on_mesh(self, ranks: Sequence[int], coordinate: Sequence[int]) -> Grid:
        """Placed at ``coordinate`` of a mesh whose global ``ranks`` are listed row-major over
        :attr:`dims`: its pipeline along the ``pp`` dimension, its replicas along the data-parallel
        ones (replica index row-major over them), at its own coordinates on every other dimension.
        Pipeline rank ``r`` is the ``r``-th lowest global rank along the pipeline dimension (the rank
        order of the mesh's own pipeline group); the expert-parallel ranks are replicas too."""
        names, shape = [name for name, _ in self.dims], [size for _, size in self.dims]
        strides = [math.prod(shape[axis + 1 :]) for axis in range(len(shape))]

        def at(index: Sequence[int]) -> int:
            return int(ranks[sum(i * stride for i, stride in zip(index, strides))])

        pp_axis = names.index(str(self.dim("pp")))
        data_axes = [names.index(name) for name in self.replica_dims]

        def line(data_index: tuple[int, ...]) -> list[int]:
            index = list(coordinate)
            for axis, i in zip(data_axes, data_index):
                index[axis] = i
            return sorted(at([*index[:pp_axis], r, *index[pp_axis + 1 :]]) for r in range(shape[pp_axis]))

        columns = list(product(*(range(shape[axis]) for axis in data_axes)))  # row-major: the replica order
        dp_index = columns.index(tuple(coordinate[axis] for axis in data_axes))
        span = tuple(rank for column in columns for rank in line(column))
        replica = span[dp_index * self.pp : (dp_index + 1) * self.pp]
        labels = {
            at(index): ", ".join(f"{name} {i}" for name, i in zip(names, index))
            for index in product(*(range(n) for n in shape))
        }
        return replace(
            self,
            pipeline_rank=replica.index(at(coordinate)),
            dp_index=dp_index,
            span=span,
            everyone=tuple(sorted(labels)),
            labels=labels,
        )

    def global_rank(self, pipeline_rank: int, dp_index: int | None = None) -> int:
        """The global rank of ``pipeline_rank`` in replica ``dp_index`` (this rank's replica by default)."""
        replica = self.dp_index if dp_index is None else dp_index
        return self.span[replica * self.pp + pipeline_rank]

    def rank_name(self, group_rank: int) -> str:
        """How messages name the rank at position ``group_rank`` of :attr:`everyone` (the call check's
        group): its global rank, with its mesh coordinates or its replica where there are several."""
        rank = self.everyone[group_rank] if self.everyone else group_rank
        if rank in self.labels:
            return f"rank {rank} ({self.labels[rank]})"
        if self.replicas == 1:
            return f"rank {rank}"
        replica, pipeline_rank = divmod(self.span.index(rank), self.pp)
        return f"rank {rank} (pipeline rank {pipeline_rank} of replica {replica})"

    def replica_ranks(self, dp_index: int) -> list[int]:
        """Global ranks of replica ``dp_index`` in pipeline-rank order."""
        return [self.global_rank(r, dp_index) for r in range(self.pp)]

    # -- the planner's arithmetic: one rank's share of a layer (modelplan/layout.py's docstring) ------

    def per_rank(self, profile: ModelProfile) -> ModelProfile:
        """``profile`` as one rank computes it: tensor-parallel times and activations (the bytes a
        rank holds whatever the schedule does are :meth:`static_bytes`)."""
        if self.tp == 1:
            return profile
        return replace(profile, layers=tuple(self._tensor_parallel(layer) for layer in profile.layers))

    def _tensor_parallel(self, layer: LayerProfile) -> LayerProfile:
        t = self.tp if self.split_compute else 1
        reduce = self.tp_collectives * self.all_reduce(layer.output_bytes, self.tp, self.tp_link)
        kept = 1 - self.tp_activation_share + self.tp_activation_share / self.tp
        return replace(
            layer,
            forward=layer.forward / t + reduce,
            backward_input=layer.backward_input / t + reduce,
            backward_weight=layer.backward_weight / t,
            backward_fused=layer.backward_fused / t + reduce if layer.backward_fused > 0 else 0.0,
            activation_bytes=layer.activation_bytes * kept,
            weight_input_bytes=layer.weight_input_bytes * kept,
        )

    def static_bytes(self, layer: LayerProfile) -> float:
        """The most parameter, gradient and optimizer-state bytes of ``layer`` one rank holds in a step
        (with FSDP units: its shards; the units in flight are :meth:`held_bytes`'s)."""
        p, g, o = (
            value / self.tp for value in (layer.parameter_bytes, layer.gradient_bytes, layer.optimizer_bytes)
        )
        s = self.shard
        if s == 1:
            return p + g + o
        if self.comm.resharded:
            return (p + g + o) / s
        return p * (1 + 1 / s) + g + o / s

    def held_bytes(self, layers: Sequence[LayerProfile]) -> float:
        """The most parameter, gradient and optimizer-state bytes a rank holding ``layers`` keeps in a
        step: the sum of :meth:`static_bytes`, or with FSDP units their shards and the units in flight."""
        if self.comm.resharded and self.shard > 1:
            from .modelplan.sharding import unit_held_bytes  # modelplan imports this module

            return unit_held_bytes(self, layers)
        return math.fsum(self.static_bytes(layer) for layer in layers)

    def resident_bytes(self, layer: LayerProfile) -> float:
        """The bytes of ``layer`` one rank keeps between steps (sharded)."""
        return layer.static_bytes / (self.tp * self.shard)

    def step_seconds(self, layers: Sequence[LayerProfile], chunks: int = 1, microbatches: int = 1) -> float:
        """The data-parallel collectives of one step for a rank holding ``layers`` in ``chunks``
        chunks: FSDP's all-gather and reduce-scatter (HSDP: and the rows' all-reduce), or the
        replicated all-reduce; one message per chunk, all exposed.  With FSDP units or buckets, the
        part not hidden behind the ``microbatches``' compute (``modelplan/sharding.py``)."""
        if self.dp == 1:
            return 0.0
        if (self.comm.resharded and self.shard > 1) or (self.comm.bucket_bytes and self.shard == 1):
            from .modelplan import sharding  # modelplan imports this module: not at its top

            if self.shard > 1:
                return sharding.unit_step_seconds(self, layers, chunks, microbatches)
            return sharding.bucket_step_seconds(self, layers)
        params = math.fsum(layer.parameter_bytes for layer in layers) / self.tp
        grads = math.fsum(layer.gradient_bytes for layer in layers) / self.tp
        link, s = self.dp_link, self.shard
        if s == 1:
            return chunks * self.all_reduce(grads / chunks, self.dp, link)
        rows = self.dp // s
        gather = link.time((s - 1) / s * params / chunks)
        scatter = link.time((s - 1) / s * grads / chunks)
        return chunks * (gather + scatter + self.all_reduce(grads / s / chunks, rows, link))

    @staticmethod
    def all_reduce(size: float, ranks: int, link: Link) -> float:
        """A ring all-reduce of ``size`` bytes over ``ranks`` ranks: ``2(n−1)/n`` of it crosses each link."""
        return link.time(2 * (ranks - 1) / ranks * size) if ranks > 1 else 0.0

    def memory_text(self, layers: Sequence[LayerProfile], peak: float) -> str:
        """What a rank holding ``layers`` keeps, for a plan's reason."""
        from .modelplan.amounts import format_bytes  # modelplan imports this module: not at its top

        static = self.held_bytes(layers)
        resident = math.fsum(self.resident_bytes(layer) for layer in layers)
        return (
            f"on {self.describe()} the busiest rank holds {format_bytes(peak)} at its peak: "
            f"{format_bytes(static)} of parameters, gradients and optimizer state in the step "
            f"({format_bytes(resident)} between steps) and {format_bytes(peak - static)} of activations"
        )


# -- the checks, on names and sizes alone ----------------------------------------------------------------


def _check_planned_sharding(grid: Grid) -> None:
    """Sharding needs replicas to shard over; HSDP a proper split of them into rows × shards."""
    if grid.sharding is not None and grid.dp < 2:
        raise ScheduleError(f"{grid.sharding} shards over the data-parallel ranks: give dp ≥ 2")
    shard = grid.dp_shard
    if grid.sharding == "hsdp" and (shard is None or shard < 2 or grid.dp % shard or shard == grid.dp):
        raise ScheduleError(
            f"hsdp needs dp_shard ≥ 2, a proper divisor of dp={grid.dp} (got {grid.dp_shard}): "
            "dp = dp_replicate × dp_shard"
        )


def pipeline_size_of(size: int, data_parallel: Any) -> int:
    """Ranks per pipeline replica when ``size`` ranks run ``data_parallel`` replicas (checked)."""
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise PipelineError(f"data_parallel must be a positive integer, got {data_parallel!r}")
    if size % data_parallel:
        raise PipelineError(
            f"data_parallel={data_parallel} does not divide the {size} ranks of the process group; "
            f"start a multiple of {data_parallel} ranks (pipeline size × data_parallel)"
        )
    return size // data_parallel


def mesh_roles(dim_names: Sequence[str], names: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """Which of the mesh's dimensions plays each role (None where none does); ``names`` maps a role
    to a dimension name (``mesh_dims=``).  Raises :class:`PipelineError` for what does not fit."""
    given = dict(names or {})
    unknown = sorted(set(given) - set(ROLES))
    if unknown:
        raise PipelineError(f"mesh_dims: unknown roles {unknown}; the roles are {list(ROLES)}")
    dims = tuple(dim_names)
    if not dims:
        raise PipelineError(
            "mesh= needs a DeviceMesh with named dimensions: "
            'init_device_mesh(device_type, (pp, dp), mesh_dim_names=("pp", "dp"))'
        )
    chosen = {role: given.get(role, role) for role in ROLES}
    if chosen["pp"] not in dims:
        raise PipelineError(
            f"the mesh's dimensions are {list(dims)}: none is named {chosen['pp']!r} for the pipeline; "
            'name one "pp" or pass mesh_dims={"pp": <its name>}'
        )
    for role in ROLES:
        if role != "pp" and role in given and chosen[role] not in dims:
            raise PipelineError(
                f"mesh_dims: the mesh has no dimension {chosen[role]!r} (it has {list(dims)})"
            )
    picked = [name for name in chosen.values() if name in dims]
    if len(set(picked)) != len(picked):
        raise PipelineError(f"mesh_dims: one dimension cannot play two roles ({chosen})")
    present: dict[str, str | None] = {role: name if name in dims else None for role, name in chosen.items()}
    if present["dp"] is not None and (present["dp_replicate"] or present["dp_shard"]):
        raise PipelineError(
            f"the mesh's dimensions are {list(dims)}: the data-parallel replicas run along one "
            f'"dp" dimension or along the pair "dp_replicate" × "dp_shard" (HSDP), not both'
        )
    return present


def _data_dims(roles: Mapping[str, str | None]) -> tuple[str, ...]:
    """The data-parallel dimensions of ``roles`` (:attr:`Grid.data_dims`)."""
    if roles.get("dp") is not None:
        return (str(roles["dp"]),)
    return tuple(name for name in (roles.get("dp_replicate"), roles.get("dp_shard")) if name is not None)


def _sharding_of(
    data_parallel: int | str | None, roles: Mapping[str, str | None], names: list[str], replicas: int
) -> str | None:
    """The sharding ``data_parallel`` asks of a mesh with these ``roles`` (checked against them)."""
    if data_parallel is None or data_parallel in DATA_PARALLEL_MODES:
        sharding = None if data_parallel in (None, "replicate") else str(data_parallel)
        _check_data_dims(sharding, roles, names)
        return sharding
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel != replicas:
        along = " × ".join(_data_dims(roles)) or "no data-parallel dimension"
        raise PipelineError(
            f'data_parallel={data_parallel!r} with mesh=: pass "replicate" (the default), "fsdp" or '
            f'"hsdp"; the replica count comes from the mesh ({replicas} along {along})'
        )
    return None


def _check_data_dims(sharding: str | None, roles: Mapping[str, str | None], names: list[str]) -> None:
    """``"fsdp"`` needs one data-parallel dimension to shard over (or an ``"ep"`` one, whose ranks
    are replicas too), ``"hsdp"`` the pair."""
    replicate, shard = roles.get("dp_replicate"), roles.get("dp_shard")
    over = _data_dims(roles) or ((roles["ep"],) if roles.get("ep") is not None else ())
    if sharding == "fsdp" and (len(over) != 1 or replicate is not None):
        hint = (
            'the mesh has "dp_replicate" × "dp_shard": pass data_parallel="hsdp" to shard within '
            "a row and replicate across rows"
            if replicate is not None and shard is not None
            else "add a \"dp\" dimension (or name it with mesh_dims={'dp': ...})"
        )
        raise PipelineError(
            'data_parallel="fsdp" shards over the mesh\'s one data-parallel dimension ("dp" or '
            f'"dp_shard"), but the mesh has {names}: {hint}'
        )
    if sharding == "hsdp" and (replicate is None or shard is None):
        raise PipelineError(
            'data_parallel="hsdp" shards along "dp_shard" and replicates along "dp_replicate", but the '
            f'mesh has {names}: build it with mesh_dim_names=("pp", "dp_replicate", "dp_shard"[, "tp"]) '
            "(or name them with mesh_dims={'dp_replicate': ..., 'dp_shard': ...})"
        )
