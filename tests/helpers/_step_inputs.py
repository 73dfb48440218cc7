"""The rank worker of ``test_step_inputs.py``: keyword arguments, returned outputs and losses.

A small model whose layers take ``attention_mask`` / ``position_ids``-like keyword arguments (some
by name, one through ``**kwargs``, some none), run by the Pipeline and by plain autograd on the
whole batch.  One spawn runs every case; the results are plain numbers and strings.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from _dist import SEQ, VOCAB, WIDTH, relative_error
from _safety import Embed  # tokens -> hidden; takes no keyword argument
from torch import nn

from zerobubble.runtime.launch import init_distributed

BATCH, MICROBATCHES = 8, 4


class MaskedMix(nn.Module):
    """Attention-like mixing over the positions a padding mask keeps, with learned positions."""

    def __init__(self):
        super().__init__()
        self.positions = nn.Embedding(SEQ, WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, hidden, attention_mask=None, position_ids=None, *, temperature: float = 1.0):
        if position_ids is not None:
            hidden = hidden + self.positions(position_ids)
        scores = hidden @ hidden.transpose(1, 2) / (temperature * WIDTH**0.5)
        if attention_mask is not None:  # (batch, seq) of 0/1: keys to ignore
            scores = scores.masked_fill(attention_mask[:, None, :] == 0, -1e4)
        return hidden + torch.tanh(self.proj(scores.softmax(-1) @ hidden))


class MaskRequired(MaskedMix):
    """:class:`MaskedMix` whose ``attention_mask`` has no default: it fails without its keyword."""

    def forward(self, hidden, attention_mask, position_ids=None, *, temperature: float = 1.0):
        return super().forward(hidden, attention_mask, position_ids, temperature=temperature)


class Plain(nn.Module):
    """Linear + tanh; takes no keyword argument (it would fail if it were given one)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, hidden):
        return torch.tanh(self.fc(hidden))


class Open(nn.Module):
    """Takes every keyword argument (``**kwargs``) and uses two of them."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.gain = nn.Parameter(torch.rand(WIDTH) + 0.5)  # its own parameter: the generic split

    def forward(self, hidden, **kwargs):
        out = self.fc(hidden) * self.gain
        if kwargs.get("token_weights") is not None:  # a float constant, split like the batch
            out = out * kwargs["token_weights"][..., None]
        if kwargs.get("attention_mask") is not None:
            out = out * kwargs["attention_mask"][..., None].to(out.dtype)
        return hidden + out


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, hidden):
        return self.out(hidden)


class DictOut(nn.Module):
    """Returns a dict: fine inside a stage, refused at a stage boundary."""

    def forward(self, hidden):
        return {"hidden": hidden, "scaled": hidden * 2}


def make_layers(seed: int, *, first_mix: type[MaskedMix] = MaskedMix) -> list[nn.Module]:
    """The test model; ``first_mix`` is the class of its first mixing layer (the same parameters)."""
    torch.manual_seed(seed)
    return [Embed(), first_mix(), Plain(), Open(), MaskedMix(), Plain(), MaskedMix(), Head()]


def token_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(VOCAB, (BATCH, SEQ), generator=generator)
    targets = torch.randint(VOCAB, (BATCH, SEQ), generator=generator)
    mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    for row in range(BATCH):  # rows padded at the end by different amounts
        mask[row, SEQ - row % SEQ :] = 0
    kwargs = {
        "attention_mask": mask,
        "position_ids": torch.arange(SEQ).repeat(BATCH, 1),
        "token_weights": torch.rand(BATCH, SEQ, generator=generator) + 0.5,
        "temperature": 0.7,
    }
    return tokens, targets, kwargs


def reference(layers, tokens, kwargs) -> torch.Tensor:
    """The unpipelined model with each layer given the keywords it takes, written out by hand."""
    hidden = tokens
    mix = {k: kwargs[k] for k in ("attention_mask", "position_ids", "temperature")}
    for layer in layers:
        if isinstance(layer, MaskedMix):
            hidden = layer(hidden, **mix)
        elif isinstance(layer, Open):
            hidden = layer(hidden, **kwargs)
        else:
            hidden = layer(hidden)
    return hidden


def _grads_error(pipe, expected: dict[str, torch.Tensor]) -> float:
    return max(relative_error(p.grad, expected[n]) for n, p in pipe.named_parameters())


def step_cases() -> dict:
    """Every case, on each rank: errors against plain autograd, and the error messages."""
    init_distributed(backend="gloo", timeout=60)
    from zerobubble import Pipeline
    from zerobubble.runtime import PipelineError

    rank = int(os.environ["RANK"])
    tokens, targets, kwargs = batch(0)
    model = nn.Sequential(*make_layers(0))
    logits = reference(list(model), tokens, kwargs)
    expected_loss = token_loss(logits, targets)
    expected_loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    rows = BATCH // MICROBATCHES
    expected_losses = [
        token_loss(logits[j * rows : (j + 1) * rows], targets[j * rows : (j + 1) * rows]).item()
        for j in range(MICROBATCHES)
    ]
    results: dict = {}
    for name in ("zb-h1", "zb-v", "1f1b"):
        pipe = Pipeline(
            make_layers(0), schedule=name, microbatches=MICROBATCHES, loss_fn=token_loss, timeout=60
        )
        losses: list = []
        loss, outputs = pipe.step(tokens, targets, losses=losses, return_outputs=True, **kwargs)
        case = {
            "grads": _grads_error(pipe, expected),
            "split": sorted({record.path for record in pipe.split_report()}),
            "holds_loss": pipe.holds_loss,
        }
        if pipe.holds_loss:
            case["loss"] = abs(loss.item() - expected_loss.item())
            case["outputs"] = relative_error(outputs, logits.detach())
            case["outputs_shape"] = list(outputs.shape)
            case["losses"] = max(abs(a.item() - b) for a, b in zip(losses, expected_losses))
            case["losses_count"] = len(losses)
        else:
            case["returned"] = (loss, outputs)
        # a second step from zeroed gradients (checked paths, cached shapes): the same gradients
        pipe.zero_grad()
        pipe.step(tokens, targets, **kwargs)
        case["second"] = _grads_error(pipe, expected)
        # evaluate: kwargs, outputs and losses as for step
        eval_losses: list = []
        value, eval_outputs = pipe.evaluate(
            tokens, targets, losses=eval_losses, return_outputs=True, **kwargs
        )
        if pipe.holds_loss:
            case["eval_loss"] = abs(value.item() - expected_loss.item())
            case["eval_outputs"] = relative_error(eval_outputs, logits.detach())
            case["eval_losses"] = max(abs(a.item() - b) for a, b in zip(eval_losses, expected_losses))
        case["plain_return"] = type(pipe.step(tokens, targets, **kwargs)).__name__
        results[name] = case

    # errors on one pipe: the same PipelineError on every rank, and the Pipeline stays usable
    pipe = Pipeline(
        make_layers(0), schedule="zb-h1", microbatches=MICROBATCHES, loss_fn=token_loss, timeout=30
    )
    errors = {}
    narrow = kwargs["attention_mask"][:, :2]
    attempts = {
        "missing_on_rank_1": {k: v for k, v in kwargs.items() if k != "position_ids" or rank == 0},
        "shape_on_rank_1": {**kwargs, "attention_mask": narrow} if rank == 1 else kwargs,
        "value_on_rank_1": {**kwargs, "temperature": 0.5} if rank == 1 else kwargs,
        "requires_grad": {**kwargs, "token_weights": kwargs["token_weights"].clone().requires_grad_()},
        "not_split": {**kwargs, "position_ids": torch.arange(SEQ).repeat(6, 1)},
        "container": {**kwargs, "token_weights": [kwargs["token_weights"]]},
    }
    for case_name, attempt in attempts.items():
        try:
            pipe.step(tokens, targets, **attempt)
            errors[case_name] = "no error"
        except PipelineError as error:
            errors[case_name] = str(error)
    try:
        pipe.step(tokens, targets, losses=(), **kwargs)
        errors["losses_tuple"] = "no error"
    except PipelineError as error:
        errors["losses_tuple"] = str(error)
    pipe.zero_grad()
    pipe.step(tokens, targets, **kwargs)
    errors["usable_after"] = _grads_error(pipe, expected)
    results["errors"] = errors

    results["auto"] = auto_cases(tokens, targets, kwargs, expected)

    # a name no layer takes (no layer has **kwargs here): refused on every rank
    torch.manual_seed(1)
    layers = [Embed(), MaskedMix(), Plain(), Head()]
    pipe = Pipeline(layers, schedule="1f1b", microbatches=MICROBATCHES, loss_fn=token_loss, timeout=30)
    try:
        pipe.step(tokens, targets, attention_mask=kwargs["attention_mask"], past_key_values=None)
        results["unknown"] = "no error"
    except PipelineError as error:
        results["unknown"] = str(error)

    # a dict crossing a stage boundary: refused at the first step, naming the layer
    torch.manual_seed(1)
    layers = [Embed(), Plain(), DictOut(), Head()]
    pipe = Pipeline(
        layers, schedule="1f1b", microbatches=MICROBATCHES, loss_fn=token_loss, partition=[3], timeout=30
    )
    try:
        pipe.step(tokens, targets)
        results["dict_between_stages"] = "no error"
    except PipelineError as error:
        results["dict_between_stages"] = str(error)
    return results


def auto_cases(tokens, targets, kwargs, expected) -> dict:
    """schedule="auto" profiled with the step's keyword arguments (``example=(inputs, targets,
    kwargs)``) on a model one of whose layers fails without its mask: the plan, the gradient error
    of a step, and the errors of an example without its keywords, with one that does not split, and
    with keywords that are not a dict."""
    from zerobubble import Pipeline
    from zerobubble.runtime import PipelineError

    def auto(example):
        layers = make_layers(0, first_mix=MaskRequired)
        return Pipeline(
            layers,
            schedule="auto",
            microbatches=MICROBATCHES,
            loss_fn=token_loss,
            example=example,
            calibrate=0,
            timeout=60,
        )

    pipe = auto((tokens, targets, kwargs))
    pipe.step(tokens, targets, **kwargs)
    case: dict = {"grads": _grads_error(pipe, expected), "layers": len(pipe.profile.layers)}
    for name, example in {
        "without_keywords": (tokens, targets),
        "not_split": (tokens, targets, {**kwargs, "position_ids": torch.arange(SEQ).repeat(6, 1)}),
        "not_a_dict": (tokens, targets, [kwargs["attention_mask"]]),
    }.items():
        try:
            auto(example)
            case[name] = "no error"
        except PipelineError as error:
            case[name] = str(error)
    return case
