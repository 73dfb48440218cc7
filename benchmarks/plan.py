"""schedule="auto" against even-split zb-v and torch's ZBV on an uneven LM (2 and 4 CPU ranks), and
against our hand-picked schedules on the balanced MLP of ``bench pipelines``.

    python benchmarks/plan.py [options]     (the same as: zerobubble bench plan [options])

Prints Markdown tables, with the machine they ran on.
"""

import sys

from zerobubble.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "plan", *sys.argv[1:]]))
