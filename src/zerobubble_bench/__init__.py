"""Benchmarks of zerobubble: the code behind ``zerobubble bench`` and ``benchmarks/*.py``.

Not part of the library (``zerobubble``).  One module per benchmark — :mod:`.pipelines`,
:mod:`.wgrad`, :mod:`.split_models`, :mod:`.emulate`, :mod:`.schedulers`, :mod:`.plan`,
:mod:`.memory` — over the shared models and runners of :mod:`.workloads` and the result
:class:`~.tables.Table` of :mod:`.tables`.  Every benchmark measures its configurations side by
side in one run and reports medians and ratios.
"""
