"""Rank worker of tests/runtime/vocab/test_measured_head.py: ``schedule="auto"`` with a vocabulary-parallel
head whose layer is made slow, so that the head's measured cost, not an assumed one, decides the plan.

:class:`SlowHead` computes the same logits and gradients as :class:`VocabParallelHead` and adds
``repeats`` products with its weight whose result is multiplied by zero: its forward, input gradient and
weight gradient all take longer, deterministically, and every value stays exact.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from _vocab_models import _error, _worst_grad, batch, model, reference

from zerobubble.runtime.launch import init_distributed
from zerobubble.runtime.vocab.layers import VocabParallelHead


class SlowHead(VocabParallelHead):
    """A vocabulary-parallel head whose plain logits run ``repeats`` more products with its weight."""

    def __init__(self, weight: torch.nn.Parameter, repeats: int):
        super().__init__(weight)
        self.repeats = repeats

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = super().logits(hidden)
        extra = hidden
        for _ in range(self.repeats):  # [n, dim] -> [n, vocab] -> [n, dim]: the weight read twice
            extra = torch.tanh(F.linear(extra, self.weight) @ self.weight)
        return out + 0.0 * extra.sum() if self.repeats else out  # the same values, exactly


def _plain_grad(pipe, expected, parts) -> float:
    """The worst gradient error of this rank's layers of the plain model (embedding, blocks, head)."""
    embedding, layers, head = parts
    errors = []
    for stage in pipe.stages:
        for i in range(pipe.layer_bounds[stage], pipe.layer_bounds[stage + 1]):
            if i == 0:
                errors.append(_error(embedding.weight.grad, expected["embedding"]))
            elif i == len(layers) + 1:
                errors.append(_error(head.weight.grad, expected["head"]))
            else:
                errors += [
                    _error(p.grad, expected[f"{i - 1}.{n}"]) for n, p in layers[i - 1].named_parameters()
                ]
    return max(errors)


def measured_head_cases(cases: list[dict]) -> list[dict]:
    """Each case ``{vocab, blocks, repeats}``: the plan (vocabulary-parallel or not, its reason), the
    head layer's measured times, and the step's loss and gradient errors against one process."""
    init_distributed(backend="gloo", timeout=120)
    from zerobubble import Pipeline

    results = []
    for case in cases:
        vocab, m = case["vocab"], 4
        tokens, labels = batch(2 * m, vocab, seed=1)
        embedding, layers, head = model(1, vocab=vocab, blocks=case["blocks"])
        expected_loss, expected = reference(copy.deepcopy((embedding, layers, head)), tokens, labels, m)
        slow = SlowHead(head.weight, case["repeats"])
        pipe = Pipeline(
            layers, schedule="auto", microbatches=m, head=slow, embedding=embedding, example=(tokens, labels),
            timeout=120, calibrate=0,
        )  # fmt: skip
        loss = pipe.step(tokens, labels)
        vocab_parallel = pipe.plan.winner.vocab_parallel
        measured = pipe.profile.layers[-1]
        grads = (
            _worst_grad(pipe, expected, layers)
            if vocab_parallel
            else _plain_grad(pipe, expected, (embedding, layers, slow))
        )
        results.append(
            {
                "vocab_parallel": vocab_parallel,
                "reason": pipe.plan.reason,
                "head": (measured.forward + measured.backward_input, measured.backward_weight),
                "block": pipe.profile.layers[1].work,
                # the best prediction of each layout: plain head, vocabulary-parallel head
                "best": {
                    layout: min(
                        c.period for c in pipe.plan.candidates if c.fits and c.vocab_parallel is layout
                    )
                    for layout in (False, True)
                },
                "ranks": pipe.plan.ranks,
                "loss": None if loss is None else abs(loss.item() - expected_loss) / abs(expected_loss),
                "grads": grads,
            }
        )
    return results
