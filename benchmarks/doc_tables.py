"""Regenerate, or check, the README's and the docs' blocks that are a deterministic command's output.

    python benchmarks/doc_tables.py --write     # rerun each marked command, rewrite its block
    python benchmarks/doc_tables.py --check     # exit 1 naming every block that differs (the test's check)

A block is marked ``<!-- generated: COMMAND -->`` ... ``<!-- end generated -->``
(``zerobubble_bench.doc_tables`` says what the options after the command do).
"""

import sys

from zerobubble_bench.doc_tables import main

if __name__ == "__main__":
    sys.exit(main())
