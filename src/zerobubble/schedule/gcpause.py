"""Building and checking schedules with Python's cyclic garbage collector paused.

A builder at p = 32, m = 256 allocates a few hundred thousand small tuples and lists that live
until it returns, none of them in reference cycles.  Each allocation burst makes the collector run,
and its full passes scan every object of the process: with torch imported (tens of thousands of
objects) that took a fifth of zb-v's build time on the issue-29 grid.  Pausing it for the call
frees nothing later than reference counting would (the objects are acyclic); the collector resumes
on the way out, also on an exception.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector inside the block (a no-op when it is already paused)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
