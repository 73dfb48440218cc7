"""State: a Pipeline's state dicts, interchangeable with the unpipelined model's.

:mod:`.checkpoint` (names, merging, optimizer state by name) and :mod:`.pipeline_state` (what
``Pipeline.state_dict`` and friends delegate to).
"""
