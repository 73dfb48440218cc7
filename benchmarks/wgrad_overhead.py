"""Measurements behind docs/wgrad.md: one thread, thread CPU time, medians, one table per section.

    python benchmarks/wgrad_overhead.py [section ...]   (every section when none is named)

layers   the per-layer cost the split adds around tiny kernels: fast paths, generic split
masks    the norm's and the convolution's backward kernels with each output mask
conv     the bench's conv stage split, with its convolution kernel unsplit, with nothing deferred
order    W taking the layers first to last against last to first, per bench stage
native   B through autograd's own nodes against B through the autograd function
routing  routed ``F.linear`` on the bench's MultiheadAttention block: split, forward, per call
generic  the generic split with and without its two exceptions (W from the frontier, norm kernels)
floor    the generic split against one B run per stage with W from the stage's frontier
direct   routed modules on the stage's graph against a local graph at every forward
hooks    where B's cost above a backward with frozen parameters goes
aliases  the norms' aliases accumulated by autograd against a post-hook per norm

The sections live in ``_wgrad_kernels.py`` (layers to native), ``_wgrad_generic.py`` (routing to
direct) and ``_wgrad_hooks.py`` (hooks, aliases), each saying in full what it measures, on the
timing harness of ``_wgrad_timing.py``.
"""

from __future__ import annotations

import sys

import torch

from _wgrad_generic import print_direct, print_floor, print_generic, print_routing
from _wgrad_hooks import print_aliases, print_hooks
from _wgrad_kernels import print_conv, print_layers, print_masks, print_native, print_order

SECTIONS = {
    "layers": print_layers,
    "masks": print_masks,
    "conv": print_conv,
    "order": print_order,
    "native": print_native,
    "routing": print_routing,
    "generic": print_generic,
    "floor": print_floor,
    "direct": print_direct,
    "hooks": print_hooks,
    "aliases": print_aliases,
}


def main(sections: list[str]) -> None:
    """Print the tables of ``sections`` (every one when empty), in the order of :data:`SECTIONS`."""
    from zerobubble_bench.wgrad import retain_freed_memory

    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"unknown sections {unknown}; choose from {sorted(SECTIONS)}")
    torch.set_num_threads(1)
    retain_freed_memory()  # as the bench command does: this process runs nothing else
    for name, print_section in SECTIONS.items():
        if not sections or name in sections:
            print_section()


if __name__ == "__main__":
    main(sys.argv[1:])
