"""zb-v against the authors' ZB-V heuristic on random settings held out from its tuning.

    python benchmarks/zb_v_random_settings.py [--settings 40] [--seed 12]

The authors' heuristic (fill to the limit, equalise, F-B-W steady state; best of its four fill
variants, each with its bubble-approval passes) is :mod:`zerobubble.schedule.builders.planning.v_equalised`,
which reproduces the authors' published ZB-V iteration times exactly on all 12 Table 5 setups
(``tests/schedule/builders/test_v_reference.py``).  Settings: p in 4..32, m in 2p..8p, per-stage F/B/W times,
T_comm up to 10 % of T_F, M_W/M_B in 0..0.6, memory limit p·M_B.  Prints one line per setting and
the share of settings where zb-v is at least as fast.
"""

from __future__ import annotations

import argparse
import math
import random
import time

from zerobubble.schedule import CostModel, Placement, build_schedule, simulate
from zerobubble.schedule.builders.planning.v_equalised import EQUALISED_VARIANTS, equalised_plan


def random_setting(rng: random.Random) -> tuple[int, int, CostModel]:
    p = rng.randint(4, 32)
    m = rng.randint(2 * p, 8 * p)
    f = [rng.uniform(0.8, 1.2) for _ in range(p)]
    costs = CostModel(
        f=f,
        b=[rng.uniform(0.8, 1.3) for _ in range(p)],
        w=[rng.uniform(0.3, 1.0) for _ in range(p)],
        comm=rng.uniform(0.0, 0.1) * min(f),
        mem_b=1.0,
        mem_w=rng.uniform(0.0, 0.6),
    )
    return p, m, costs.with_memory_limit(float(p))


def authors_heuristic(p: int, m: int, costs: CostModel) -> float:
    """Iteration time of the best of the authors' four variants (all passes, no budget)."""
    resolved = costs.resolve(Placement.vshape(p))
    times = [equalised_plan(resolved, m, variant)[0] for variant in EQUALISED_VARIANTS]
    return min((plan.iteration_time() for plan in times if plan is not None), default=math.inf)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", type=int, default=40)
    parser.add_argument("--seed", type=int, default=12)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    wins = 0
    worst = 0.0
    for index in range(args.settings):
        p, m, costs = random_setting(rng)
        started = time.perf_counter()
        ours = simulate(build_schedule("zb-v", p, m, costs), costs).iteration_time
        elapsed = time.perf_counter() - started
        theirs = authors_heuristic(p, m, costs)
        ratio = ours / theirs
        wins += ratio <= 1 + 1e-9
        worst = max(worst, ratio)
        print(f"{index:3d}  p={p:2d} m={m:3d}  ours/theirs {ratio:.4f}  (build {elapsed:.2f} s)", flush=True)
    print(
        f"\nzb-v at least as fast as the authors' heuristic on {wins} of {args.settings} settings; "
        f"worst ratio {worst:.4f}"
    )


if __name__ == "__main__":
    main()
