"""The B/W split's cost: T_B + T_W against the fused backward of the same stage.

    python benchmarks/wgrad_split.py [options]     (the same as: zerobubble bench wgrad [options])

Prints Markdown tables, with the machine they ran on.
"""

import sys

from zerobubble.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "wgrad", *sys.argv[1:]]))
