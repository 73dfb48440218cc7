"""The ``zerobubble`` command line: parses arguments, calls the library, prints the answer.

Every user error — the project's own error types: ``UsageError``, ``ScheduleError``,
``PipelineError`` and the demo's ``ConfigError`` — ends in one line on stderr
(``zerobubble: error: …``) and exit status 2; any other exception is a bug and keeps its traceback.
The demo (``train``, ``profile``) is imported inside its commands; the benchmarks (``bench``), and
torch with them, only for a command line naming ``bench``: each benchmark module declares its own
options and run (``zerobubble_bench.Benchmark``) and this module only registers them.  The library
never imports either.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .schedule import (
    REGISTRY,
    CostModel,
    Schedule,
    ScheduleError,
    build_schedule,
    polish_schedule,
)
from .schedule.compare import OPTIMIZER_MODES, compare_schedules, iteration_period
from .schedule.modelplan.search import HEAD_LAYOUTS
from .schedule.paper import paper_models, paper_setup


class UsageError(Exception):
    """A command-line mistake that argparse itself cannot see."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line and exit 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _number_list(text: str, name: str, low: int, high: int) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"{name} must be comma-separated numbers, got {text!r}") from None
    if not low <= len(values) <= high:
        raise UsageError(f"{name} takes {low}..{high} comma-separated numbers, got {len(values)}")
    return values


def _costs_from_args(args: argparse.Namespace, stages: int) -> CostModel:
    """The CostModel described by --cost/--memory/--memory-limit/--costs-file."""
    if getattr(args, "costs_file", None):
        try:
            with open(args.costs_file, encoding="utf-8") as handle:
                costs = CostModel.from_dict(json.load(handle))
        except (OSError, json.JSONDecodeError) as error:
            raise UsageError(f"cannot read costs file {args.costs_file!r}: {error}") from None
    else:
        f, b, w, *comm = _number_list(args.cost, "--cost", 3, 4)
        mem_b, mem_w = _number_list(args.memory, "--memory", 2, 2)
        costs = CostModel(f=f, b=b, w=w, comm=comm[0] if comm else 0.0, mem_b=mem_b, mem_w=mem_w)
    return costs.apply_memory_limit(args.memory_limit, stages)


def _add_setup_arguments(parser: argparse.ArgumentParser, schedule: bool = True) -> None:
    if schedule:
        parser.add_argument("--schedule", default="zb-h1", help="schedule name (see 'zerobubble schedules')")
        parser.add_argument(
            "--schedule-file", help="read a schedule JSON (from 'export --format json') instead"
        )
        parser.add_argument("--chunks", type=int, help="virtual stages per rank, for schedules that take it")
    parser.add_argument("--stages", "-p", type=int, default=4, help="pipeline ranks P (default 4)")
    parser.add_argument("--microbatches", "-m", type=int, default=8, help="microbatches M (default 8)")
    parser.add_argument(
        "--cost", default="1,1,1,0", help="T_F,T_B,T_W[,T_comm] per rank-stage (default 1,1,1,0)"
    )
    parser.add_argument("--memory", default="1,0", help="M_B,M_W per rank-stage (default 1,0)")
    parser.add_argument(
        "--memory-limit", help="per-rank limit: an amount in --memory's unit, or Np = N·p·M_B"
    )
    parser.add_argument(
        "--costs-file", help="JSON CostModel (per-stage lists allowed) instead of --cost/--memory"
    )
    parser.add_argument(
        "--polish",
        type=float,
        metavar="SECONDS",
        help="then reorder the last ops with CP-SAT for up to SECONDS, kept when faster "
        "(pip install 'zerobubble[solver]')",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _schedule_from_args(args: argparse.Namespace) -> tuple[Schedule, CostModel]:
    if args.schedule_file:
        try:
            with open(args.schedule_file, encoding="utf-8") as handle:
                schedule = Schedule.from_json(handle.read())
        except OSError as error:
            raise UsageError(f"cannot read schedule file: {error}") from None
        costs = _costs_from_args(args, schedule.num_ranks)
        if args.polish is not None:
            schedule = polish_schedule(schedule, costs, seconds=args.polish)
        return schedule, costs
    costs = _costs_from_args(args, args.stages)
    options = {"time_limit": args.time_limit} if getattr(args, "time_limit", None) is not None else {}
    schedule = build_schedule(
        args.schedule,
        args.stages,
        args.microbatches,
        costs,
        chunks=args.chunks,
        polish_seconds=args.polish,
        **options,
    )
    return schedule, REGISTRY[args.schedule].resolve_costs(costs, args.stages)


def _cmd_schedules(args: argparse.Namespace) -> int:
    width = max(len(name) for name in REGISTRY)
    for name, spec in REGISTRY.items():
        chunks = "v≥1" if spec.chunks is None else f"v={spec.chunks}"
        print(f"{name:<{width}}  {chunks:<4}  {spec.summary}")
    return 0


def _simulation_report(args: argparse.Namespace) -> tuple[Schedule, Any, dict[str, Any]]:
    from .schedule import validate_schedule

    schedule, costs = _schedule_from_args(args)
    timeline = validate_schedule(schedule, costs)
    report = timeline.summary()
    report["period"] = iteration_period(timeline, args.optimizer, args.step_time)
    report["optimizer"] = args.optimizer
    for key in ("lower_bound", "optimal", "polish"):
        if key in schedule.meta:
            report[key] = schedule.meta[key]
    return schedule, timeline, report


def _cmd_simulate(args: argparse.Namespace) -> int:
    _, _, report = _simulation_report(args)
    if args.json:
        print(json.dumps(report))
        return 0
    for key, value in report.items():
        if isinstance(value, float):
            value = f"{value:.6g}"
        elif isinstance(value, list):
            value = " ".join(f"{v:.4g}" for v in value)
        print(f"{key:>22}: {value}")
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from .schedule.render import render_image, render_text

    _, timeline, report = _simulation_report(args)
    if args.output:
        render_image(timeline, args.output)
        print(
            f"wrote {args.output}: {report['schedule']}, iteration time {report['iteration_time']:.6g}, "
            f"bubble rate {report['bubble_rate']:.4f}"
        )
    else:
        print(render_text(timeline, width=args.width))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from .schedule.export import describe_torch_placement, export, torch_placement_json

    if args.placement and args.format != "torch-csv":
        raise UsageError("--placement goes with --format torch-csv (the placement its CSV needs)")
    schedule, timeline, _ = _simulation_report(args)
    text = export(timeline if args.format == "chrome-trace" else schedule, args.format)
    if args.output:
        _write(args.output, text)
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    if args.format != "torch-csv":
        return 0
    # the CSV holds no placement: torch's PipelineStage objects must be built to match it
    placement = args.placement or (_placement_path(args.output) if args.output else None)
    if placement:
        _write(placement, torch_placement_json(schedule))
    where = f"; written to {placement}" if placement else ""
    print(f"stage placement for this CSV: {describe_torch_placement(schedule)}{where}", file=sys.stderr)
    return 0


def _placement_path(output: str) -> str:
    """``plan.csv`` -> ``plan.placement.json``: where ``export --format torch-csv -o`` puts the placement."""
    stem = output[: -len(".csv")] if output.endswith(".csv") else output
    return stem + ".placement.json"


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as error:
        raise UsageError(f"cannot write {path!r}: {error}") from None


def _cmd_compare(args: argparse.Namespace) -> int:
    chunks = args.chunks
    if args.paper_model:
        setup = paper_setup(args.paper_model, args.microbatches)
        stages, costs = setup.stages, setup.costs
        chunks = chunks or setup.interleaved_chunks
        costs = costs.apply_memory_limit(args.memory_limit, stages)
    else:
        stages, costs = args.stages, _costs_from_args(args, args.stages)
    names = args.schedules.split(",") if args.schedules else None
    if args.ilp:
        names = (names or [n for n in REGISTRY if n != "zb-ilp"]) + ["zb-ilp"]
    options = {"zb-ilp": {"time_limit": args.time_limit}} if args.time_limit is not None else None
    rows = compare_schedules(
        stages,
        args.microbatches,
        costs,
        names,
        chunks,
        args.optimizer,
        args.step_time,
        options,
        polish_seconds=args.polish,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "stages": stages,
                    "microbatches": args.microbatches,
                    "optimizer": args.optimizer,
                    "rows": [row.to_dict() for row in rows],
                }
            )
        )
        return 0
    print(_format_comparison(rows, stages, args.microbatches, args.optimizer))
    return 0


def _format_comparison(rows, stages: int, microbatches: int, optimizer: str) -> str:
    header = (
        f"{'schedule':<17}{'sync period':>13}{'post-val period':>16}{'bubble':>8}{'peak mem':>9}"
        f"{'vs 1f1b':>9}{'gap to LB':>10}"
    )
    lines = [
        f"p={stages} m={microbatches}; sorted by the {optimizer} period; speed-up and bubble use it too",
        header,
    ]
    for row in rows:
        if row.error:
            lines.append(f"{row.schedule:<17}n/a: {row.error}")
            continue
        # the analytic bound may sit a float rounding above an optimal schedule: show that as 0
        gap = f"{max(row.gap_to_bound, 0.0) * 100:.2f}%" if row.gap_to_bound is not None else "-"
        if row.optimal:
            gap += "*"
        bubble = row.bubble_rate if optimizer == "post-validation" else row.bubble_rate_makespan
        memory = f"{row.peak_memory:.2f}" + ("" if row.fits_memory else "!")
        name = row.schedule + ("+" if row.polished else "")
        lines.append(
            f"{name:<17}{row.period_sync:>13.6g}{row.period_post_validation:>16.6g}{bubble:>8.4f}"
            f"{memory:>9}{row.speedup_vs_1f1b or 0:>8.3f}x{gap:>10}"
        )
    lines.append(
        "sync period = makespan + step; post-val period = iteration time + step (optimizer post-validation);"
    )
    lines.append(
        "peak mem in M_B (max over ranks; ! = above --memory-limit); gap to LB = iteration time over the "
        "best lower bound known for its placement and its memory (* = proven optimal)"
    )
    if any(row.polished is not None for row in rows):
        lines.append("+ = made faster by --polish (CP-SAT reordered its last ops); vs 1f1b: the unpolished")
    return "\n".join(lines)


_TRAIN_OPTIONS = (
    ("--schedule", str, "schedule name, or auto to plan from measurement (default zb-v)"),
    ("--ranks", int, "local ranks to start when not under torchrun (default 2)"),
    ("--steps", int, "training steps (default 50)"),
    ("--microbatches", int, "microbatches per step (default 4)"),
    ("--batch-size", int, "sequences per step (default 16)"),
    ("--seq-len", int, "tokens per sequence (default 32)"),
    ("--vocab", int, "vocabulary size (default 64)"),
    ("--dim", int, "model width (default 64)"),
    ("--heads", int, "attention heads (default 4)"),
    ("--layers", int, "transformer blocks (default 4)"),
    ("--chunks", int, "chunks per rank for interleaved-1f1b"),
    ("--seed", int, "random seed (default 0)"),
    ("--lr", float, "AdamW learning rate (default 3e-3)"),
    ("--backend", str, "gloo or nccl (default: nccl with CUDA, else gloo)"),
    ("--timeout", float, "seconds before a stuck rank is an error (default 120)"),
    ("--max-norm", float, "gradient clipping norm (default 1.0)"),
    (
        "--data-parallel",
        "_data_parallel",
        "pipeline replicas D (--ranks counts all p·D processes; default 1); with --mesh: replicate "
        "(default), fsdp along its dp dimension, or hsdp along dp_replicate × dp_shard",
    ),
    (
        "--mesh",
        str,
        "a DeviceMesh as name=size in order, e.g. pp=2,dp=2,tp=2 (dimensions pp, dp or "
        "dp_replicate and dp_shard, tp)",
    ),
    ("--memory-limit", str, "per-rank byte budget for --schedule auto, e.g. 24GiB or 80%% (GPU)"),
    ("--partition", str, "even (default): layers split evenly by count; profile: where a profile says"),
    ("--save", str, "write the model, optimizer state and step count to this directory at the end (DCP)"),
    ("--resume", str, "continue from a directory written by --save (any layout, the same model size)"),
)


def _data_parallel(text: str) -> int | str:
    """``--data-parallel``: a replica count, or how a mesh's dp dimension holds the parameters."""
    if text in ("replicate", "fsdp", "hsdp"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a replica count, replicate, fsdp or hsdp"
        ) from None


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, kind, helptext in _TRAIN_OPTIONS:
        parser.add_argument(flag, type=_data_parallel if kind == "_data_parallel" else kind, help=helptext)
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", default=None, help="no progress bar"
    )
    parser.add_argument(
        "--trace", metavar="DIR", help="record the steps and write the measured timeline to DIR"
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="torch.profiler traces of a few steps after warm-up: DIR/rank<r>.pt.trace.json per rank",
    )
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        metavar="BACKEND",
        help="compile every block with torch.compile (backend: inductor, or e.g. aot_eager); "
        "the linears keep the B/W split",
    )
    parser.add_argument(
        "--no-post-validation",
        dest="post_validation",
        action="store_false",
        default=None,
        help="synchronous optimizer step (all-reduce before it) instead of post-validation",
    )


def _cmd_train(args: argparse.Namespace) -> int:
    from zerobubble_demo.train import TrainConfig, print_summary, run_training

    given = {key: value for key, value in vars(args).items() if value is not None}
    config = TrainConfig(**{key: given[key] for key in TrainConfig.__dataclass_fields__ if key in given})
    print_summary(run_training(config))
    return 0


def _cmd_bench(benchmark: Any, args: argparse.Namespace) -> int:
    """Run one ``zerobubble bench`` command (a ``zerobubble_bench.Benchmark``) and print its tables."""
    from zerobubble_bench.tables import machine_description

    if benchmark.check is not None:
        benchmark.check(args)
    print(f"Machine: {machine_description()}\n")
    for table in benchmark.run(args):
        print(table.markdown() + "\n")
    return 0


def _add_bench_commands(parser: argparse.ArgumentParser) -> None:
    """One subcommand per benchmark: each declares its own options (``zerobubble_bench.COMMANDS``)."""
    from zerobubble_bench import benchmarks

    kinds = parser.add_subparsers(dest="benchmark", required=True, parser_class=_Parser)
    for benchmark in benchmarks():
        command = kinds.add_parser(benchmark.name, help=benchmark.help)
        benchmark.add_arguments(command)
        command.set_defaults(run=functools.partial(_cmd_bench, benchmark))


def _cmd_plan(args: argparse.Namespace) -> int:
    from .schedule.modelplan import Link, mesh_layout, parse_mesh, plan

    if args.cluster:
        return _plan_cluster(args)
    profile = _plan_profile(args)
    ranks, layout = args.ranks, None
    if args.mesh:
        sizes = parse_mesh(args.mesh)
        link = Link(profile.comm_latency, profile.comm_bandwidth)
        ranks, layout = sizes["pp"], mesh_layout(sizes, args.data_parallel or "replicate", link)
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
        result.render(args.output)
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    print(result.table())
    print(f"chosen: {result.reason}")
    if args.output:
        print(f"wrote {args.output}")
    return 0


def _plan_cluster(args: argparse.Namespace) -> int:
    """``plan --cluster``: every layout of the cluster planned from a model config (on paper)."""
    from pathlib import Path

    from .schedule.modelplan import parse_mesh
    from .schedule.modelplan.cluster import (
        DEFAULT_SCHEDULES,
        Cluster,
        TransformerShape,
        best_layout_text,
        cluster_table,
        layouts_from_mesh,
        plan_cluster,
    )

    if not args.model or not args.tokens_per_step:
        raise UsageError(
            "--cluster needs --model CONFIG.json (a Hugging Face config) and --tokens-per-step N"
        )
    try:
        shape = TransformerShape.from_config(json.loads(Path(args.model).read_text()))
    except (OSError, json.JSONDecodeError) as error:
        raise UsageError(f"cannot read the model config {args.model!r}: {error}") from None
    cluster = Cluster.parse(args.cluster)
    options = plan_cluster(
        shape,
        cluster,
        args.tokens_per_step,
        args.seq_len,
        microbatch_size=args.microbatch_size,
        recompute=args.recompute,
        schedules=args.schedules.split(",") if args.schedules else DEFAULT_SCHEDULES,
        layouts=layouts_from_mesh(parse_mesh(args.mesh), cluster) if args.mesh else None,
        sharding=None if args.data_parallel == "replicate" else "fsdp",
    )
    if args.json:
        print(json.dumps({"parameters": shape.parameters, "layouts": [o.row() for o in options]}))
        return 0
    size = f"{shape.parameters / 1e9:.2f}B parameters"
    print(f"{size} on {cluster.size} GPUs ({args.tokens_per_step} tokens a step)")
    print(cluster_table(options, args.top))
    print(best_layout_text(options))
    return 0


def _plan_profile(args: argparse.Namespace) -> Any:
    """The profile ``plan`` works from: a profile file, or a recorded run's summary."""
    from pathlib import Path

    from .schedule.modelplan import ModelProfile, profile_from_trace

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
    parser.add_argument("--ranks", "-p", type=int, default=2, help="pipeline ranks P (default 2)")
    parser.add_argument("--microbatches", "-m", type=int, default=8, help="microbatches M (default 8)")
    parser.add_argument("--memory-limit", help="per-rank byte budget: 24GiB, 512MiB, 2e9 (default none)")
    parser.add_argument("--schedules", help="comma-separated names (default: all but zb-ilp)")
    parser.add_argument(
        "--chunks",
        type=int,
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
    cluster = parser.add_argument_group("a cluster on paper (--cluster, instead of --profile)")
    cluster.add_argument(
        "--cluster",
        help="nodes=8,gpus=8,intra=300GB/s,inter=25GB/s[,flops=312e12,memory=80GiB,efficiency=0.5]",
    )
    cluster.add_argument("--model", help="a Hugging Face config.json (its sizes)")
    cluster.add_argument("--tokens-per-step", type=int, help="the global batch in tokens")
    cluster.add_argument("--seq-len", type=int, default=4096, help="sequence length (default 4096)")
    cluster.add_argument("--microbatch-size", type=int, default=1, help="sequences a microbatch (default 1)")
    cluster.add_argument("--recompute", action="store_true", help="full activation recomputation")
    cluster.add_argument("--top", type=int, default=10, help="layouts listed (default 10)")
    parser.add_argument("--output", "-o", help="draw the chosen schedule (.svg or .png)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _cmd_profile(args: argparse.Namespace) -> int:
    from zerobubble_demo.models import GPTConfig
    from zerobubble_demo.profile import profile_gpt

    from .schedule.modelplan import format_bytes

    config = GPTConfig(
        vocab=args.vocab, seq_len=args.seq_len, dim=args.dim, heads=args.heads, n_layers=args.layers
    )
    profile = profile_gpt(
        config, args.microbatch_size, args.repeats, args.seed, not args.no_transfer, args.threads
    )
    if args.output:
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
        parser.add_argument(flag, type=int, default=default, help=f"{helptext} (default {default})")
    parser.add_argument("--no-transfer", action="store_true", help="do not start 2 ranks to time transfers")
    parser.add_argument("--output", "-o", help="write the profile JSON here")
    parser.add_argument("--json", action="store_true", help="print the profile as JSON")


def _is_user_error(error: Exception) -> bool:
    """The project's own error types: a user's mistake or a failed run, reported in one line.

    The runtime's ``PipelineError`` and the demo's ``ConfigError`` are looked up only if their
    module is loaded (importing them would load torch); any other exception is a bug: traceback.
    """
    if isinstance(error, (UsageError, ScheduleError)):
        return True
    kinds = [
        getattr(sys.modules.get(module), name, None)
        for module, name in (("zerobubble.runtime", "PipelineError"), ("zerobubble_demo", "ConfigError"))
    ]
    return any(isinstance(error, kind) for kind in kinds if isinstance(kind, type))


def _no_arguments(parser: argparse.ArgumentParser) -> None:
    """A command without options."""


def _add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``simulate``, and the first ones of ``show`` and ``export``."""
    _add_setup_arguments(parser)
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZER_MODES,
        default="post-validation",
        help="sync: period = makespan + step; post-validation: iteration time + step",
    )
    parser.add_argument("--step-time", type=float, default=0.0, help="optimizer step time (default 0)")
    parser.add_argument("--time-limit", type=float, help="seconds for zb-ilp (default 60)")


def _add_show_arguments(parser: argparse.ArgumentParser) -> None:
    _add_simulate_arguments(parser)
    parser.add_argument("--output", "-o", help="write a picture (.svg or .png) instead of text")
    parser.add_argument("--width", type=int, help="text width in columns")


def _add_export_arguments(parser: argparse.ArgumentParser) -> None:
    _add_simulate_arguments(parser)
    parser.add_argument("--format", choices=("json", "torch-csv", "chrome-trace"), default="json")
    parser.add_argument("--output", "-o", help="file to write (default: stdout)")
    parser.add_argument(
        "--placement",
        metavar="FILE",
        help="torch-csv: write the stage placement the CSV needs (JSON) here (default with -o X.csv: "
        "X.placement.json; it is always printed on stderr)",
    )


def _add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    _add_setup_arguments(parser, schedule=False)
    parser.add_argument("--chunks", type=int, help="chunks for interleaved-1f1b (default 2, or the paper's)")
    parser.add_argument("--schedules", help="comma-separated names (default: all but zb-ilp)")
    parser.add_argument("--paper-model", choices=paper_models(), help="use the paper's profiled setup")
    parser.add_argument("--optimizer", choices=OPTIMIZER_MODES, default="post-validation")
    parser.add_argument("--step-time", type=float, default=0.0, help="optimizer step time (default 0)")
    parser.add_argument("--ilp", action="store_true", help="also solve the integer program (zb-ilp)")
    parser.add_argument("--time-limit", type=float, help="seconds for zb-ilp (default 60)")


# (name, help, add_arguments, run) of each command but ``bench``, in ``zerobubble --help`` order
_COMMANDS: tuple[
    tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]], ...
] = (
    ("schedules", "list the schedules", _no_arguments, _cmd_schedules),
    ("simulate", "simulate a schedule and print its numbers", _add_simulate_arguments, _cmd_simulate),
    ("show", "draw a schedule's timeline (text, or --output FILE.svg|.png)", _add_show_arguments, _cmd_show),
    ("export", "write a schedule as JSON, torch-csv or a Chrome trace", _add_export_arguments, _cmd_export),
    ("compare", "compare every schedule for one setup", _add_compare_arguments, _cmd_compare),
    ("profile", "measure the built-in GPT layer by layer for 'plan'", _add_profile_arguments, _cmd_profile),
    ("plan", "choose schedule, chunks and partition from a profile or trace", _add_plan_arguments, _cmd_plan),
    ("train", "train the built-in GPT on local ranks (or under torchrun)", _add_train_arguments, _cmd_train),
)


def build_parser(benchmarks: bool = True) -> argparse.ArgumentParser:
    """The argument parser of the ``zerobubble`` command.

    ``benchmarks=False`` leaves the ``bench`` subcommands out, and with them the imports of
    ``zerobubble_bench`` and torch: ``main`` does so for a command line that does not name ``bench``.
    """
    parser = _Parser(prog="zerobubble", description="Zero-bubble pipeline-parallel schedules and training.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, helptext, add_arguments, run in _COMMANDS:
        command = commands.add_parser(name, help=helptext)
        add_arguments(command)
        command.set_defaults(run=run)
    bench = commands.add_parser("bench", help="benchmarks of the runtime (results as Markdown tables)")
    if benchmarks:
        _add_bench_commands(bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``zerobubble`` command; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser(benchmarks="bench" in argv).parse_args(argv)
        return args.run(args)
    except Exception as error:
        if not _is_user_error(error):
            raise
        print(f"zerobubble: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("zerobubble: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
