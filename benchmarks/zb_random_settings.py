"""zb-1p and zb-2p against the authors' ZB-1p/ZB-2p heuristic on random settings.

    python benchmarks/zb_random_settings.py [--settings 30] [--seed 12]

The authors' heuristic (their public ``zb.py``: the round-based greedy under the memory limit, the
best of its eight variants — whether warm-up forwards may delay the first B, whether a B may
pre-empt a forward, whether short gaps get a W) is our round planner,
:data:`zerobubble.schedule.builders.zb_auto.GREEDY_VARIANTS`, run here without a budget.  Ours is
``build_schedule("zb-1p" / "zb-2p", ...)``: those eight among other candidates, under an op budget.
Settings are those of ``zb_v_random_settings.py`` (p in 4..32, m in 2p..8p, per-stage F/B/W, T_comm
up to 10 % of T_F, M_W/M_B in 0..0.6); the limit is p·M_B (zb-1p) or 2p·M_B (zb-2p).  Prints one
line per setting and the share where ours is at least as fast, in iteration time.
"""

from __future__ import annotations

import argparse
import math
import random
import time

from zb_v_random_settings import random_setting
from zerobubble.schedule import REGISTRY, CostModel, Placement, build_schedule, simulate
from zerobubble.schedule.builders.planning import Stuck
from zerobubble.schedule.builders.zb_auto import GREEDY_VARIANTS

SCHEDULES = ("zb-1p", "zb-2p")


def authors_heuristic(name: str, p: int, m: int, costs: CostModel) -> float:
    """Iteration time of the best of the authors' eight greedy variants (no budget)."""
    resolved = REGISTRY[name].resolve_costs(costs, p).resolve(Placement.loop(p))
    best = math.inf
    for variant in GREEDY_VARIANTS:
        try:
            best = min(best, variant.planner(resolved, m).plan().iteration_time())
        except Stuck:
            continue
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", type=int, default=30)
    parser.add_argument("--seed", type=int, default=12)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    wins = dict.fromkeys(SCHEDULES, 0)
    worst = dict.fromkeys(SCHEDULES, 0.0)
    for index in range(args.settings):
        p, m, costs = random_setting(rng)
        costs = costs.with_memory_limit(None)  # each schedule applies its own limit
        line = [f"{index:3d}  p={p:2d} m={m:3d}"]
        for name in SCHEDULES:
            started = time.perf_counter()
            ours = simulate(build_schedule(name, p, m, costs), costs).iteration_time
            elapsed = time.perf_counter() - started
            ratio = ours / authors_heuristic(name, p, m, costs)
            wins[name] += ratio <= 1 + 1e-9
            worst[name] = max(worst[name], ratio)
            line.append(f"{name} ours/theirs {ratio:.4f} ({elapsed:.2f} s)")
        print("  ".join(line), flush=True)
    for name in SCHEDULES:
        print(
            f"\n{name} at least as fast as the authors' heuristic on {wins[name]} of {args.settings} "
            f"settings; worst ratio {worst[name]:.4f}",
            end="",
        )
    print()


if __name__ == "__main__":
    main()
