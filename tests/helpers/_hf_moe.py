"""The 2-rank worker of tests/hf/test_hf_moe.py: mixture-of-experts models trained by a Pipeline
against the model itself in one process, in float64.

Module-level so that spawned ranks can import it.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from _hf_models import MICROBATCHES, lm_loss, padded_batch, shift_labels, tiny_model, token_batch
from torch import nn

BLOCKS = 4  # decoder blocks of the trained models: zb-v gives each of the 4 stages a block or two


def moe_model(family: str, aux: bool, *, dtype: torch.dtype = torch.float64) -> nn.Module:
    """The tiny ``family`` model with ``BLOCKS`` blocks, eager experts (they run in float64 too),
    sdpa attention, in training mode; ``aux``: the config asks for the load-balancing loss."""
    model = tiny_model(family, "sdpa", num_hidden_layers=BLOCKS, output_router_logits=aux)
    return model.to(dtype).train()


def batch(layout: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(tokens, next-token targets, keyword arguments)`` of 8 rows: "whole" unpadded, else a
    :func:`~_hf_models.padded_batch` layout."""
    if layout == "whole":
        tokens, targets = token_batch(8, seed=seed)
        return tokens, targets, {}
    tokens, labels, kwargs = padded_batch(8, layout, seed=seed)
    return tokens, shift_labels(labels), kwargs


def reference_loss(
    model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, kwargs: dict
) -> torch.Tensor:
    """What the Pipeline's step computes, from the model itself: the cross-entropy plus
    ``router_aux_loss_coef · aux_loss`` (the model's own auxiliary loss, as its ``forward`` adds it)
    of each microbatch, averaged.  Without the auxiliary loss, the mean over the whole batch at once
    (equal to the mean of the microbatch means when they hold as many real tokens)."""
    config = model.config
    if not config.output_router_logits and not kwargs:
        return lm_loss(model(tokens, use_cache=False).logits, targets)
    rows = len(tokens) // MICROBATCHES
    losses = []
    for start in range(0, len(tokens), rows):
        part = {key: value[start : start + rows] for key, value in kwargs.items()}
        output = model(tokens[start : start + rows], use_cache=False, **part)
        loss = lm_loss(output.logits, targets[start : start + rows])
        if config.output_router_logits:
            loss = loss + config.router_aux_loss_coef * output.aux_loss
        losses.append(loss)
    return torch.stack(losses).mean()


@torch.no_grad()
def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-300))


def moe_training_cases(cases: list[tuple[str, str, bool, str]]) -> dict:
    """For each ``(family, schedule, aux, layout)``: three clipped AdamW steps of the Pipeline on
    ``pipeline_layers(model)`` against the model trained on :func:`reference_loss`.  Returns per
    case the worst relative loss error (last rank), each parameter's relative error after the last
    step, the split guard's warnings and the split report of the experts and routers."""
    from zerobubble import Pipeline
    from zerobubble.hf import pipeline_layers, with_router_aux_loss
    from zerobubble.runtime.launch import init_distributed
    from zerobubble.runtime.wgrad import SplitMismatchWarning

    init_distributed(backend="gloo", timeout=60)
    out: dict = {}
    for family, schedule, aux, layout in cases:
        model = moe_model(family, aux)
        reference = copy.deepcopy(model)
        names = {id(p): name for name, p in model.named_parameters()}
        pipe = Pipeline(
            pipeline_layers(model), schedule=schedule, microbatches=MICROBATCHES,
            loss_fn=with_router_aux_loss(lm_loss), timeout=60,
        )  # fmt: skip
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.01)
        expected_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
        losses: list[float] = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", SplitMismatchWarning)
            for step in range(3):
                tokens, targets, kwargs = batch(layout, seed=10 + step)
                expected = reference_loss(reference, tokens, targets, kwargs)
                expected.backward()
                torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
                expected_optimizer.step()
                expected_optimizer.zero_grad()
                loss = pipe.step(tokens, targets, **kwargs)
                pipe.optimizer_step(optimizer, max_norm=0.05)
                optimizer.zero_grad()
                if loss is not None:
                    losses.append(abs(loss.item() - expected.item()) / expected.item())
            pipe.synchronize()
        params = dict(reference.named_parameters())
        out[" ".join((family, schedule, "aux" if aux else "no-aux", layout))] = {
            "losses": losses,
            "params": {names[id(p)]: _relative(p, params[names[id(p)]]) for _, p in pipe.named_parameters()},
            "mismatches": [str(w.message) for w in caught if issubclass(w.category, SplitMismatchWarning)],
            "report": _moe_records(pipe),
        }
    return out


def _moe_records(pipe: Any) -> list[tuple[str, str, bool]]:
    """``(type, path, verified)`` of every expert and router module in the split report."""
    return [
        (record.type, record.path, record.verified)
        for record in pipe.split_report()
        if record.type.endswith(("Experts", "Router"))
    ]
