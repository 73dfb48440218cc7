"""Measured peak activation memory of every bounded schedule over the simulator's bound, m = 8, 16, 32.

    python benchmarks/memory.py

2 local gloo ranks, 8 Linear–GELU–Linear blocks (width 16, 4 rows per microbatch), the Pipeline's
default plan (no ``costs``).  Each cell lists rank 0's and rank 1's peak over its bound.
"""

from zerobubble_bench.memory import memory_table

SCHEDULES = ["1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-1p", "zb-2p", "zb-v", "v-half", "v-min"]

if __name__ == "__main__":
    print("\n".join(memory_table(SCHEDULES)))
