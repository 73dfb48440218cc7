"""Record the iteration times of the searching schedulers on issue 29's cost grid.

    python benchmarks/schedulers_grid_baseline.py [--output PATH]

Writes ``benchmarks/data/schedulers_grid_baseline.json`` (by default): the grid's parameters and
every schedule's iteration time on every setting, which ``zerobubble bench schedulers --grid``
compares the current builders with.  Rerun it only to accept new results on purpose.
"""

import argparse
from pathlib import Path

from zerobubble_bench.cost_grid import BASELINE_PATH, DEFAULT_GRID, record_baseline

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=BASELINE_PATH)
    args = parser.parse_args()
    record_baseline(args.output, dict(DEFAULT_GRID))
    print(f"wrote {args.output}")
