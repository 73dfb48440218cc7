"""Construct: a Pipeline's request resolved, planned and placed, and its calls prepared.

:mod:`.construction` (world and resolution), :mod:`.resolve` (the frozen ``Resolution``),
:mod:`.staging` (layers to stages and microbatches), :mod:`.build` (this rank's part),
:mod:`.compiled` (``torch.compile``'d layers), :mod:`.auto` and :mod:`.profile` (profiling and
planning for ``schedule="auto"``) and :mod:`.pipeline_calls` (each call checked and split).
"""
