"""The planning commands: ``profile`` (the demo GPT, layer by layer) and ``plan`` (from a profile, a
recorded trace, or a cluster on paper)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

from ..schedule.compare import OPTIMIZER_MODES
from ..schedule.modelplan.search import HEAD_LAYOUTS
from .base import UsageError, non_negative_int, positive_int, writing


def _cmd_plan(args: argparse.Namespace) -> int:
    from ..schedule.modelplan import Link, mesh_layout, parse_mesh, plan

    if args.published:
        return _plan_published(args)
    if args.cluster:
        return _plan_cluster(args)
    profile = _plan_profile(args)
    ranks, layout = args.ranks, None
    if args.mesh:
        link = Link(profile.comm_latency, profile.comm_bandwidth)
        layout = mesh_layout(parse_mesh(args.mesh), args.data_parallel or "replicate", link)
        ranks = layout.pp
    result = plan(
        profile,
        ranks,
        args.microbatches,
        args.memory_limit,
        schedules=args.schedules.split(",") if args.schedules else None,
        interleaved_chunks=args.chunks,
        optimizer=args.optimizer,
        head=args.head,
        layout=layout,
    )
    if args.output:
        with writing(args.output):
            result.render(args.output)
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    print(result.table())
    print(f"chosen: {result.reason}")  # with the expert all-to-all's part in it, for an MoE profile
    if args.output:
        print(f"wrote {args.output}")
    return 0


def _plan_cluster(args: argparse.Namespace) -> int:
    """``plan --cluster``: every layout of the cluster planned from a model config (on paper)."""
    from ..schedule.modelplan.cluster import (
        DEFAULT_SCHEDULES,
        Cluster,
        ClusterSearch,
        plan_cluster,
    )
    from ..schedule.modelplan.cluster_text import best_layout_text, cluster_table, render_cluster_option
    from ..schedule.modelplan.moe import MOE_SCHEDULES, moe_reason, plan_moe_cluster

    if not args.model or args.tokens_per_step is None:
        raise UsageError(
            "--cluster needs --model CONFIG.json (a Hugging Face config) and --tokens-per-step N"
        )
    shape, moe = _model_shape(args)
    if args.data_parallel == "hsdp":
        raise UsageError(
            "--cluster plans data parallelism replicated or with FSDP2 (--data-parallel replicate or fsdp); "
            "plan an HSDP layout with --profile and --mesh pp=…,dp_replicate=…,dp_shard=…"
        )
    cluster = Cluster.parse(args.cluster)
    search = ClusterSearch(
        tuple(args.schedules.split(",")) if args.schedules else MOE_SCHEDULES if moe else DEFAULT_SCHEDULES,
        # the table shows the --top fastest: only those need simulating (--json lists every layout)
        keep=None if args.json else args.top,
        jobs=args.jobs,
    )
    layouts = _cluster_grids(args, shape, cluster)
    sizes = (args.tokens_per_step, args.seq_len)
    run: dict[str, Any] = {"microbatch_size": args.microbatch_size, "recompute": args.recompute}
    if moe:
        options = plan_moe_cluster(moe, cluster, *sizes, search=search, layouts=layouts, **run)
    else:
        options = plan_cluster(shape, cluster, *sizes, search=search, layouts=layouts, **run)
    best = best_layout_text(options)  # raises when no layout fits
    if args.output:
        with writing(args.output):
            render_cluster_option(options[0], args.output)
    if args.json:
        rows = [o.row() for o in options]
        print(json.dumps({"parameters": shape.parameters, "cluster": cluster.assumptions(), "layouts": rows}))
        return 0
    size = f"{shape.parameters / 1e9:.2f}B parameters"
    if moe:
        size += f" ({moe.active_parameters / 1e9:.2f}B active: top-{moe.top_k} of {moe.experts} experts)"
    print(f"{size} on {cluster.size} GPUs ({args.tokens_per_step} tokens a step)")
    print(cluster.describe())
    print(cluster_table(options, args.top))
    print(best)
    if moe and options[0].plan is not None:
        print(f"experts: {moe_reason(options[0].plan)}")
    if args.output:
        print(f"wrote {args.output}")
    return 0


def _model_shape(args: argparse.Namespace) -> tuple[Any, Any]:
    """The model ``--model`` names with the ``--moe-*`` values over it, and the same when it is a
    mixture of experts (else None)."""
    from ..schedule.modelplan.cluster import TransformerShape
    from ..schedule.modelplan.moe import moe_shape

    config = _model_config(args.model)
    moe = moe_shape(
        config, experts=args.moe_experts, top_k=args.moe_top_k, shared=args.moe_shared,
        dense_layers=args.moe_dense_layers, ffn=args.moe_ffn,
    )  # fmt: skip
    return moe or TransformerShape.from_config(config), moe


def _model_config(model: str) -> dict[str, Any]:
    """``--model``: a preset's sizes (:data:`~..schedule.modelplan.moe.PRESETS`) or a config file's."""
    from pathlib import Path

    from ..schedule.modelplan.moe import PRESETS

    if model in PRESETS:
        return dict(PRESETS[model])
    try:
        config = json.loads(Path(model).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UsageError(
            f"cannot read the model config {model!r}: {error} (or name a preset: {', '.join(PRESETS)})"
        ) from None
    if not isinstance(config, dict):
        raise UsageError(f"the model config {model!r} is not a JSON object")
    return config


def _plan_published(args: argparse.Namespace) -> int:
    """``plan --published``: each published run's layout planned on paper beside its published figure."""
    from ..schedule.modelplan.published import RUNS, anchor_table, load_runs, published_table

    data = load_runs(RUNS if args.published == "shipped" else args.published)
    if args.calibrate_on:
        data["calibrate_on"] = args.calibrate_on
    print(anchor_table(data) if args.anchors else published_table(data))
    return 0


def _cluster_grids(args: argparse.Namespace, shape: Any, cluster: Any) -> list[Any]:
    """The grids ``plan --cluster`` plans: the one ``--mesh`` names, or every one of the cluster;
    their replicas FSDP2-sharded unless ``--data-parallel replicate``."""
    from ..schedule.modelplan import parse_mesh
    from ..schedule.modelplan.cluster import cluster_grids, layouts_from_mesh

    sharding = None if args.data_parallel == "replicate" else "fsdp"
    if args.mesh:
        return layouts_from_mesh(parse_mesh(args.mesh), cluster, sharding)
    return cluster_grids(shape, cluster, sharding)


def _plan_profile(args: argparse.Namespace) -> Any:
    """The profile ``plan`` works from: a profile file, or a recorded run's summary."""
    from pathlib import Path

    from ..schedule.modelplan import ModelProfile, profile_from_trace

    if bool(args.profile) == bool(args.trace):
        raise UsageError("give exactly one of --profile FILE (from 'zerobubble profile') or --trace DIR")
    if args.profile:
        return ModelProfile.load(args.profile)
    folder = Path(args.trace)
    summary = next(
        (p for p in (folder / "summary.json", folder / "replica0" / "summary.json") if p.exists()), None
    )
    if summary is None:
        raise UsageError(
            f"no summary.json in {args.trace!r}; record a run with 'zerobubble train --trace DIR'"
        )
    try:
        return profile_from_trace(json.loads(summary.read_text()))
    except (OSError, json.JSONDecodeError) as error:
        raise UsageError(f"cannot read {summary}: {error}") from None


def _add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", help="a layer profile JSON from 'zerobubble profile'")
    parser.add_argument("--trace", metavar="DIR", help="re-plan from a run recorded with 'train --trace DIR'")
    parser.add_argument("--ranks", "-p", type=positive_int, default=2, help="pipeline ranks P (default 2)")
    parser.add_argument(
        "--microbatches", "-m", type=positive_int, default=8, help="microbatches M (default 8)"
    )
    parser.add_argument("--memory-limit", help="per-rank byte budget: 24GiB, 512MiB, 2e9 (default none)")
    parser.add_argument("--schedules", help="comma-separated names (default: all but zb-ilp)")
    parser.add_argument(
        "--chunks",
        type=positive_int,
        nargs="+",
        default=[2],
        help="chunk counts tried for interleaved-1f1b (default 2)",
    )
    parser.add_argument("--optimizer", choices=OPTIMIZER_MODES, default="post-validation")
    parser.add_argument(
        "--head",
        choices=HEAD_LAYOUTS,
        default="plain",
        help="the profile's last layer (the output layer) on the last stage, vocabulary-parallel, or both "
        "tried (default plain)",
    )
    parser.add_argument(
        "--mesh",
        help="each stage on dp × tp ranks: pp=2,dp=2,tp=2 (or dp_replicate=,dp_shard= for hsdp); "
        "the collectives on the profile's measured link",
    )
    parser.add_argument(
        "--data-parallel",
        choices=("replicate", "fsdp", "hsdp"),
        help="with --mesh (default replicate) or --cluster (default fsdp; replicate tries that instead)",
    )
    _add_cluster_arguments(parser)
    parser.add_argument(
        "--output",
        "-o",
        help="draw the chosen schedule (.svg or .png); with --cluster, that of the best layout",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """``plan``'s options for a cluster on paper and for the published runs."""
    cluster = parser.add_argument_group("a cluster on paper (--cluster, instead of --profile)")
    cluster.add_argument(
        "--cluster",
        help="nodes=8,gpus=8,intra=300GB/s,inter=25GB/s[,flops=312e12,memory=80GiB,efficiency=0.713,"
        "hbm=2039GB/s,sms=108,latency=1e-5]",
    )
    cluster.add_argument(
        "--model", help="a Hugging Face config.json (its sizes), or mixtral-8x7b or deepseek-v3-like"
    )
    moe = parser.add_argument_group("a mixture of experts (with --cluster; over the config's own)")
    moe.add_argument("--moe-experts", type=positive_int, help="routed experts of each MoE layer")
    moe.add_argument("--moe-top-k", type=positive_int, help="experts each token is routed to")
    moe.add_argument("--moe-shared", type=non_negative_int, help="shared experts every token runs")
    moe.add_argument(
        "--moe-dense-layers", type=non_negative_int, help="dense blocks before the first MoE block"
    )
    moe.add_argument("--moe-ffn", type=positive_int, help="an expert's FFN width (default: the MLP's)")
    cluster.add_argument("--tokens-per-step", type=positive_int, help="the global batch in tokens")
    cluster.add_argument("--seq-len", type=positive_int, default=4096, help="sequence length (default 4096)")
    cluster.add_argument(
        "--microbatch-size", type=positive_int, default=1, help="sequences a microbatch (default 1)"
    )
    cluster.add_argument("--recompute", action="store_true", help="full activation recomputation")
    cluster.add_argument("--top", type=positive_int, default=10, help="layouts listed (default 10)")
    cluster.add_argument(
        "--jobs",
        "-j",
        type=positive_int,
        default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
        help="processes planning the layouts at once (default: every core this process may use)",
    )
    cluster.add_argument(
        "--published",
        nargs="?",
        const="shipped",
        metavar="RUNS.json",
        help="plan each published run's layout beside its published figure (default: the shipped runs: "
        "Megatron-LM's Table 1, torchtitan's Llama 3 on A100)",
    )
    cluster.add_argument(
        "--calibrate-on", help="with --published: the run the matmul efficiency is fitted to"
    )
    cluster.add_argument(
        "--anchors",
        action="store_true",
        help="with --published: calibrate on each Table 1 row in turn and print how far the predictions move",
    )


def _cmd_profile(args: argparse.Namespace) -> int:
    from zerobubble_demo.models import GPTConfig
    from zerobubble_demo.profile import profile_gpt

    from ..schedule.modelplan import format_bytes

    config = GPTConfig(
        vocab=args.vocab, seq_len=args.seq_len, dim=args.dim, heads=args.heads, n_layers=args.layers
    )
    profile = profile_gpt(
        config, args.microbatch_size, args.repeats, args.seed, not args.no_transfer, args.threads
    )
    if args.output:
        with writing(args.output):
            profile.save(args.output)
    if args.json:
        print(json.dumps(profile.to_dict()))
        return 0
    columns = ("T_F ms", "T_B ms", "T_W ms")
    sizes = ("F->B", "B->W", "static", "output")
    print(f"{'layer':<8}" + "".join(f"{c:>9}" for c in columns) + "".join(f"{c:>12}" for c in sizes))
    for layer in profile.layers:
        print(
            f"{layer.name:<8}{layer.forward * 1e3:>9.3f}{layer.backward_input * 1e3:>9.3f}"
            f"{layer.backward_weight * 1e3:>9.3f}{format_bytes(layer.activation_bytes):>12}"
            f"{format_bytes(layer.weight_input_bytes):>12}{format_bytes(layer.static_bytes):>12}"
            f"{format_bytes(layer.output_bytes):>12}"
        )
    print(
        f"T_comm = {profile.comm_latency * 1e6:.1f} us + bytes / {profile.comm_bandwidth / 1e9:.3g} GB/s; "
        f"microbatch of {args.microbatch_size} sequences; median of {args.repeats}"
    )
    if args.output:
        print(f"wrote {args.output}")
    return 0


def _add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, default, helptext in (
        ("--vocab", 64, "vocabulary size"),
        ("--seq-len", 32, "tokens per sequence"),
        ("--dim", 64, "model width"),
        ("--heads", 4, "attention heads"),
        ("--layers", 4, "transformer blocks"),
        ("--microbatch-size", 4, "sequences per microbatch"),
        ("--repeats", 5, "timed runs per layer (the median is kept)"),
        ("--threads", 1, "intra-op threads, as the training ranks will have"),
        ("--seed", 0, "random seed"),
    ):
        kinds: dict[str, Callable[[str], int]] = {"--seed": int, "--layers": non_negative_int}
        kind = kinds.get(flag, positive_int)
        parser.add_argument(flag, type=kind, default=default, help=f"{helptext} (default {default})")
    parser.add_argument("--no-transfer", action="store_true", help="do not start 2 ranks to time transfers")
    parser.add_argument("--output", "-o", help="write the profile JSON here")
    parser.add_argument("--json", action="store_true", help="print the profile as JSON")


COMMANDS: tuple[
    tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]], ...
] = (
    ("profile", "measure the built-in GPT layer by layer for 'plan'", _add_profile_arguments, _cmd_profile),
    ("plan", "choose schedule, chunks and partition from a profile or trace", _add_plan_arguments, _cmd_plan),
)
"""(name, help, add_arguments, run) of each command here, in ``zerobubble --help`` order."""
