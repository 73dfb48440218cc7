"""``bench vocab``: a vocabulary-parallel output layer against the best plain cut, simulated and measured.

A GPT-like model whose vocabulary (32k, 64k, 128k) dwarfs its width: with a plain head the last
stage carries the output layer and its logits, however the blocks are cut.  Two tables:

* **simulated**, on the paper's cost ratios (Table 1 of arXiv 2401.10241 for a block, F = B = W =
  2·n·h·V for the head, :func:`~zerobubble.schedule.vocab.head_costs`): per schedule, the iteration
  time of the plain model cut evenly and at its best cut (the faster of the even cut and the
  balanced ``optimal_partition``, as ``partition="profile"`` plans it), and of the
  vocabulary-parallel model; the last stage's peak activation memory over the largest of the other
  ranks'.  ``--paper-scale`` adds a 1.5B-class model, where the head is one to five blocks' work;
* **measured** on CPU ranks: the same model with ``partition="profile"`` (the planner's best cut of
  the plain model) and with ``head=``/``embedding=``, timed side by side in rotating rounds; the
  last stage's measured activation peak over the other ranks' (``ActivationMeter``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from zerobubble import Pipeline, VocabParallelEmbedding, VocabParallelHead
from zerobubble.runtime.launch import init_distributed, launch
from zerobubble.runtime.observe.memory import ActivationMeter
from zerobubble.schedule import CostModel, build_schedule, simulate, transformer_costs
from zerobubble.schedule.partition import optimal_partition
from zerobubble.schedule.vocab import (
    VocabPolicy,
    add_vocab_ops,
    default_policies,
    head_costs,
    partition_reference,
    refined_policies,
    work_bound,
)
from zerobubble_demo.models import Embedding, GPTConfig, Head, gpt_layers, lm_loss

from . import Benchmark
from .tables import Table, median, preserved_torch_state
from .workloads import interleaved, our_step

VOCABS = (32768, 65536, 131072)
SCHEDULES = ("1f1b", "zb-h1", "zb-2p", "zb-v")


def bench_config(vocab: int) -> GPTConfig:
    """The model of ``bench vocab``: 8 blocks of width 64 on 32-token sequences, vocabulary ``vocab``."""
    return GPTConfig(vocab=vocab, seq_len=32, dim=64, heads=4, n_layers=8)


# -- simulated ------------------------------------------------------------------------------------


def _layer_costs(config: GPTConfig, tokens: int) -> tuple[CostModel, Any]:
    """One block's costs (FLOPs / 1e6, bytes) and the head's, for ``tokens`` tokens per microbatch."""
    sequences = max(1, tokens // config.seq_len)
    block = transformer_costs(config.dim, config.heads, config.seq_len, sequences, flops_per_time_unit=1e6)
    return block, head_costs(
        hidden=config.dim, vocab=config.vocab, tokens=tokens, shards=1, flops_per_time_unit=1e6
    )


def simulated_rows(
    config: GPTConfig, ranks: int, schedule: str, microbatches: int, tokens: int
) -> dict[str, float]:
    """Iteration times (plain even, plain best cut, vocabulary-parallel) and last-stage memory ratios."""
    block, plain_head = _layer_costs(config, tokens)
    shard_head = head_costs(
        hidden=config.dim, vocab=config.vocab, tokens=tokens, shards=ranks, flops_per_time_unit=1e6
    )
    work = {
        name: [float(getattr(block, name))] * config.n_layers for name in ("f", "b", "w", "mem_b", "mem_w")
    }
    plain = {name: [*values] for name, values in work.items()}
    for name, extra in (("f", plain_head.plain_f), ("b", plain_head.plain_b), ("w", plain_head.plain_w)):
        plain[name].append(extra)
    plain["mem_b"].append(plain_head.plain_mem)
    plain["mem_w"].append(plain_head.plain_mem)
    probe = build_schedule(schedule, ranks, microbatches, validate=False)
    stage_ranks = probe.placement.stage_ranks
    results: dict[str, float] = {}
    totals = [f + b + w for f, b, w in zip(plain["f"], plain["b"], plain["w"])]
    cuts = {
        "even": _even_bounds(len(totals), len(stage_ranks)),
        "best": _best_bounds(totals, stage_ranks),
    }
    timelines = {}
    for label, bounds in cuts.items():
        costs = _stage_model(plain, bounds)
        timelines[label] = simulate(build_schedule(schedule, ranks, microbatches, costs), costs)
    # the best plain cut: the balanced partition, or the even one where the schedule runs that faster
    timelines["best"] = min(timelines.values(), key=lambda timeline: timeline.iteration_time)
    for label, timeline in timelines.items():
        results[f"plain {label}"] = timeline.iteration_time
        results[f"plain {label} memory"] = _last_stage_ratio(timeline)
    vocab_bounds = _best_bounds([f + b + w for f, b, w in zip(work["f"], work["b"], work["w"])], stage_ranks)
    costs = shard_head.vocab(_stage_model(work, vocab_bounds))
    timeline = simulate(build_schedule(schedule, ranks, microbatches, costs, vocab_parallel=True), costs)
    results["vocab"] = timeline.iteration_time
    results["vocab memory"] = _last_stage_ratio(timeline)
    return results


def _even_bounds(count: int, stages: int) -> list[int]:
    return [round(i * count / stages) for i in range(stages + 1)]


def _best_bounds(work: Sequence[float], stage_ranks: Sequence[int]) -> list[int]:
    found = optimal_partition(work, stage_ranks)
    assert found is not None
    return [0, *found.cuts, len(work)]


def _stage_model(per_layer: dict[str, list[float]], bounds: Sequence[int]) -> CostModel:
    """Per-virtual-stage costs: each stage the sum of its layers'."""
    sums = {
        name: [sum(values[bounds[s] : bounds[s + 1]]) for s in range(len(bounds) - 1)]
        for name, values in per_layer.items()
    }
    return CostModel(**sums)


def _last_stage_ratio(timeline: Any) -> float:
    """The peak activation memory of the last stage's rank over the largest of the other ranks'."""
    schedule = timeline.schedule
    last = schedule.placement.rank_of(schedule.num_stages - 1)
    others = [peak for rank, peak in enumerate(timeline.peak_memory) if rank != last]
    return timeline.peak_memory[last] / max(others) if others and max(others) > 0 else float("nan")


def paper_scale_config(vocab: int) -> GPTConfig:
    """For scale: a 1.5B-parameter-class GPT (22 blocks, width 2304, 24 heads, 1024-token sequences)."""
    return GPTConfig(vocab=vocab, seq_len=1024, dim=2304, heads=24, n_layers=22)


def simulated_table(
    ranks: Sequence[int], microbatches: int, tokens: int, *, paper_scale: bool = False
) -> Table:
    """The simulated comparison for every vocabulary, rank count and schedule: the bench's model, or
    (``paper_scale``) a 1.5B-class model with one 1024-token sequence per microbatch."""
    make = paper_scale_config if paper_scale else bench_config
    sample = make(VOCABS[0])
    tokens = sample.seq_len if paper_scale else tokens
    table = Table(
        f"bench vocab, simulated: GPT-like {sample.n_layers} blocks d={sample.dim}, {tokens} tokens per "
        f"microbatch, m={microbatches}",
        [
            "vocab", "ranks", "schedule", "plain even", "plain best cut", "vocab-parallel",
            "best cut / vocab-parallel", "last-stage memory: best cut", "vocab-parallel",
        ],
    )  # fmt: skip
    for vocab in VOCABS:
        config = make(vocab)
        for p in ranks:
            for name in SCHEDULES:
                row = simulated_rows(config, p, name, microbatches, tokens)
                table.rows.append(
                    [
                        f"{vocab // 1024}k", str(p), name, f"{row['plain even']:.0f}",
                        f"{row['plain best']:.0f}", f"{row['vocab']:.0f}",
                        f"{row['plain best'] / row['vocab']:.2f}×",
                        f"{row['plain best memory']:.2f}", f"{row['vocab memory']:.2f}",
                    ]
                )  # fmt: skip
    table.notes.append(
        "Times in MFLOP-units of the simulator (Table 1 costs for a block, 2·n·h·V per head pass); "
        "memory: the last stage's rank's peak activation memory over the largest other rank's."
    )
    return table


# -- published shapes: the placement against its partition reference -----------------------------

#: (hidden, heads, layers, vocabulary, ranks) of the shapes the paper (arXiv 2411.05288) reports.
PUBLISHED = {"Llama 3 8B": (4096, 32, 32, 128256, 8), "Qwen2.5 1.5B": (1536, 12, 28, 151936, 4)}
#: The head's measured cost over its FLOP share (the paper's measurement: softmax and cross-entropy).
HEAD_MEASURED_FACTOR = 1.6
#: FLOPs per time unit (1 ms at 400 TFLOP/s) and bytes per time unit (100 GB/s links).
FLOPS_PER_MS, BYTES_PER_MS = 4e11, 1e8


def published_costs(shape: str, seq: int = 4096) -> tuple[CostModel, int]:
    """Per-rank costs (ms, bytes) of ``shape`` with one ``seq``-token sequence per microbatch."""
    hidden, heads, layers, vocab, ranks = PUBLISHED[shape]
    hop = seq * hidden * 2 / BYTES_PER_MS
    block = transformer_costs(
        hidden, heads, seq, 1, layers_per_stage=layers / ranks, flops_per_time_unit=FLOPS_PER_MS, comm=hop
    )
    head = head_costs(hidden=hidden, vocab=vocab, tokens=seq, shards=ranks, flops_per_time_unit=FLOPS_PER_MS)
    return block.replace(
        vocab_s=head.vocab_s * HEAD_MEASURED_FACTOR, vocab_t=head.vocab_t * HEAD_MEASURED_FACTOR,
        vocab_mem=head.vocab_mem, vocab_comm=3 * hop,
    ), ranks  # fmt: skip


def _previous_policies(microbatches: int) -> tuple[VocabPolicy, ...]:
    """The policies the placement tried before the deeper warm-up (for the "before" column)."""
    first = tuple(policy for policy in default_policies(microbatches) if not policy.deeper)
    return first + tuple(q for policy in first for q in refined_policies(policy))


def published_table(*, seq: int = 4096) -> Table:
    """Per published shape and schedule (m = 4p): the partition reference, the placement's
    iteration time before (the schedule's own warm-up, no rebuilt base) and now, their ratios, and
    the work bound (a true lower bound) over now."""
    table = Table(
        f"bench vocab --published: {seq}-token microbatches, m = 4p, head {HEAD_MEASURED_FACTOR}× its FLOPs",
        ["shape", "p", "schedule", "reference (ms)", "before (ms)", "ratio", "now (ms)", "ratio",
         "work bound (ms)", "bound / now"],
    )  # fmt: skip
    for shape in PUBLISHED:
        costs, p = published_costs(shape, seq)
        for name in SCHEDULES:
            reference = partition_reference(name, p, 4 * p, costs)
            bound = work_bound(name, p, 4 * p, costs)
            now = build_schedule(name, p, 4 * p, costs, vocab_parallel=True)
            before = _before(name, p, costs)
            times = [simulate(s, costs).iteration_time for s in (before, now)]
            table.rows.append(
                [shape, str(p), name, f"{reference:.1f}", f"{times[0]:.1f}", f"{reference / times[0]:.3f}",
                 f"{times[1]:.1f}", f"{reference / times[1]:.3f}", f"{bound:.1f}", f"{bound / times[1]:.3f}"]
            )  # fmt: skip
    table.notes.append(
        "reference: partition_reference, the schedule with each rank's head shard folded into its "
        "stages (not a lower bound: ratios above 1 are placements that beat the fold); work bound: "
        "work_bound, the busiest rank's compute with its S and T (a true lower bound)"
    )
    return table


def _before(name: str, p: int, costs: CostModel) -> Any:
    """The placement as it was: the base built under the budget, the first policies, no deeper warm-up."""
    from zerobubble.schedule.vocab import vocab_budgets

    base_costs, final = vocab_budgets(costs, p, budget_given=False)
    base = build_schedule(name, p, 4 * p, base_costs)
    return add_vocab_ops(base, final, policies=_previous_policies(4 * p))


# -- measured -------------------------------------------------------------------------------------


def vocab_parallel_parts(
    layers: list[nn.Module],
) -> tuple[VocabParallelEmbedding, list[nn.Module], VocabParallelHead]:
    """``gpt_layers``' model as a vocabulary-parallel embedding, the layers between and the head
    (the same Parameters: the two models compute the same loss)."""
    embedding_layer, blocks, head_layer = layers[0], layers[1:-1], layers[-1]
    assert isinstance(embedding_layer, Embedding) and isinstance(head_layer, Head)
    embedding = VocabParallelEmbedding.from_embedding(embedding_layer.tokens)
    head = VocabParallelHead.from_linear(head_layer.logits)
    return embedding, [_AddPositions(embedding_layer.positions), *blocks, head_layer.norm], head


class _AddPositions(nn.Module):
    """The learned position embedding added to the (vocabulary-parallel) token embedding."""

    def __init__(self, positions: nn.Embedding):
        super().__init__()
        self.positions = positions

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.positions(torch.arange(hidden.shape[1], device=hidden.device))


def _measure_rank(vocab: int, schedule: str, m: int, rows: int, rounds: int, steps: int) -> dict[str, Any]:
    init_distributed(backend="gloo", timeout=600)
    config = bench_config(vocab)
    batch = _random_batch(config, m * rows)
    pipes: dict[str, Any] = {}
    with preserved_torch_state():
        torch.manual_seed(0)
        plain_layers = gpt_layers(config)
    pipes["plain, partition=profile"] = Pipeline(
        plain_layers, schedule=schedule, microbatches=m, loss_fn=lm_loss, partition="profile",
        example=batch, calibrate=0, timeout=600,
    )  # fmt: skip
    with preserved_torch_state():
        torch.manual_seed(0)
        embedding, layers, head = vocab_parallel_parts(gpt_layers(config))
    pipes["vocab-parallel"] = Pipeline(
        layers, schedule=schedule, microbatches=m, head=head, embedding=embedding, timeout=600
    )
    times = interleaved(
        {name: our_step(pipe, batch) for name, pipe in pipes.items()}, rounds, steps, warmup=1
    )
    memory = {name: _peak(pipe, batch) for name, pipe in pipes.items()}
    last = {
        name: pipe.schedule.placement.rank_of(pipe.schedule.num_stages - 1) for name, pipe in pipes.items()
    }
    return {"times": times, "memory": memory, "last": last, "rank": pipes["vocab-parallel"].rank}


def _random_batch(config: GPTConfig, sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random tokens and labels: a speed benchmark needs no learnable corpus (and the Markov
    corpus draws a permutation of the vocabulary per token: seconds at 128k)."""
    generator = torch.Generator().manual_seed(1)
    shape = (sequences, config.seq_len)
    return torch.randint(config.vocab, shape, generator=generator), torch.randint(
        config.vocab, shape, generator=generator
    )


def _peak(pipe: Pipeline, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    meter = ActivationMeter(pipe, batch)
    pipe.recorder = meter
    with meter.hooks():
        pipe.step(*batch)
    pipe.recorder = None
    pipe.zero_grad()
    return meter.peak


def measured_table(ranks: Sequence[int], schedule: str, m: int, rows: int, rounds: int, steps: int) -> Table:
    """Plain (``partition="profile"``) against vocabulary-parallel on spawned CPU ranks."""
    table = Table(
        f"bench vocab, measured on CPU ranks: GPT-like 8 blocks d=64 seq=32, {schedule}, m={m}, "
        f"{rows} sequences per microbatch",
        [
            "vocab", "ranks", "plain, partition=profile (s)", "vocab-parallel (s)", "speed-up",
            "last-stage memory: plain", "vocab-parallel",
        ],
    )  # fmt: skip
    for vocab in VOCABS:
        for p in ranks:
            results = launch(_measure_rank, p, (vocab, schedule, m, rows, rounds, steps), threads=1)
            times = results[0]["times"]
            plain, vocab_time = median(times["plain, partition=profile"]), median(times["vocab-parallel"])
            ratios = [
                _measured_ratio(results, name) for name in ("plain, partition=profile", "vocab-parallel")
            ]
            table.rows.append(
                [
                    f"{vocab // 1024}k", str(p), f"{plain:.3f}", f"{vocab_time:.3f}",
                    f"{plain / vocab_time:.2f}×", f"{ratios[0]:.2f}", f"{ratios[1]:.2f}",
                ]
            )  # fmt: skip
    table.notes.append(
        f"Medians of {rounds} rotating rounds × {steps} steps (barrier to barrier) on rank 0; memory: "
        "the last stage's rank's measured activation peak over the largest other rank's."
    )
    return table


def _measured_ratio(results: list[dict[str, Any]], name: str) -> float:
    peaks = {result["rank"]: result["memory"][name] for result in results}
    last = results[0]["last"][name]
    others = [peak for rank, peak in peaks.items() if rank != last]
    return peaks[last] / max(others) if others and max(others) > 0 else float("nan")


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per microbatch in the simulation")
    parser.add_argument("--rows", type=int, default=2, help="sequences per microbatch on the CPU ranks")
    parser.add_argument("--schedule", default="zb-h1", help="the schedule of the measured runs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps-per-round", type=int, default=2)
    parser.add_argument("--simulate-only", action="store_true", help="skip the measured runs")
    parser.add_argument(
        "--published", action="store_true",
        help="only the placement at the paper's shapes (Llama 3 8B, Qwen2.5 1.5B) against its reference",
    )  # fmt: skip
    parser.add_argument(
        "--paper-scale", action="store_true", help="also simulate a 1.5B-class model (22 blocks, d=2304)"
    )


def _run(args: argparse.Namespace) -> list[Table]:
    if args.published:
        return [published_table()]
    tables = [simulated_table(args.ranks, args.microbatches, args.tokens)]
    if args.paper_scale:
        tables.append(simulated_table(args.ranks, args.microbatches, args.tokens, paper_scale=True))
    if not args.simulate_only:
        tables.append(
            measured_table(
                args.ranks, args.schedule, args.microbatches, args.rows, args.rounds, args.steps_per_round
            )
        )
    return tables


BENCHMARK = Benchmark(
    "vocab", "vocabulary-parallel head and embedding against the best plain cut", _add_arguments, _run
)
