"""Compiled layers: ``torch.compile`` on a pipeline's layers, names kept (``docs/wgrad.md``, "torch.compile").

Every compiled layer ends up in one form, ``nn.Module.compile``'s: the layer itself (its own
parameter names) with ``_compiled_call_impl`` set, so that ``layer(x)`` runs its ``_call_impl``
compiled — the layer's own forward and hooks, nothing of the split's:

* ``layer.compile(...)`` by the user: kept as it is;
* ``torch.compile(layer, ...)`` (an ``OptimizedModule``, whose parameters are named
  ``_orig_mod.*``): replaced by ``layer._orig_mod``, compiled in place with the same dynamo
  context (backend, mode, ``fullgraph``, ...) — so ``pipe.state_dict()`` has the names of the
  uncompiled model and checkpoints interchange with it;
* ``Pipeline(..., compile=True)`` or ``compile={...}``: ``layer.compile(**kwargs)`` on every layer
  not compiled already.

:func:`~..wgrad.install.install_deferral` then leaves such a layer whole
(:func:`~..wgrad.install.is_compiled`).
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from .. import PipelineError


def _optimized_module_type() -> type | None:
    """``OptimizedModule``, or None while dynamo is not loaded: no instance can exist before its module
    is imported (``torch.compile`` imports it), and importing dynamo costs about 2 s of CPU."""
    if "torch._dynamo.eval_frame" not in sys.modules:
        return None
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover - a torch without dynamo
        return None
    return OptimizedModule


def unwrap_compiled(layer: nn.Module) -> nn.Module:
    """``torch.compile(module)`` -> ``module``, compiled in place with the same options; else ``layer``."""
    optimized = _optimized_module_type()
    if optimized is None or not isinstance(layer, optimized):
        return layer
    inner = layer._orig_mod
    if not isinstance(inner, nn.Module):  # pragma: no cover - OptimizedModule always wraps a module
        return layer
    # what nn.Module.compile does, with the OptimizedModule's own dynamo context (its options)
    context: Any = layer.dynamo_ctx  # a _TorchDynamoContext: calling it on a function compiles that
    inner._compiled_call_impl = context(inner._call_impl)
    return inner


def compile_options(compile: bool | Mapping[str, Any]) -> dict[str, Any] | None:
    """``Pipeline(compile=...)`` as ``torch.compile`` keyword arguments, or None for no compiling."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return {}
    if isinstance(compile, Mapping):
        return dict(compile)
    raise PipelineError(
        "compile= takes True, False or a dict of torch.compile keyword arguments, "
        f"not {type(compile).__name__}"
    )


def prepare_layers(
    layers: nn.Sequential | Sequence[nn.Module], compile: bool | Mapping[str, Any] = False
) -> nn.Sequential | Sequence[nn.Module]:
    """The layers with every compiled one in ``module.compile()``'s form (module docstring).

    An ``nn.Sequential`` comes back as a new Sequential of the same child names when a child was
    unwrapped (the user's is not changed); a list as a list.  ``compile`` compiles the layers that
    are not compiled yet, in place."""
    options = compile_options(compile)
    if isinstance(layers, nn.Sequential):
        named = list(layers.named_children())
    else:
        named = [(str(index), layer) for index, layer in enumerate(layers)]
    prepared = [
        (name, unwrap_compiled(layer) if isinstance(layer, nn.Module) else layer) for name, layer in named
    ]
    if options is not None:
        for _, layer in prepared:
            if isinstance(layer, nn.Module) and getattr(layer, "_compiled_call_impl", None) is None:
                layer.compile(**options)
    if all(new is old for (_, new), (_, old) in zip(prepared, named, strict=True)):
        return layers
    if isinstance(layers, nn.Sequential):
        return nn.Sequential(OrderedDict(prepared))
    return [layer for _, layer in prepared]


def compiled_layers(layers: Sequence[nn.Module]) -> list[nn.Module]:
    """The layers among ``layers`` that run compiled."""
    return [layer for layer in layers if getattr(layer, "_compiled_call_impl", None) is not None]
