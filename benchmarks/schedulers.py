"""Build time of the searching schedulers at p = 32, m = 256, and the V schedules against the authors'.

    python benchmarks/schedulers.py [options]     (the same as: zerobubble bench schedulers [options])

Prints Markdown tables, with the machine they ran on.
"""

import sys

from zerobubble.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "schedulers", *sys.argv[1:]]))
