"""Execute: one rank's program run for one step.

:mod:`.executor` (the dispatch loop and its hooks), :mod:`.comm` (point-to-point channels),
:mod:`.ends` (the model-ends protocol) and :mod:`.emulate` (compute stretched to modelled costs).
"""
