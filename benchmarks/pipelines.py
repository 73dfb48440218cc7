"""Our schedules against torch.distributed.pipelining and the single-process step on 2 CPU ranks.

    python benchmarks/pipelines.py [options]     (the same as: zerobubble bench pipelines [options])

Prints Markdown tables, with the machine they ran on.
"""

import sys

from zerobubble.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "pipelines", *sys.argv[1:]]))
