"""The torch runtime: executes any :class:`~zerobubble.schedule.Schedule` on ``torch.distributed``.

* :mod:`.wgrad` — the B/W split of every parameter (fast paths and a generic split; gradients in W);
* :mod:`.comm` — asynchronous point-to-point transfers, one ordered channel per direction;
* :mod:`.executor` — runs one rank's program through a dispatch table over op kinds;
* :mod:`.pipeline` — the user-facing :class:`Pipeline`;
* :mod:`.consistency` — what the ranks agree on at construction and at every call; tied parameters;
* :mod:`.checkpoint` — state dicts that merge into (and load from) the unpipelined model's;
* :mod:`.failures` — error notices between ranks and waits with a deadline;
* :mod:`.memory` — measuring the activation memory a step keeps;
* :mod:`.launch` — starts local ranks when the script was not run under ``torchrun``.
"""

from ..errors import PipelineError


def __dir__() -> list[str]:
    """The module's names, the lazily imported :class:`Pipeline` included."""
    return sorted({*globals(), *__all__})


def __getattr__(name: str):
    if name == "Pipeline":
        from .pipeline import Pipeline

        return Pipeline
    raise AttributeError(f"module 'zerobubble.runtime' has no attribute {name!r}")


__all__ = ["Pipeline", "PipelineError"]
