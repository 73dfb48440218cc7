"""dualpipe-v, zb-v and 1f1b side by side, simulated at a DeepSeek-V3-like shape.

    python benchmarks/dualpipe_sim.py [--ranks 16] [--microbatches 64] [--ratios 0,0.5,1,1.5]

The shape: 61 layers, the first 3 dense and the other 58 mixture-of-experts (256 routed experts, 8
active, 64-way expert parallelism), on 16 pipeline ranks; the V schedules cut the layers into 32
chunks (2 a rank), 1F1B into 16 stages.  A layer's F, B and W take one unit each; each MoE layer's
F and B add an expert all-to-all of ``ratio`` units (DeepSeek-V3 reports computation about equal
to its all-to-all: ratio 1).  The routing shape enters through that ratio only.  Prints one
Markdown table per ratio: iteration time, bubble against the compute-only ideal, and speed-ups.
"""

from __future__ import annotations

import argparse

from zerobubble.schedule import CostModel, build_schedule, simulate

LAYERS, DENSE = 61, 3


def moe_share(stage: int, stages: int) -> float:
    """Layers of ``stage`` (of ``stages`` equal slices of the model) that are MoE layers."""
    lo, hi = stage * LAYERS / stages, (stage + 1) * LAYERS / stages
    return max(0.0, hi - max(lo, DENSE))


def costs_for(stages: int, ratio: float) -> CostModel:
    """Per-stage costs of ``stages`` equal slices (one list entry per virtual stage)."""
    layers = [LAYERS / stages] * stages
    return CostModel(f=layers, b=layers, w=layers, a2a=[ratio * moe_share(s, stages) for s in range(stages)])


def run(ranks: int, microbatches: int, ratio: float) -> list[tuple[str, float, float]]:
    rows = []
    for name, stages in (("dualpipe-v", 2 * ranks), ("zb-v", 2 * ranks), ("1f1b", ranks)):
        costs = costs_for(stages, ratio)
        timeline = simulate(build_schedule(name, ranks, microbatches, costs), costs)
        rows.append((name, timeline.iteration_time, timeline.bubble_rate))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=64)
    parser.add_argument("--ratios", default="0,0.5,1,1.5", help="all-to-all time per unit of compute")
    args = parser.parse_args()
    print(
        f"DeepSeek-V3-like: {LAYERS} layers ({DENSE} dense), 256 experts top-8, EP 64, "
        f"{args.ranks} pipeline ranks, {args.microbatches} microbatches; simulated, unit = one layer's F"
    )
    for ratio in (float(r) for r in args.ratios.split(",")):
        rows = run(args.ranks, args.microbatches, ratio)
        times = {name: time for name, time, _ in rows}
        print(f"\nall-to-all : compute = {ratio:g} : 1\n")
        print("| schedule | iteration time | bubble (vs compute) | speed-up vs 1f1b | time saved vs zb-v |")
        print("|---|---:|---:|---:|---:|")
        for name, time, bubble in rows:
            print(
                f"| {name} | {time:.1f} | {bubble:.1%} | {times['1f1b'] / time:.3f}× "
                f"| {(times['zb-v'] - time) / times['zb-v']:+.1%} |"
            )


if __name__ == "__main__":
    main()
