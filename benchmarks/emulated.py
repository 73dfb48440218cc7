"""Emulated pipelines: measured against predicted iteration time for every schedule, p = 4 and 8.

    python benchmarks/emulated.py [options]     (the same as: zerobubble bench emulate [options])

Prints Markdown tables, with the machine they ran on.
"""

import sys

from zerobubble.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "emulate", *sys.argv[1:]]))
