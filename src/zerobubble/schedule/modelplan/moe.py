"""Mixture-of-experts models on paper: their sizes, per-layer costs, expert all-to-all and ep sizes.

``zerobubble plan --cluster … --model mixtral-8x7b`` (or a config with ``num_local_experts`` /
``n_routed_experts``, or ``--moe-experts N --moe-top-k K``; ``docs/auto-planning.md``, "Mixture of
experts"):

* :class:`MoEShape` — a :class:`~.cluster.TransformerShape` with routed experts, top-k, shared
  experts, the experts' FFN width and the dense layers before the first MoE layer; its total and
  active parameters and the FLOPs a token costs;
* :func:`moe_profile` — per-layer costs of one rank of ``tp × ep``: a MoE block's attention, router,
  shared and routed experts (the rank's ``experts/ep`` as grouped products), its parameters (routed
  experts divided over ``ep``) and the expert all-to-all of one F (and as much again of one B),
  dispatch plus combine (:func:`all_to_all_seconds`), which the planner passes on as ``CostModel.a2a``;
* :func:`plan_moe_cluster` — :func:`~.cluster.plan_cluster` over every layout × every ``ep`` that
  divides the experts and the data-parallel ranks (torchtitan's ep borrows ranks from dp), with
  ``dualpipe-v`` among the schedules; :func:`moe_reason` says how much all-to-all the winner hides.

Pure Python; no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..ir import Kind, ScheduleError
from .cluster import (
    DEFAULT_SCHEDULES,
    Cluster,
    ClusterOption,
    ClusterSearch,
    TransformerShape,
    _Setting,
    cluster_grids,
    transformer_profile,
)
from .cluster_search import search_layouts
from .kernels import GEMM_LATENCY, block_seconds, gemm_seconds, head_seconds
from .layout import Grid, Link
from .profile import LayerProfile, ModelProfile
from .result import Plan, PlanCandidate

MOE_SCHEDULES = (*DEFAULT_SCHEDULES, "dualpipe-v")
"""The schedules a MoE cluster plan tries: the dense ones and ``dualpipe-v``, whose overlapped F&B
pairs hide the expert all-to-all (it stays out of the dense search: :data:`~..compare.SLOW_SCHEDULES`)."""

PRESETS: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": {
        "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
        "vocab_size": 32000, "rope_theta": 1e6, "num_local_experts": 8, "num_experts_per_tok": 2,
    },
    "deepseek-v3-like": {
        "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_attention_heads": 128, "num_key_value_heads": 128,
        "num_hidden_layers": 61, "vocab_size": 129280, "rope_theta": 1e4, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
        "v_head_dim": 128,
    },
}  # fmt: skip
"""``--model`` names: the sizes of published Hugging Face configs.  ``deepseek-v3-like`` has
DeepSeek-V3's sizes and parameter count (multi-head latent attention's included), but its attention
is timed as multi-head attention of the same width, and it has no multi-token prediction module."""

_EXPERT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")


@dataclass(frozen=True)
class MoEShape(TransformerShape):
    """A decoder-only transformer whose blocks after the first ``dense_layers`` route each token to
    ``top_k`` of ``experts`` FFNs of width ``expert_intermediate`` (gated as the dense MLP is), beside
    ``shared_experts`` FFNs of that width every token runs; the dense blocks keep ``intermediate``."""

    experts: int = 8
    top_k: int = 2
    shared_experts: int = 0
    expert_intermediate: int = 0
    dense_layers: int = 0

    def __post_init__(self) -> None:
        if self.experts < 1 or not 1 <= self.top_k <= self.experts:
            raise ScheduleError(f"a MoE needs 1 ≤ top-k ≤ experts, got top-k {self.top_k} of {self.experts}")
        if not 0 <= self.dense_layers < self.layers or self.shared_experts < 0:
            raise ScheduleError(
                f"dense layers must be 0 to {self.layers - 1} and shared experts at least 0, got "
                f"{self.dense_layers} and {self.shared_experts}"
            )
        if self.expert_intermediate <= 0:
            object.__setattr__(self, "expert_intermediate", self.intermediate)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> MoEShape:
        """From a Hugging Face config with experts (Mixtral's ``num_local_experts``, DeepSeek's
        ``n_routed_experts``, ``n_shared_experts``, ``moe_intermediate_size``, ``first_k_dense_replace``)."""
        experts = next((config[k] for k in _EXPERT_KEYS if config.get(k)), None)
        if experts is None:
            raise ScheduleError("the model config names no experts (n_routed_experts or num_local_experts)")
        dense = TransformerShape.from_config(config)
        deepseek = "deepseek" in str(config.get("model_type", ""))
        return cls(
            **{**asdict(dense), "gated": dense.gated or deepseek},
            experts=int(experts),
            top_k=int(config.get("num_experts_per_tok") or 1),
            shared_experts=int(config.get("n_shared_experts") or 0),
            expert_intermediate=int(config.get("moe_intermediate_size") or dense.intermediate),
            dense_layers=int(config.get("first_k_dense_replace") or 0),
            latent_attention=latent_attention_parameters(config),
        )

    @property
    def moe_layers(self) -> int:
        """The blocks with experts."""
        return self.layers - self.dense_layers

    @property
    def expert_parameters(self) -> int:
        """One expert FFN."""
        return (3 if self.gated else 2) * self.hidden * self.expert_intermediate

    latent_attention: int = 0

    @property
    def attention_parameters(self) -> int:
        """A block's attention and its two norms: ``latent_attention`` where given (DeepSeek's
        multi-head latent attention, :func:`latent_attention_parameters`), else grouped-query."""
        if self.latent_attention:
            return self.latent_attention + 2 * self.hidden
        return super().block_parameters - (3 if self.gated else 2) * self.hidden * self.intermediate

    @property
    def block_parameters(self) -> int:
        """A dense block: attention, MLP of width ``intermediate``, two norms."""
        return self.attention_parameters + (3 if self.gated else 2) * self.hidden * self.intermediate

    def moe_block_parameters(self, *, active: bool = False) -> int:
        """A MoE block: attention, router, shared experts and every routed expert (``active``: top-k)."""
        routed = self.top_k if active else self.experts
        return (
            self.attention_parameters
            + self.hidden * self.experts
            + (routed + self.shared_experts) * self.expert_parameters
        )

    @property
    def parameters(self) -> int:
        """Every parameter (untied embedding and output layer)."""
        dense = self.dense_layers * self.block_parameters + self.moe_layers * self.moe_block_parameters()
        return dense + 2 * self.vocab * self.hidden

    @property
    def active_parameters(self) -> int:
        """The parameters one token runs through."""
        moe = self.moe_layers * self.moe_block_parameters(active=True)
        return self.dense_layers * self.block_parameters + moe + 2 * self.vocab * self.hidden

    def flops_per_token(self, seq_len: int) -> float:
        """``6·N_active`` plus attention's ``12·L·h·s`` (DeepSeek-V3's and torchtitan's MoE MFU)."""
        return 6 * self.active_parameters + 12 * self.layers * self.hidden * seq_len

    def with_overrides(self, **changes: int | None) -> MoEShape:
        """This shape with the fields given (``None``: kept)."""
        given: dict[str, Any] = {k: v for k, v in changes.items() if v is not None}
        return replace(self, **given)


def latent_attention_parameters(config: Mapping[str, Any]) -> int:
    """Multi-head latent attention's parameters (DeepSeek-V2/V3's ``kv_lora_rank`` configs; 0 for
    others): the query's and the keys' and values' low-rank down and up projections, their norms and
    the output projection."""
    if not config.get("kv_lora_rank"):
        return 0
    h, heads, kv = int(config["hidden_size"]), int(config["num_attention_heads"]), int(config["kv_lora_rank"])
    q, rope = int(config.get("q_lora_rank") or 0), int(config.get("qk_rope_head_dim") or 0)
    nope, value = int(config.get("qk_nope_head_dim") or 0), int(config.get("v_head_dim") or 0)
    query = (h * q + q + q * heads * (nope + rope)) if q else h * heads * (nope + rope)
    keys_values = h * (kv + rope) + kv + kv * heads * (nope + value)
    return query + keys_values + heads * value * h


def moe_shape(
    config: Mapping[str, Any],
    *,
    experts: int | None = None,
    top_k: int | None = None,
    shared: int | None = None,
    dense_layers: int | None = None,
    ffn: int | None = None,
) -> MoEShape | None:
    """The MoE shape of ``config`` with the command line's ``--moe-*`` values over it; None for a
    dense config and no ``experts``."""
    if not any(config.get(k) for k in _EXPERT_KEYS):
        if experts is None:
            return None
        config = {**config, "num_local_experts": experts}
    return MoEShape.from_config(config).with_overrides(
        experts=experts, top_k=top_k, shared_experts=shared, dense_layers=dense_layers,
        expert_intermediate=ffn,
    )  # fmt: skip


def all_to_all_seconds(
    tokens: float, hidden: int, top_k: int, ep: int, cluster: Cluster, tp: int = 1
) -> float:
    """Dispatch plus combine of one MoE layer for one pass: each of a rank's ``tokens`` goes to
    ``top_k`` experts as ``hidden`` bf16 values and comes back, ``(ep−1)/ep`` of it to other ranks;
    the part bound for another node crosses the slower link (ep ranks placed ``tp`` apart)."""
    if ep <= 1:
        return 0.0
    leaving = 2.0 * tokens * top_k * hidden * (ep - 1) / ep
    in_node = min(ep, max(1, cluster.gpus // tp))
    near = leaving * (in_node - 1) / (ep - 1)
    seconds = max(near / cluster.intra, (leaving - near) / cluster.inter)
    return 2 * (cluster.latency + seconds)


@dataclass(frozen=True)
class MoERank:
    """Where one rank sits: tensor parallel ``tp``, expert parallel ``ep``, and whether its
    data-parallel replicas are FSDP-sharded (``sharded``)."""

    tp: int = 1
    ep: int = 1
    sharded: bool = False


def moe_profile(
    shape: MoEShape, cluster: Cluster, seq_len: int, microbatch_size: int, recompute: bool, rank: MoERank
) -> ModelProfile:
    """Per-layer costs of one microbatch on one rank of ``tp × ep``: the dense blocks as
    :func:`~.cluster.transformer_profile` times them, the MoE blocks by :func:`moe_block`."""
    dense_shape = TransformerShape(**{f: getattr(shape, f) for f in TransformerShape.__dataclass_fields__})
    three = replace(dense_shape, layers=3)  # its middle block is a plain one
    dense = transformer_profile(three, cluster, seq_len, microbatch_size, recompute, rank.tp)
    tokens, h = seq_len * microbatch_size, shape.hidden
    block = moe_block(shape, cluster, tokens, seq_len, recompute, rank)
    count = _state(shape.block_parameters)  # latent attention's count
    dense_block = replace(
        dense.layers[1],
        parameter_bytes=count["parameter_bytes"],
        gradient_bytes=count["gradient_bytes"],
        optimizer_bytes=count["optimizer_bytes"],
    )
    layers = [dense_block] * shape.dense_layers + [block] * shape.moe_layers
    head_f, head_b, head_w = head_seconds(tokens, h, shape.vocab, rank.tp, cluster.device())
    table = _state(shape.vocab * h)
    embedding = LayerProfile("embedding", 0.0, 0.0, 0.0, **table)
    head = LayerProfile("head", head_f, head_b, head_w, activation_bytes=6.0 * tokens * shape.vocab, **table)
    layers[0] = _together(f"embedding+{layers[0].name}", embedding, layers[0])
    layers[-1] = _together(f"{layers[-1].name}+head", layers[-1], head)
    return ModelProfile(tuple(layers), comm_latency=cluster.latency, comm_bandwidth=cluster.inter)


def moe_block(
    shape: MoEShape, cluster: Cluster, tokens: int, seq_len: int, recompute: bool, rank: MoERank
) -> LayerProfile:
    """One MoE block on one rank: attention and the shared experts as a dense block of width
    ``shared × expert FFN``, the router, the rank's ``experts/ep`` routed experts as grouped products
    of ``tokens·top_k·ep/experts`` rows each (balanced routing), the permutations, its bytes and its
    all-to-all (``docs/auto-planning.md``, "Mixture of experts", for the activation count)."""
    device, tp, ep, h = cluster.device(), rank.tp, rank.ep, shape.hidden
    if shape.experts % ep:
        raise ScheduleError(f"ep {ep} does not divide the {shape.experts} experts")
    shared = shape.shared_experts * shape.expert_intermediate
    forward, backward_input, backward_weight = block_seconds(
        replace(shape.block(tokens, seq_len, tp), intermediate=shared), device
    )
    if not shared:  # block_seconds timed a width-1 MLP: its kernels' launches
        forward, backward_input = forward - 2 * GEMM_LATENCY, backward_input - 2 * GEMM_LATENCY
        backward_weight -= 2 * GEMM_LATENCY
    local, rows = shape.experts // ep, tokens * shape.top_k * ep / shape.experts
    width = (2 if shape.gated else 1) * shape.expert_intermediate / tp
    for m, n, k in ((tokens, shape.experts, h), (rows, width, h), (rows, h, shape.expert_intermediate / tp)):
        batch = 1 if n == shape.experts else local
        forward += gemm_seconds(m, n, k, device, batch)
        backward_input += gemm_seconds(m, k, n, device, batch)
        backward_weight += gemm_seconds(k, n, m, device, batch)
    routed = tokens * shape.top_k
    moved = routed * ((6, 10) if shape.gated else (4, 6))[0] * shape.expert_intermediate / tp + 8 * routed * h
    forward += moved / device.sustained_bandwidth
    backward_input += 1.5 * moved / device.sustained_bandwidth
    reduce = Grid.all_reduce(2.0 * tokens * h, tp, Link(cluster.latency, cluster.intra))
    forward += 2 * reduce
    backward_input += 2 * reduce + (forward if recompute else 0.0)
    per_routed = 4.0 * h + 6.0 * shape.expert_intermediate
    activations = 17.0 * tokens * h + 6.0 * tokens * shared + routed * per_routed
    kept = 2.0 * tokens * h if recompute else activations
    expert_count = shape.experts * shape.expert_parameters
    own = shape.moe_block_parameters() - expert_count + expert_count // ep
    state = _state(own)
    if rank.sharded and ep > 1:
        # FSDP shards a rank's experts over dp/ep ranks, the rest over dp (torchtitan), while the grid
        # divides everything by dp: the experts' missing share is added where only the shard counts
        state["optimizer_bytes"] += 16.0 * (expert_count - expert_count // ep)
    return LayerProfile(
        "moe-block",
        forward=forward,
        backward_input=backward_input,
        backward_weight=backward_weight,
        activation_bytes=kept,
        weight_input_bytes=kept * 32 / 34,
        output_bytes=2.0 * tokens * h / tp,
        all_to_all=all_to_all_seconds(tokens / tp, h, shape.top_k, ep, cluster, tp),
        **state,
    )


def _state(count: float) -> dict[str, float]:
    """bf16 weights and gradients, fp32 master weights and Adam moments: 16 bytes a parameter."""
    return {"parameter_bytes": 2.0 * count, "gradient_bytes": 2.0 * count, "optimizer_bytes": 12.0 * count}


def _together(name: str, first: LayerProfile, second: LayerProfile) -> LayerProfile:
    """Two consecutive layers as one: times, bytes and all-to-all summed, the second's output sent on."""
    keys = (
        "forward", "backward_input", "backward_weight", "activation_bytes", "weight_input_bytes",
        "parameter_bytes", "gradient_bytes", "optimizer_bytes", "all_to_all",
    )  # fmt: skip
    summed = {key: getattr(first, key) + getattr(second, key) for key in keys}
    return LayerProfile(name, output_bytes=second.output_bytes, **summed)


@dataclass(frozen=True)
class _MoESetting(_Setting):
    """:class:`~.cluster._Setting` whose profile is a MoE's on ranks of ``ep`` experts' groups."""

    ep: int = 1
    sharded: bool = False

    def profile(self, tp: int) -> ModelProfile:
        """The per-layer profile of one rank of ``tp × ep`` (:func:`moe_profile`)."""
        assert isinstance(self.shape, MoEShape)
        rank = MoERank(tp=tp, ep=self.ep, sharded=self.sharded)
        return moe_profile(self.shape, self.cluster, self.seq_len, self.microbatch_size, self.recompute, rank)


def ep_sizes(shape: MoEShape, grid: Grid) -> list[int]:
    """The expert-parallel sizes a layout can run: each divides the experts and the data-parallel
    ranks it borrows from (torchtitan's ``ep`` within ``dp_shard``)."""
    return [ep for ep in range(1, grid.dp + 1) if grid.dp % ep == 0 and shape.experts % ep == 0]


def plan_moe_cluster(
    shape: MoEShape,
    cluster: Cluster,
    tokens_per_step: int,
    seq_len: int,
    *,
    microbatch_size: int = 1,
    recompute: bool = False,
    layouts: Sequence[Grid] | None = None,
    search: ClusterSearch | None = None,
) -> list[ClusterOption]:
    """:func:`~.cluster.plan_cluster` for a MoE: every layout (or those given) × every
    :func:`ep_sizes`, ranked as there; each option's ``plan.reason`` says, after ``experts:``, what
    :func:`moe_reason` says (:func:`~.search.plan` adds it)."""
    check = plan_cluster_setting(shape, cluster, tokens_per_step, seq_len, microbatch_size)
    search = search or ClusterSearch(MOE_SCHEDULES)
    base = _MoESetting(shape, cluster, check, seq_len, microbatch_size, recompute, search)
    candidates = [
        (replace(base, ep=ep, sharded=grid.shard > 1), grid)
        for grid in (layouts if layouts is not None else cluster_grids(shape, cluster))
        for ep in ep_sizes(shape, grid)
    ]
    options = search_layouts(candidates, search)  # with search.keep, the others pruned by a bound
    options = [replace(option, ep=setting.ep) for option, (setting, _) in zip(options, candidates)]
    return sorted(options, key=lambda o: o.rank)


def plan_cluster_setting(
    shape: MoEShape, cluster: Cluster, tokens_per_step: int, seq_len: int, microbatch_size: int
) -> int:
    """The sequences of a step, checked as :func:`~.cluster.plan_cluster` checks them."""
    if tokens_per_step % seq_len or tokens_per_step < seq_len or microbatch_size < 1:
        raise ScheduleError(
            f"tokens per step {tokens_per_step} must be a multiple of the sequence length {seq_len}"
        )
    return tokens_per_step // seq_len


def hidden_share(candidate: PlanCandidate) -> float | None:
    """The share of the expert all-to-all that the candidate's schedule hides, over every rank: an
    overlapped pair hides each half's all-to-all behind the other half's compute (what exceeds
    that compute stays exposed, ``StageCosts.pair_duration``); every other F and B waits for its
    own.  None without a built schedule or without all-to-all."""
    if candidate.built is None or candidate.costs is None:
        return None
    schedule = candidate.built
    costs = candidate.costs.resolve(schedule.placement)
    paired = {op for pair in schedule.overlapped for op in pair}
    total = exposed = 0.0
    for program in schedule.programs:
        for op in program:
            if op.kind in (Kind.F, Kind.B, Kind.BW):
                total += costs.a2a[op.stage]
                exposed += 0.0 if op in paired else costs.a2a[op.stage]
    for forward, backward in schedule.overlapped:
        both = costs.a2a[forward.stage] + costs.a2a[backward.stage]
        compute = costs.duration(forward) + costs.duration(backward) - both
        exposed += max(0.0, both - compute)
    return 1.0 - exposed / total if total > 0 else None


def moe_reason(plan: Plan) -> str:
    """Why the winner won, in terms of the all-to-all: how much of it dualpipe-v hides and how far
    that puts it ahead of (or behind) the best other schedule, or why dualpipe-v was not built."""
    winner = plan.winner
    a2a = winner.costs.a2a if winner.costs is not None else 0.0
    per_pass = float(a2a) if isinstance(a2a, (int, float)) else max(a2a)
    fitting = [c for c in plan.candidates if c.fits and c.period]
    dualpipe = next((c for c in plan.candidates if c.schedule == "dualpipe-v"), None)
    text = f"expert all-to-all {per_pass * 1e3:.3f} ms a pass on the busiest stage"
    if dualpipe is None:
        return f"{text}; dualpipe-v not tried"
    if dualpipe.period is None or not dualpipe.fits:
        return f"{text}; dualpipe-v not chosen: {dualpipe.note or 'it does not fit'}"
    share = hidden_share(dualpipe)
    if share is None:
        return f"{text}; no all-to-all for dualpipe-v to hide"
    if winner is dualpipe:
        other = next((c for c in fitting if c.schedule != "dualpipe-v"), None)
        if other is None or not other.period:
            return f"{text}; dualpipe-v hides {share:.2f} of it and alone fits"
        ahead = other.period / dualpipe.period - 1
        return f"{text}; dualpipe-v hides {share:.2f} of it: {ahead:.1%} faster than {other.label}"
    assert winner.period is not None
    return (
        f"{text}; dualpipe-v would hide {share:.2f} of it but is predicted "
        f"{dualpipe.period / winner.period - 1:+.1%} against {winner.label}"
    )
