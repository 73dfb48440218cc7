"""A built Pipeline's calls: each ``step`` / ``evaluate`` checked, split, compared, and its results.

:class:`PipelineCalls` checks and splits this rank's arguments into microbatches (the inputs where
the first stage or a vocabulary-parallel embedding lives, the targets where the last stage or a
vocabulary-parallel head lives, the keyword arguments for the layers that take them), compares the
call with every rank's (:func:`~..parallel.consistency.prepare_call`, unless ``check_calls=False``), and
turns the executor's per-microbatch losses into what the call returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import Any

import torch

from .. import PipelineError
from ..execute.executor import Executor
from ..failures import Guarded
from ..parallel.consistency import CallCheck, CallSignature, prepare_call
from ..parallel.data_parallel import ParallelLayout, mean_loss
from ..vocab.runner import check_vocab_call
from .staging import merge_microbatches, split_call, split_keywords


class PipelineCalls:
    """The arguments and results of this rank's calls (see the module docstring).

    ``ends`` says whether this rank takes the inputs and the targets; ``keywords`` lists each
    layer's keyword names; ``calls`` is the per-call check (None: ``check_calls=False``).
    """

    def __init__(
        self,
        *,
        microbatches: int,
        device: torch.device,
        rank: int,
        ends: tuple[bool, bool],
        vocab_layers: tuple[Any, Any],
        keywords: Sequence[tuple[str, Any]],
        calls: CallCheck | None,
        guarded: Guarded,
    ):
        self.microbatches, self.device, self.rank, self.ends = microbatches, device, rank, ends
        self._vocab_layers, self._keywords = vocab_layers, keywords
        self._calls, self._guarded = calls, guarded

    def prepare(
        self,
        call: str,
        inputs: Any,
        targets: Any,
        loss_scale: float | None,
        kwargs: Mapping[str, Any],
        losses: Any,
        return_outputs: Any,
    ) -> tuple:
        """Check and split this rank's arguments, then compare the call with every rank's
        (collective unless ``check_calls=False``).  Returns the microbatches of the inputs, the
        targets and the keyword arguments."""
        head, embedding = self._vocab_layers  # every rank's shard needs the tokens, the labels
        checks = self._calls

        def exchange(signature: CallSignature) -> str | None:
            assert checks is not None
            return self._guarded(call, lambda: checks.exchange(signature))

        def split(i: Any, t: Any) -> tuple:
            if losses is not None and not isinstance(losses, list):
                raise PipelineError(
                    f"losses= takes a list (the per-microbatch losses are appended to it), not a "
                    f"{type(losses).__name__}"
                )
            if not isinstance(return_outputs, bool):
                raise PipelineError(f"return_outputs= takes True or False, not {return_outputs!r}")
            split_inputs, targets_mb = split_call(
                i, t, self.microbatches, self.device, call, self.rank, self.ends
            )
            check_vocab_call(head, embedding, split_inputs, targets_mb)
            kwargs_mb = split_keywords(kwargs, self.microbatches, self.device, call, self._keywords)
            return split_inputs, targets_mb, kwargs_mb

        return prepare_call(
            call, inputs, targets, loss_scale, split, exchange if checks is not None else None, kwargs
        )


def call_results(
    executor: Executor,
    run: list[torch.Tensor],
    losses: list | None,
    return_outputs: bool,
    *,
    holds_loss: bool,
    layout: ParallelLayout,
    wait: Callable[..., Any],
) -> Any:
    """What ``step`` / ``evaluate`` return from the executor's per-microbatch ``run`` losses: the
    mean loss (or None off the last stage's rank), with the outputs when asked; ``losses`` extended."""
    outputs, executor.outputs = executor.outputs, None
    if not holds_loss:
        return (None, None) if return_outputs else None
    loss = mean_loss(run, layout, wait)
    if losses is not None:
        losses.extend(value for _, value in sorted(zip(executor.loss_microbatches, run), key=itemgetter(0)))
    if not return_outputs:
        return loss
    merged = merge_microbatches([outputs[j] for j in sorted(outputs)]) if outputs else None
    return loss, merged
