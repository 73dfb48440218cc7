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
from pathlib import Path
from typing import Any

from ..ir import ScheduleError, check_positive
from .amounts import format_bytes, parse_bytes
from .layout import Grid, Link
from .profile import LayerProfile, ModelProfile
from .result import Plan
from .search import plan

GATED_MLP = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "mixtral")
"""``model_type`` values whose MLP has three matrices (gate, up, down); others have two."""

DEFAULT_SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-v")
"""The schedules a cluster plan tries unless told (the memory-planned ones are slow at 1024 GPUs)."""


@dataclass(frozen=True)
class Cluster:
    """``nodes`` × ``gpus`` GPUs: links within a node (``intra``) and between nodes (``inter``) in
    bytes/s a GPU, each GPU's peak ``flops``, the fraction of it a transformer's matmuls reach
    (``efficiency``), its ``memory`` in bytes and the ``latency`` of a message in seconds.  Unless
    told: an A100's bf16 peak of 312 TFLOP/s, 80 GiB, efficiency 0.5 (an assumption, not a
    measurement: every predicted time scales with it) and 10 µs."""

    nodes: int
    gpus: int
    intra: float
    inter: float
    flops: float = 312e12
    memory: float = 80 * 2**30
    efficiency: float = 0.5
    latency: float = 1e-5

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
        }

    def describe(self) -> str:
        """Two lines: each GPU's assumed peak FLOP/s, matmul efficiency and memory; the links'
        bandwidths and latency.  A value is marked ``(default)`` where it is what :meth:`parse`
        assumes when the cluster text leaves it out."""

        def mark(name: str) -> str:
            return " (default)" if getattr(self, name) == _CLUSTER_DEFAULTS[name] else ""

        gpu = (
            f"assumed per GPU: {self.flops / 1e12:g} TFLOP/s peak{mark('flops')} × matmul efficiency "
            f"{self.efficiency:g}{mark('efficiency')} = {self.flops * self.efficiency / 1e12:g} TFLOP/s; "
            f"{format_bytes(self.memory)} of memory{mark('memory')}"
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
    f.name: f.default for f in fields(Cluster) if f.name in ("flops", "memory", "efficiency", "latency")
}
"""What :meth:`Cluster.parse` assumes for the fields a cluster text leaves out."""


def _cluster_value(name: str, value: str) -> Any:
    if name in ("nodes", "gpus"):
        if not value.isdigit() or int(value) < 1:
            raise ValueError("a positive integer")
        return int(value)
    if name in ("intra", "inter"):
        return _rate(value)
    if name == "memory":
        return parse_bytes(value)
    if name in ("flops", "efficiency", "latency"):
        number = float(value.upper().replace("T", "e12"))
        if not math.isfinite(number) or number <= 0 or (name == "efficiency" and number > 1):
            raise ValueError("a positive number (efficiency at most 1)")
        return number
    raise ValueError("unknown; the fields are nodes, gpus, intra, inter, flops, memory, efficiency, latency")


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

    def flops_per_token(self, seq_len: int) -> float:
        """Forward and backward FLOPs a token costs: ``6·N`` plus attention's ``12·L·h·s`` (the
        convention of Megatron's and torchtitan's MFU)."""
        return 6 * self.parameters + 12 * self.layers * self.hidden * seq_len


def transformer_profile(
    shape: TransformerShape, cluster: Cluster, seq_len: int, microbatch_size: int, recompute: bool
) -> ModelProfile:
    """Per-layer costs of one microbatch (embedding, blocks, output layer) on one GPU (module docstring)."""
    tokens, h = seq_len * microbatch_size, shape.hidden
    rate = cluster.flops * cluster.efficiency

    def state(count: int) -> dict[str, float]:
        return {
            "parameter_bytes": 2.0 * count,
            "gradient_bytes": 2.0 * count,
            "optimizer_bytes": 12.0 * count,
        }

    matmul = 2 * tokens * shape.block_parameters / rate  # one pass over the block's weights
    attention = 4 * tokens * seq_len * h / rate  # scores and their mix with v
    forward = matmul + attention
    block = LayerProfile(
        "block",
        forward=forward,
        backward_input=matmul + 2 * attention + (forward if recompute else 0.0),
        backward_weight=matmul,
        activation_bytes=(2.0 if recompute else 34.0) * tokens * h,
        weight_input_bytes=32.0 * tokens * h,
        output_bytes=2.0 * tokens * h,
        **state(shape.block_parameters),
    )
    table = shape.vocab * h
    head_pass = 2 * tokens * table / rate
    embedding = LayerProfile("embedding", 0.0, 0.0, 0.0, output_bytes=2.0 * tokens * h, **state(table))
    head = LayerProfile(
        "head", head_pass, head_pass, head_pass, activation_bytes=6.0 * tokens * shape.vocab, **state(table)
    )
    layers = (embedding, *(block for _ in range(shape.layers)), head)
    return ModelProfile(layers, comm_latency=cluster.latency, comm_bandwidth=cluster.inter)


@dataclass(frozen=True)
class ClusterOption:
    """One layout of the cluster with its plan (None, and ``note``, when nothing fits)."""

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

    def row(self) -> dict[str, Any]:
        """JSON-ready numbers."""
        winner = self.plan.winner if self.plan is not None else None
        return {
            "pp": self.pp,
            "dp": self.dp,
            "tp": self.tp,
            "sharding": self.sharding or "replicate",
            "microbatches": self.microbatches,
            "schedule": winner.label if winner else None,
            "step_time": winner.period if winner else None,
            "bubble_rate": winner.bubble_rate if winner else None,
            "memory_per_gpu": max(winner.peak_bytes) if winner else None,
            "tokens_per_second_per_gpu": self.tokens_per_second,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "note": self.note,
        }


def plan_cluster(
    shape: TransformerShape,
    cluster: Cluster,
    tokens_per_step: int,
    seq_len: int,
    *,
    microbatch_size: int = 1,
    recompute: bool = False,
    schedules: Sequence[str] = DEFAULT_SCHEDULES,
    layouts: Sequence[Grid] | None = None,
) -> list[ClusterOption]:
    """Every layout of the cluster (:func:`cluster_grids`, FSDP2 where there are replicas) or those
    given (``pp``, ``dp``, ``tp`` and ``sharding`` of each grid read) planned, fastest first."""
    check_positive(tokens_per_step=tokens_per_step, seq_len=seq_len, microbatch_size=microbatch_size)
    sequences, remainder = divmod(tokens_per_step, seq_len)
    if remainder or sequences < 1:
        raise ScheduleError(
            f"tokens per step {tokens_per_step} must be a multiple of the sequence length {seq_len}"
        )
    profile = transformer_profile(shape, cluster, seq_len, microbatch_size, recompute)
    setting = _Setting(profile, shape, cluster, sequences, seq_len, microbatch_size, schedules, recompute)
    grids = layouts if layouts is not None else cluster_grids(shape, cluster)
    return sorted((_option(setting, grid) for grid in grids), key=lambda o: -o.tokens_per_second)


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
            if pp <= shape.layers + 2:
                dp = cluster.size // (tp * pp)
                found.append(Grid(dp=dp, tp=tp, sharding=sharding if dp > 1 else None, pp=pp))
    return found


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class _Setting:
    """What every layout of one :func:`plan_cluster` call is planned with."""

    profile: ModelProfile
    shape: TransformerShape
    cluster: Cluster
    sequences: int
    seq_len: int
    microbatch_size: int
    schedules: Sequence[str]
    recompute: bool


def _option(setting: _Setting, grid: Grid) -> ClusterOption:
    cluster, pp, dp, tp, mode = setting.cluster, grid.pp, grid.dp, grid.tp, grid.sharding
    per_replica, left = divmod(setting.sequences, dp * setting.microbatch_size)
    if left or per_replica < 1:
        note = (
            f"{setting.sequences} sequences do not split into {dp} replicas of microbatches of "
            f"{setting.microbatch_size}"
        )
        return ClusterOption(pp, dp, tp, mode, 0, None, note=note)
    # a collective's slowest hop: within a node while its ranks fit in one
    tp_link = Link(cluster.latency, cluster.intra)
    dp_link = Link(cluster.latency, cluster.intra if pp * tp * dp <= cluster.gpus else cluster.inter)
    pp_bandwidth = cluster.intra if pp * tp <= cluster.gpus else cluster.inter
    layout = replace(grid, tp_link=tp_link, dp_link=dp_link)
    staged = ModelProfile(setting.profile.layers, comm_latency=cluster.latency, comm_bandwidth=pp_bandwidth)
    try:
        chosen = plan(
            staged, pp, per_replica, cluster.memory, schedules=setting.schedules, layout=layout, refine=4
        )
    except ScheduleError as error:
        return ClusterOption(pp, dp, tp, mode, per_replica, None, note=str(error))
    step = chosen.predicted_iteration_time
    tokens = setting.sequences * setting.seq_len / step / cluster.size
    mfu = tokens * setting.shape.flops_per_token(setting.seq_len) / cluster.flops
    # the FLOPs the GPUs run: with recomputation the forward twice (8 passes of the weights, not 6)
    hfu = mfu * (4 / 3 if setting.recompute else 1.0)
    return ClusterOption(pp, dp, tp, mode, per_replica, chosen, tokens, mfu, hfu)


def cluster_table(options: Sequence[ClusterOption], top: int) -> str:
    """The ``top`` fastest layouts as a text table, and how many fit nothing."""
    header = (
        "  pp   dp   tp  sharding   m  schedule            step s  bubble  memory/GPU  tok/s/GPU   MFU   HFU"
    )
    lines = [header]
    for option in [o for o in options if o.plan is not None][:top]:
        assert option.plan is not None and option.plan.winner.period is not None
        winner = option.plan.winner
        bubble = max(winner.bubble_rate or 0.0, 0.0)
        memory = format_bytes(max(winner.peak_bytes))
        lines.append(
            f"{option.pp:4d} {option.dp:4d} {option.tp:4d}  {option.sharding or 'replicate':9s}"
            f"{option.microbatches:4d}  {winner.label:16s} {winner.period:8.3f}  {bubble:6.1%}"
            f"  {memory:>10s} {option.tokens_per_second:10.0f} {option.mfu:6.1%} {option.hfu:5.1%}"
        )
    failed = sum(o.plan is None for o in options)
    if failed:
        lines.append(f"({failed} of {len(options)} layouts fit nothing or do not split the batch)")
    return "\n".join(lines)


def best_layout_text(options: Sequence[ClusterOption]) -> str:
    """One line on the winner, or why nothing runs."""
    fitting = [o for o in options if o.plan is not None]
    if not fitting:
        reasons = "; ".join(f"pp {o.pp} dp {o.dp} tp {o.tp}: {o.note}" for o in options[:3])
        raise ScheduleError(f"no layout of the cluster fits: {reasons}")
    best = fitting[0]
    assert best.plan is not None
    return (
        f"best: pp {best.pp} × dp {best.dp} ({best.sharding or 'replicate'}) × tp {best.tp}, "
        f"{best.plan.winner.label} with {best.microbatches} microbatches: {best.tokens_per_second:.0f} "
        f"tokens/s per GPU, MFU {best.mfu:.1%} (HFU {best.hfu:.1%})"
    )


def render_cluster_option(option: ClusterOption, path: str | Path) -> None:
    """Draw the schedule ``option`` chose (one pipeline replica's simulated timeline; SVG or PNG by
    the suffix of ``path``), titled with its layout."""
    if option.plan is None:
        raise ScheduleError(
            f"pp {option.pp} dp {option.dp} tp {option.tp} has no plan to draw: {option.note}"
        )
    winner = option.plan.winner
    title = (
        f"pp {option.pp} × dp {option.dp} ({option.sharding or 'replicate'}) × tp {option.tp}: "
        f"{winner.label}, {option.microbatches} microbatches, partition {list(option.plan.partition)}"
    )
    option.plan.render(path, title=title)


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
