"""The work at the model's ends that the executor's loop drives: one small protocol, no model knowledge.

The executor runs its stages' compute ops (F, B, W, BW).  Whatever a model needs around the first
stage's inputs and the last stage's outputs that is not a stage's own forward — today the
vocabulary-parallel embedding and head (:class:`~..vocab.runner.VocabRunner`), with op kinds of their own
(S, T) — goes through :class:`ModelEnds`, and the loop knows nothing more of it:

* :meth:`~ModelEnds.op_handlers` — handlers of the op kinds it runs, bound like any op's
  (:attr:`~ModelEnds.forward_kinds` of them also run in a forward-only step);
* :meth:`~ModelEnds.begin_step` — a training step's start, a program entry after the start hooks
  (so after the optimizer settle: it may read parameters); :meth:`~ModelEnds.finish_step` and
  :meth:`~ModelEnds.abort` — the step's end and its failure;
* :meth:`~ModelEnds.first_inputs` / :meth:`~ModelEnds.first_input_grads` — the first stage's inputs
  of a microbatch, and their gradients once its backward ran;
* :attr:`~ModelEnds.takes_outputs` — the last stage's outputs go to :meth:`~ModelEnds.take_outputs`
  instead of ``loss_fn``, and :meth:`~ModelEnds.output_grads` gives their gradient and the loss;
* :meth:`~ModelEnds.forward_losses` after an evaluation, :meth:`~ModelEnds.held_tensors` for memory.

The base class is the plain model's ends: the batch goes in as it is and ``loss_fn`` computes the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ...schedule import Kind

Handler = Callable[[Any, int], None]


class ModelEnds:
    """The ends of a plain model (see the module docstring); subclasses add work of their own."""

    #: whether :meth:`begin_step` has work (then it is a program entry of every training step)
    works_each_step = False
    #: whether the last stage's outputs go to :meth:`take_outputs` instead of ``loss_fn``
    takes_outputs = False
    #: its op kinds that run in a forward-only step (evaluation), besides the stages' F
    forward_kinds: frozenset[Kind] = frozenset()

    def op_handlers(self) -> Mapping[Kind, Handler]:
        """Handlers of the op kinds these ends run, ``handler(self, microbatch)``."""
        return {}

    def begin_step(
        self, inputs: Sequence[tuple[torch.Tensor, ...]], targets: Sequence[Any], scale: float, training: bool
    ) -> None:
        """A step starts: its per-microbatch ``inputs``/``targets`` and the loss ``scale``."""

    def finish_step(self) -> None:
        """The step's program has run: finish what is still in flight."""

    def abort(self) -> None:
        """The step failed: drop what it left."""

    def first_inputs(self, j: int, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The first stage's inputs of microbatch ``j``, given that microbatch of the batch."""
        return batch

    def first_input_grads(self, j: int, inputs: tuple[torch.Tensor, ...]) -> None:
        """The first stage's backward of microbatch ``j`` ran: ``inputs`` hold their gradients."""

    def take_outputs(self, j: int, outputs: tuple[torch.Tensor, ...], stage: int) -> None:
        """The last stage's outputs of microbatch ``j`` (only when :attr:`takes_outputs`)."""
        raise NotImplementedError

    def output_grads(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradient of the last stage's outputs of microbatch ``j`` and its loss (only when
        :attr:`takes_outputs`)."""
        raise NotImplementedError

    def forward_losses(self) -> list[tuple[int, torch.Tensor]]:
        """After a forward-only step: the losses these ends computed on this rank, by microbatch."""
        return []

    def held_tensors(self) -> list[torch.Tensor]:
        """Every activation these ends keep now (for :class:`~..observe.memory.ActivationMeter`)."""
        return []

    def whole_on_replicas(self) -> list[torch.Tensor]:
        """Parameters these ends keep whole on every data-parallel replica and average themselves
        (a sharded norm counts them on the first replica only)."""
        return []
