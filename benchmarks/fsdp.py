"""Data parallelism replicated, with ZeRO, or sharded by FSDP2: bytes per rank and step time, 4 ranks.

    python benchmarks/fsdp.py [options]     (the same as: zerobubble bench fsdp [options])

Prints a Markdown table, with the machine it ran on.
"""

import sys

from zerobubble.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "fsdp", *sys.argv[1:]]))
