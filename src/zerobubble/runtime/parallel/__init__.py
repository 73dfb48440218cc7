"""Parallel: how the ranks are laid out and what they agree on.

:mod:`.mesh` (a ``DeviceMesh``'s dimensions), :mod:`.groups` (the process groups a Pipeline makes),
:mod:`.data_parallel` (replicas and their gradient averager), :mod:`.fsdp` (FSDP2 units) and
:mod:`.consistency` (what every rank must agree on; tied parameters).  Imports only the runtime's
base modules (``docs/architecture.md``, "Rooms of the runtime").
"""
