"""The B/W split's cost: T_B + T_W against the fused backward of the same stage, for the fast
paths, the generic split and torch.distributed.pipelining's split; with ``--models`` also the W
share per stage of real models (GPT-2, Llama, a BatchNorm conv net, checkpointed blocks) on 2 ranks.

    python benchmarks/wgrad_split.py [options]     (the same as: zerobubble bench wgrad [options])
    python benchmarks/wgrad_split.py --device cuda  (on a machine with a GPU)

Prints Markdown tables, with the machine they ran on.
"""

import sys

from zerobubble.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "wgrad", *sys.argv[1:]]))
