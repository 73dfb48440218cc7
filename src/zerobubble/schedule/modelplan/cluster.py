"""A plan on paper for a cluster: the best (pp, dp, tp, schedule, microbatches) for a transformer.

``zerobubble plan --cluster nodes=N,gpus=8,intra=…,inter=… --model config.json --tokens-per-step T``
(``docs/auto-planning.md``, "A cluster on paper"):

* :class:`TransformerShape` reads a Hugging Face ``config.json`` (the sizes only);
* :func:`transformer_profile` writes the per-layer profile the planner takes from those sizes: times
  from FLOPs at :attr:`Cluster.efficiency` of the GPUs' peak, bytes from the parameter counts
  (bf16 weights and gradients, fp32 master weights and Adam moments: 16 bytes a parameter) and the
  activations of Korthikanti et al. (2022): ``34·s·b·h`` bytes a block with flash attention, ``2·s·b·h``
  with full recomputation, which then repeats the forward in B;
* :func:`plan_cluster` runs :func:`~.search.plan` on a :class:`~..grid.Grid` for every
  factorisation ``pp × dp × tp`` of the GPUs (tp within a node, :func:`cluster_grids`), the GPUs'
  memory as the budget, and orders the layouts by predicted tokens per second.

Everything here is a model: the efficiency is an input, not a measurement.  Pure Python; no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from ..ir import ScheduleError, check_positive
from .amounts import format_bytes, parse_bytes
from .choices import choose_comm, least_memory
from .kernels import BlockShape, Device, block_seconds, head_seconds
from .layout import Grid, Link
from .profile import LayerProfile, ModelProfile
from .result import Plan
from .search import plan, with_comm

GATED_MLP = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "mixtral")
"""``model_type`` values whose MLP has three matrices (gate, up, down); others have two."""

ROTARY = (*GATED_MLP, "gpt_neox", "falcon")
"""``model_type`` values with rotary position embedding (also any config with ``rope_theta``)."""

DROPOUTS = ("attention_dropout", "attn_pdrop", "hidden_dropout", "resid_pdrop", "dropout")
"""Config fields whose positive value means dropout runs (its masks are read and written)."""

DEFAULT_SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-v")
"""The schedules a cluster plan tries unless told (the memory-planned ones are slow at 1024 GPUs)."""


CALIBRATED_EFFICIENCY = 0.7129
"""The fraction of the datasheet the kernels sustain (:mod:`.kernels`), calibrated on one published
run: the first row of Narayanan et al. 2021, Table 1 (Megatron-LM's 1.7B); ``zerobubble plan
--published`` recomputes it (:func:`~.published.calibrate`), ``--anchors`` on every row in turn."""


@dataclass(frozen=True)
class Cluster:
    """``nodes`` × ``gpus`` GPUs: links within a node (``intra``) and between nodes (``inter``) in
    bytes/s a GPU, each GPU's peak ``flops``, the fraction of it a large matrix product sustains
    (``efficiency``), its ``memory`` in bytes, the ``latency`` of a message in seconds, its memory
    bandwidth ``hbm`` in bytes/s and its ``sms`` multiprocessors.  Unless told: an A100 80GB (312
    TFLOP/s bf16, 80 GiB, 2039 GB/s, 108 multiprocessors), :data:`CALIBRATED_EFFICIENCY` and 10 µs."""

    nodes: int
    gpus: int
    intra: float
    inter: float
    flops: float = 312e12
    memory: float = 80 * 2**30
    efficiency: float = CALIBRATED_EFFICIENCY
    latency: float = 1e-5
    hbm: float = 2.039e12
    sms: int = 108

    @property
    def size(self) -> int:
        """Every GPU."""
        return self.nodes * self.gpus

    def assumptions(self) -> dict[str, float]:
        """What the plan assumes of each GPU and link, JSON-ready (FLOP/s, bytes, bytes/s, seconds)."""
        return {
            "nodes": self.nodes,
            "gpus_per_node": self.gpus,
            "peak_flops": self.flops,
            "efficiency": self.efficiency,
            "memory_bytes": self.memory,
            "intra_node_bytes_per_second": self.intra,
            "inter_node_bytes_per_second": self.inter,
            "latency_seconds": self.latency,
            "memory_bandwidth_bytes_per_second": self.hbm,
            "multiprocessors": self.sms,
        }

    def device(self) -> Device:
        """One GPU as :mod:`.kernels` times it."""
        return Device(peak=self.flops, bandwidth=self.hbm, sms=self.sms, efficiency=self.efficiency)

    def describe(self) -> str:
        """Two lines: each GPU's assumed peak FLOP/s, matmul efficiency and memory; the links'
        bandwidths and latency.  A value is marked ``(default)`` where it is what :meth:`parse`
        assumes when the cluster text leaves it out."""

        def mark(name: str) -> str:
            return " (default)" if getattr(self, name) == _CLUSTER_DEFAULTS[name] else ""

        gpu = (
            f"assumed per GPU: {self.flops / 1e12:g} TFLOP/s peak{mark('flops')} × matmul efficiency "
            f"{self.efficiency:g}{mark('efficiency')} = {self.flops * self.efficiency / 1e12:g} TFLOP/s "
            f"for a large product; {self.hbm / 1e9:g} GB/s of memory bandwidth{mark('hbm')}, "
            f"{self.sms} multiprocessors{mark('sms')}; {format_bytes(self.memory)} of memory{mark('memory')}"
        )
        links = (
            f"assumed links: {self.intra / 1e9:g} GB/s a GPU within a node of {self.gpus}, "
            f"{self.inter / 1e9:g} GB/s a GPU between the {self.nodes} nodes; "
            f"{self.latency * 1e6:g} µs a message{mark('latency')}"
        )
        return f"{gpu}\n{links}"

    @classmethod
    def parse(cls, text: str) -> Cluster:
        """``"nodes=8,gpus=8,intra=300GB/s,inter=25GB/s[,flops=312e12,memory=80GiB,efficiency=0.5]"``."""
        fields: dict[str, Any] = {}
        for part in filter(None, (piece.strip() for piece in text.split(","))):
            name, _, value = part.partition("=")
            try:
                fields[name] = _cluster_value(name, value.strip())
            except (ValueError, ScheduleError) as error:
                raise ScheduleError(f"cluster {text!r}: {name}={value!r}: {error}") from None
        missing = [name for name in ("nodes", "gpus", "intra", "inter") if name not in fields]
        if missing:
            raise ScheduleError(
                f"cluster {text!r} lacks {', '.join(missing)}: e.g. nodes=8,gpus=8,intra=300GB/s,inter=25GB/s"
            )
        return cls(**fields)


_CLUSTER_DEFAULTS = {
    f.name: f.default
    for f in fields(Cluster)
    if f.name in ("flops", "memory", "efficiency", "latency", "hbm", "sms")
}
"""What :meth:`Cluster.parse` assumes for the fields a cluster text leaves out."""


def _cluster_value(name: str, value: str) -> Any:
    if name in ("nodes", "gpus", "sms"):
        if not value.isdigit() or int(value) < 1:
            raise ValueError("a positive integer")
        return int(value)
    if name in ("intra", "inter", "hbm"):
        return _rate(value)
    if name == "memory":
        return parse_bytes(value)
    if name in ("flops", "efficiency", "latency"):
        number = float(value.upper().replace("T", "e12"))
        if not math.isfinite(number) or number <= 0 or (name == "efficiency" and number > 1):
            raise ValueError("a positive number (efficiency at most 1)")
        return number
    raise ValueError(
        "unknown; the fields are nodes, gpus, intra, inter, flops, memory, efficiency, latency, hbm, sms"
    )


def _rate(value: str) -> float:
    """A link's bandwidth in bytes/s from ``"300GB/s"``: the unit must say bytes and per second."""
    if value[-2:].lower() != "/s":
        raise ValueError("a bandwidth needs a rate unit, bytes per second: e.g. 300GB/s or 25GB/s")
    amount = value[:-2].strip()
    if amount.endswith("b"):
        raise ValueError("b is bits; give bytes per second with a capital B, e.g. 25GB/s for 200Gb/s")
    try:
        rate = parse_bytes(amount)
    except ScheduleError:
        raise ValueError("a positive rate such as 25GB/s") from None
    assert rate is not None
    return rate


@dataclass(frozen=True)
class TransformerShape:
    """The sizes of a decoder-only transformer that its cost depends on."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    gated: bool
    rotary: bool = False
    dropout: bool = False
    flash: bool = True

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> TransformerShape:
        """From a Hugging Face ``config.json`` (Llama-, GPT-2-, NeoX-, OPT-, Falcon-style names)."""

        def first(*names: str) -> Any:
            return next((config[n] for n in names if config.get(n) is not None), None)

        hidden = first("hidden_size", "n_embd", "d_model")
        layers = first("num_hidden_layers", "n_layer", "num_layers")
        heads = first("num_attention_heads", "n_head")
        vocab = first("vocab_size")
        if None in (hidden, layers, heads, vocab):
            raise ScheduleError(
                "the model config needs hidden_size (n_embd), num_hidden_layers (n_layer), "
                "num_attention_heads (n_head) and vocab_size"
            )
        return cls(
            layers=int(layers),
            hidden=int(hidden),
            intermediate=int(first("intermediate_size", "n_inner", "ffn_dim") or 4 * hidden),
            heads=int(heads),
            kv_heads=int(first("num_key_value_heads", "num_kv_heads") or heads),
            vocab=int(vocab),
            gated=str(config.get("model_type", "")) in GATED_MLP,
            rotary=str(config.get("model_type", "")) in ROTARY or "rope_theta" in config,
            dropout=any(float(config.get(name) or 0) > 0 for name in DROPOUTS),
            flash=first("attn_implementation", "_attn_implementation") != "eager",
        )

    @property
    def block_parameters(self) -> int:
        """Parameters of one block: attention (q, o and the k, v of the kv heads), MLP, two norms."""
        h = self.hidden
        attention = 2 * h * h + 2 * h * (h * self.kv_heads // self.heads)
        return attention + (3 if self.gated else 2) * h * self.intermediate + 2 * h

    @property
    def parameters(self) -> int:
        """Every parameter (untied embedding and output layer)."""
        return self.layers * self.block_parameters + 2 * self.vocab * self.hidden

    def block(self, tokens: int, seq_len: int, tp: int) -> BlockShape:
        """One rank's share of a block at tensor parallelism ``tp`` (:mod:`.kernels`)."""
        return BlockShape(
            tokens=tokens,
            seq_len=seq_len,
            hidden=self.hidden,
            kv_hidden=self.hidden * self.kv_heads // self.heads,
            intermediate=self.intermediate,
            heads=self.heads,
            gated=self.gated,
            rotary=self.rotary,
            dropout=self.dropout,
            flash=self.flash,
            tp=tp,
        )

    def flops_per_token(self, seq_len: int) -> float:
        """Forward and backward FLOPs a token costs: ``6·N`` plus attention's ``12·L·h·s`` (the
        convention of Megatron's and torchtitan's MFU)."""
        return 6 * self.parameters + 12 * self.layers * self.hidden * seq_len


def transformer_profile(
    shape: TransformerShape,
    cluster: Cluster,
    seq_len: int,
    microbatch_size: int,
    recompute: bool,
    tp: int = 1,
) -> ModelProfile:
    """Per-layer costs of one microbatch (embedding, blocks, output layer) on one rank of ``tp``
    tensor-parallel ranks: times from :mod:`.kernels` with the tensor-parallel all-reduces (two in
    the forward, two in the backward, two more when it recomputes the forward) on the critical
    path; bytes of the whole layer (:meth:`~..grid.Grid.per_rank` divides them)."""
    tokens, h = seq_len * microbatch_size, shape.hidden
    device = cluster.device()
    forward, backward_input, backward_weight = block_seconds(shape.block(tokens, seq_len, tp), device)
    reduce = Grid.all_reduce(2.0 * tokens * h, tp, Link(cluster.latency, cluster.intra))
    forward += 2 * reduce
    backward_input += 2 * reduce + (forward if recompute else 0.0)

    def state(count: int) -> dict[str, float]:
        return {
            "parameter_bytes": 2.0 * count,
            "gradient_bytes": 2.0 * count,
            "optimizer_bytes": 12.0 * count,
        }

    # a cut after a block sends its output; split over the tp ranks' links (Megatron's scatter-gather)
    sent = 2.0 * tokens * h / tp
    blocks = LayerProfile(
        "block",
        forward=forward,
        backward_input=backward_input,
        backward_weight=backward_weight,
        activation_bytes=(2.0 if recompute else 34.0) * tokens * h,
        weight_input_bytes=32.0 * tokens * h,
        output_bytes=sent,
        **state(shape.block_parameters),
    )
    table = shape.vocab * h
    head_f, head_b, head_w = head_seconds(tokens, h, shape.vocab, tp, device)
    embedding = LayerProfile("embedding", 0.0, 0.0, 0.0, output_bytes=sent, **state(table))
    head = LayerProfile(
        "head", head_f, head_b, head_w, activation_bytes=6.0 * tokens * shape.vocab, **state(table)
    )
    # the embedding travels with the first block and the output layer with the last, as Megatron-LM
    # and torchtitan place them: the blocks split evenly over the stages is then a partition
    middle = [blocks] * shape.layers
    middle[0] = _together("embedding+block", embedding, middle[0])
    middle[-1] = _together(f"{middle[-1].name}+head", middle[-1], head)
    return ModelProfile(tuple(middle), comm_latency=cluster.latency, comm_bandwidth=cluster.inter)


def _together(name: str, first: LayerProfile, second: LayerProfile) -> LayerProfile:
    """Two consecutive layers as one: times and bytes summed, the second's output sent on."""
    summed = {
        key: getattr(first, key) + getattr(second, key)
        for key in (
            "forward", "backward_input", "backward_weight", "activation_bytes", "weight_input_bytes",
            "parameter_bytes", "gradient_bytes", "optimizer_bytes",
        )
    }  # fmt: skip
    return LayerProfile(name, output_bytes=second.output_bytes, **summed)


@dataclass(frozen=True)
class ClusterSearch:
    """How :func:`plan_cluster` searches each layout: the schedules tried, the chunk counts tried for
    interleaved 1F1B, the planner's cut moves (``refine``), and whether it chooses the sharding (else
    the grid's own); ``keep``: only the ``keep`` fastest layouts must be exact (:func:`plan_cluster`
    prunes the others), None: all; ``jobs``: processes planning the layouts' schedules at once (1: in
    this one; the result is the same)."""

    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    interleaved_chunks: tuple[int, ...] = (2,)
    refine: int = 4
    choose_sharding: bool = True
    keep: int | None = None
    jobs: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.jobs, bool) or not isinstance(self.jobs, int) or self.jobs < 1:
            raise ScheduleError(f"ClusterSearch(jobs={self.jobs!r}): a positive number of processes")


@dataclass(frozen=True)
class ClusterOption:
    """One layout of the cluster with its plan (None, and ``note``, when nothing fits): the step in
    seconds and the busiest GPU's bytes with the chosen ``data_parallel`` sharding
    (:mod:`.choices`), which ``reason`` explains; ``pruned``: not simulated (:func:`plan_cluster`)."""

    pp: int
    dp: int
    tp: int
    sharding: str | None
    microbatches: int
    plan: Plan | None
    tokens_per_second: float = 0.0
    mfu: float = 0.0
    hfu: float = 0.0
    note: str = ""
    step_time: float = 0.0
    memory: float = 0.0
    data_parallel: str = ""
    reason: str = ""
    ep: int = 1  # a mixture of experts' expert-parallel size (.moe)
    pruned: bool = False
    fits: bool = True  # False: no sharding keeps its peak within the budget; ``memory`` is the lowest

    @property
    def rank(self) -> tuple[bool, bool, float]:
        """Its place among the cluster's layouts: planned, then within the memory budget, then faster."""
        return (self.plan is None, not self.fits, self.step_time)

    def row(self) -> dict[str, Any]:
        """JSON-ready numbers."""
        winner = self.plan.winner if self.plan is not None else None
        return {
            "pp": self.pp,
            "dp": self.dp,
            "tp": self.tp,
            "ep": self.ep,
            "sharding": self.sharding or "replicate",
            "microbatches": self.microbatches,
            "schedule": winner.label if winner else None,
            "step_time": self.step_time if winner else None,
            "bubble_rate": winner.bubble_rate if winner else None,
            "memory_per_gpu": self.memory if winner else None,
            "data_parallel": self.data_parallel,
            "tokens_per_second_per_gpu": self.tokens_per_second,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "reason": self.reason,
            "note": self.note,
            "fits": self.fits,
        }


def plan_cluster(
    shape: TransformerShape,
    cluster: Cluster,
    tokens_per_step: int,
    seq_len: int,
    *,
    microbatch_size: int = 1,
    recompute: bool = False,
    layouts: Sequence[Grid] | None = None,
    search: ClusterSearch = ClusterSearch(),
) -> list[ClusterOption]:
    """Every layout of the cluster (:func:`cluster_grids`, FSDP2 where there are replicas) or those
    given (``pp``, ``dp``, ``tp`` and ``sharding`` of each grid read) planned, ranked by
    :attr:`ClusterOption.rank` (within the memory budget first, then fastest); each with the fastest
    sharding that fits (:mod:`.choices`), or, without ``search.choose_sharding``, the grid's own
    record (``grid.comm``, :class:`~..sharding.FSDPOptions`).  With ``search.keep`` the ``keep``
    fastest are exactly those of the full search; the others may be pruned
    (:func:`~.cluster_search.search_layouts`)."""
    check_positive(tokens_per_step=tokens_per_step, seq_len=seq_len, microbatch_size=microbatch_size)
    sequences, remainder = divmod(tokens_per_step, seq_len)
    if remainder or sequences < 1:
        raise ScheduleError(
            f"tokens per step {tokens_per_step} must be a multiple of the sequence length {seq_len}"
        )
    setting = _Setting(shape, cluster, sequences, seq_len, microbatch_size, recompute, search)
    grids = layouts if layouts is not None else cluster_grids(shape, cluster)
    from .cluster_search import search_layouts  # it builds on this module's planning steps

    options = search_layouts([(setting, grid) for grid in grids], search)
    # within the budget first, then by step (equal steps in the layouts' order), without rounding
    return sorted(options, key=lambda o: o.rank)


def cluster_grids(shape: TransformerShape, cluster: Cluster, sharding: str | None = "fsdp") -> list[Grid]:
    """Every ``pp × dp × tp`` grid of the cluster, tp dividing a node and the heads, pp the layers;
    the replicas held as ``sharding`` says (where there are several).

    The key-value heads are split over tp when it divides them, and each replicated over the ranks
    of its group when tp is a multiple of them (Megatron's rule for grouped-query attention)."""
    found = []
    for tp in _divisors(cluster.gpus):
        if shape.heads % tp or (shape.kv_heads % tp and tp % shape.kv_heads):
            continue
        for pp in _divisors(cluster.size // tp):
            if pp <= shape.layers:
                dp = cluster.size // (tp * pp)
                found.append(Grid(dp=dp, tp=tp, sharding=sharding if dp > 1 else None, pp=pp))
    return found


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class _Setting:
    """What every layout of one :func:`plan_cluster` call is planned with."""

    shape: TransformerShape
    cluster: Cluster
    sequences: int
    seq_len: int
    microbatch_size: int
    recompute: bool
    search: ClusterSearch

    def profile(self, tp: int) -> ModelProfile:
        """The per-layer profile of one rank of ``tp`` (:func:`transformer_profile`)."""
        return transformer_profile(
            self.shape, self.cluster, self.seq_len, self.microbatch_size, self.recompute, tp
        )


@dataclass(frozen=True)
class _Scheduled:
    """A layout whose schedule is planned, its communication not yet chosen."""

    grid: Grid
    layout: Grid
    staged: ModelProfile
    microbatches: int
    planned: Plan

    @property
    def bound(self) -> float:
        """No step of this plan is shorter: its busiest GPU's compute."""
        assert self.planned.winner.timeline is not None
        return self.planned.winner.timeline.ideal


def _scheduled(setting: _Setting, grid: Grid) -> _Scheduled | ClusterOption:
    """``grid``'s schedule planned (:func:`~.search.plan`, communication deferred), or why it has none."""
    cluster, pp, dp, tp, mode = setting.cluster, grid.pp, grid.dp, grid.tp, grid.sharding
    per_replica, left = divmod(setting.sequences, dp * setting.microbatch_size)
    if left or per_replica < 1:
        note = (
            f"{setting.sequences} sequences do not split into {dp} replicas of microbatches of "
            f"{setting.microbatch_size}"
        )
        return ClusterOption(pp, dp, tp, mode, 0, None, note=note)
    layout = _planned_grid(cluster, grid)
    profile = setting.profile(tp)
    pp_bandwidth = cluster.intra if pp * tp <= cluster.gpus else cluster.inter
    staged = ModelProfile(profile.layers, comm_latency=cluster.latency, comm_bandwidth=pp_bandwidth)
    try:
        chosen = plan(
            staged,
            pp,
            per_replica,
            cluster.memory,
            schedules=setting.search.schedules,
            interleaved_chunks=setting.search.interleaved_chunks,
            layout=layout,
            refine=setting.search.refine,
            defer_comm=True,
        )
    except ScheduleError as error:
        return ClusterOption(pp, dp, tp, mode, per_replica, None, note=str(error))
    return _Scheduled(grid, layout, staged, per_replica, chosen)


def _option(setting: _Setting, found: _Scheduled) -> ClusterOption:
    """``found`` with its communication chosen (:func:`~.choices.choose_comm`), timed and rated."""
    cluster, grid, layout = setting.cluster, found.grid, found.layout
    # one replica: nothing to choose, the lowering times the step all the same
    tried = None if setting.search.choose_sharding or layout.dp == 1 else [grid.comm]
    comm = choose_comm(
        layout, layout.per_rank(found.staged), found.planned.winner, budget=cluster.memory, candidates=tried
    )
    chosen = with_comm(found.planned, comm) if layout.dp > 1 else found.planned
    step, peak = comm.timeline.iteration_time, max(comm.timeline.peak_memory)
    tokens = setting.sequences * setting.seq_len / step / cluster.size
    mfu = tokens * setting.shape.flops_per_token(setting.seq_len) / cluster.flops
    # the FLOPs the GPUs run: with recomputation the forward twice (8 passes of the weights, not 6)
    hfu = mfu * (4 / 3 if setting.recompute else 1.0)
    return ClusterOption(
        grid.pp, grid.dp, grid.tp, grid.sharding, found.microbatches, chosen, tokens, mfu, hfu,
        step_time=step, memory=peak, data_parallel=comm.options.describe(layout.dp_mode),
        fits=peak <= cluster.memory * (1 + 1e-9),
        reason=comm.reason,
    )  # fmt: skip


def _planned_grid(cluster: Cluster, grid: Grid) -> Grid:
    """``grid`` with the cluster's links (a collective's slowest hop: within a node while its ranks
    fit in one), the profile's times taken as one tensor-parallel rank's, and the sharding that
    holds the least (:func:`~.choices.least_memory`)."""
    tp_link = Link(cluster.latency, cluster.intra)
    dp_link = Link(cluster.latency, cluster.intra if grid.size <= cluster.gpus else cluster.inter)
    timed = replace(grid, tp_link=tp_link, dp_link=dp_link, split_compute=False, tp_collectives=0)
    return least_memory(timed)


def layouts_from_mesh(
    sizes: Mapping[str, int], cluster: Cluster, sharding: str | None = "fsdp"
) -> list[Grid]:
    """``--mesh`` with ``--cluster``: the one grid it names (checked against the cluster's size), its
    replicas held as ``sharding`` says."""
    dp = sizes["dp"] * sizes["dp_replicate"] * sizes["dp_shard"]
    total = sizes["pp"] * dp * sizes["tp"]
    if total != cluster.size:
        raise ScheduleError(f"the mesh has {total} ranks but the cluster {cluster.size} GPUs")
    return [Grid(dp=dp, tp=sizes["tp"], sharding=sharding if dp > 1 else None, pp=sizes["pp"])]
