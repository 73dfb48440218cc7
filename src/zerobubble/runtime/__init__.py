"""The torch runtime: executes any :class:`~zerobubble.schedule.Schedule` on ``torch.distributed``.

Its modules live in rooms, one concern each, importing one way (``docs/architecture.md``, "Rooms
of the runtime"): :mod:`.parallel` (mesh, groups, data parallel, FSDP, what ranks agree on),
:mod:`.observe` (recorder, trace, profiler ranges, memory), :mod:`.execute` (the executor, channels,
model ends, emulation), :mod:`.wgrad` (the B/W split), :mod:`.vocab` (vocabulary parallelism),
:mod:`.construct` (request → resolution → placed stages, profiling and planning),
:mod:`.optim` (post-validated optimizer step, rollback), :mod:`.state` (state dicts).  Directly
here: :mod:`.pipeline` (the user-facing :class:`Pipeline`), :mod:`.launch` (starting local ranks),
:mod:`.failures` (error notices and waits with a deadline), :mod:`.tensors` (tensors inside runtime
objects and their bytes) and :class:`PipelineError`.

A module's old flat path (``zerobubble.runtime.trace``, ``zerobubble.runtime.vocab_layers``, ...)
still imports: :data:`MOVED` maps it to its room's module, the same module object.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import ClassVar

from ..errors import PipelineError

#: A module's flat path before the rooms (``zerobubble.runtime.<old>``) -> its module now.
MOVED = {
    "auto": "construct.auto",
    "build": "construct.build",
    "checkpoint": "state.checkpoint",
    "comm": "execute.comm",
    "compiled": "construct.compiled",
    "consistency": "parallel.consistency",
    "construction": "construct.construction",
    "data_parallel": "parallel.data_parallel",
    "emulate": "execute.emulate",
    "ends": "execute.ends",
    "executor": "execute.executor",
    "fsdp": "parallel.fsdp",
    "grad_state": "optim.grad_state",
    "groups": "parallel.groups",
    "memory": "observe.memory",
    "mesh": "parallel.mesh",
    "pipeline_calls": "construct.pipeline_calls",
    "pipeline_optimization": "optim.step",
    "pipeline_state": "state.pipeline_state",
    "profile": "construct.profile",
    "ranges": "observe.ranges",
    "recorder": "observe.recorder",
    "resolve": "construct.resolve",
    "rollback": "optim.rollback",
    "staging": "construct.staging",
    "trace": "observe.trace",
    "vocab_layers": "vocab.layers",
    "vocab_state": "vocab.state",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``zerobubble.runtime.<old>`` as the module :data:`MOVED` names (one module object)."""

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        package, _, old = fullname.rpartition(".")
        if package != __name__ or old not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(f"{__name__}.{MOVED[spec.name.rpartition('.')[2]]}")
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        alias = module.__spec__  # the import system set the alias's spec; the module keeps its own
        assert alias is not None
        module.__spec__ = self._specs.pop(alias.name)

    _specs: ClassVar[dict[str, importlib.machinery.ModuleSpec | None]] = {}


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())


def __dir__() -> list[str]:
    """The module's names, the lazily imported :class:`Pipeline` included."""
    return sorted({*globals(), *__all__})


def __getattr__(name: str):
    if name == "Pipeline":
        from .pipeline import Pipeline

        return Pipeline
    raise AttributeError(f"module 'zerobubble.runtime' has no attribute {name!r}")


__all__ = ["Pipeline", "PipelineError"]
