"""Measured peak memory: every bounded schedule's activations over the simulator's bound, then the
V schedules' process memory over 1F1B's.

    python benchmarks/memory.py [--repeats 5] [--tame] [--no-bound]

Both on 2 local gloo ranks under the Pipeline's default plan (no ``costs``).  The first table:
8 Linear–GELU–Linear blocks (width 16, 4 rows per microbatch), m = 8, 16, 32; each cell lists rank
0's and rank 1's activation peak over its bound.  The second: 8 Linear–GELU–Dropout–Linear blocks
(width 256, 64 rows), m = 16; the activation meter, every live tensor and RSS growth of the busiest
rank over 1F1B's, medians over ``--repeats`` (``--tame``: glibc returns freed tensors' pages at once).
"""

import argparse

from zerobubble_bench.memory import memory_table, process_memory_table

SCHEDULES = ["1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-1p", "zb-2p", "zb-v", "v-half", "v-min"]

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tame", action="store_true", help="glibc: mmap every buffer from 64 KiB")
    parser.add_argument("--no-bound", action="store_true", help="skip the table against the bound")
    args = parser.parse_args()
    if not args.no_bound:
        print("\n".join(memory_table(SCHEDULES)))
        print()
    print(process_memory_table(repeats=args.repeats, tame=args.tame).markdown())
