"""The torch runtime: executes any :class:`~zerobubble.schedule.Schedule` on ``torch.distributed``.

* :mod:`.wgrad` — the B/W split of every parameter (fast paths and a generic split; gradients in W);
* :mod:`.comm` — asynchronous point-to-point transfers, one ordered channel per direction;
* :mod:`.executor` — runs one rank's program through a dispatch table over op kinds;
* :mod:`.pipeline` — the user-facing :class:`Pipeline`;
* :mod:`.launch` — starts local ranks when the script was not run under ``torchrun``.
"""


class PipelineError(RuntimeError):
    """The pipeline cannot run as asked, or a step failed; the message says where and what to do."""


def __getattr__(name: str):
    if name == "Pipeline":
        from .pipeline import Pipeline

        return Pipeline
    raise AttributeError(f"module 'zerobubble.runtime' has no attribute {name!r}")


__all__ = ["Pipeline", "PipelineError"]
