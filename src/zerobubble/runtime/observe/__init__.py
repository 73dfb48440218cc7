"""Observe: what a step reports and how it is measured.

:mod:`.recorder` (the protocol the executor and channels report to), :mod:`.trace` (recorded
timelines), :mod:`.ranges` (profiler range names) and :mod:`.memory` (the activation meter).
Below :mod:`..execute`, which reports into it (``docs/architecture.md``, "Rooms of the runtime").
"""
