"""Tiny random ``transformers`` causal LMs for tests/hf/test_hf.py, and its 2-rank training worker.

Every model is built from a config (2 blocks, hidden 32, 4 heads, vocab 64), nothing is downloaded;
dropout is off so the cut model and the model's own forward can be compared in training mode too.
Module-level so that spawned ranks can import it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, WINDOW = 64, 10, 4  # WINDOW < SEQ: the sliding-window blocks see fewer tokens than the others

_SIZES = {"vocab_size": VOCAB, "num_hidden_layers": 2, "max_position_embeddings": 32}
_IDS = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
_ROTARY = {**_SIZES, **_IDS, "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64}
_GQA = {**_ROTARY, "num_key_value_heads": 2}
_SLIDING_QWEN = {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}
_PLAIN = {**_SIZES, **_IDS, "hidden_size": 32, "num_attention_heads": 4}
_MOE = {"num_experts_per_tok": 2, "router_aux_loss_coef": 0.25}  # the aux loss: only where asked for
_QWEN_MOE = {**_GQA, **_MOE, "num_experts": 4, "moe_intermediate_size": 16}

#: family → (config class, its options).
_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", _GQA),
    "qwen2": ("Qwen2Config", {**_GQA, **_SLIDING_QWEN}),  # block 0 full, block 1 windowed
    "qwen3": ("Qwen3Config", {**_GQA, **_SLIDING_QWEN, "head_dim": 8}),
    "mistral": ("MistralConfig", {**_GQA, "sliding_window": WINDOW}),
    "gemma": ("GemmaConfig", {**_GQA, "head_dim": 8}),  # scaled embedding, tied head
    "gemma2": (
        "Gemma2Config",
        {
            **_GQA,
            "head_dim": 8,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 8,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0,
        },
    ),
    "phi3": ("Phi3Config", {**_GQA, "sliding_window": WINDOW, "resid_pdrop": 0.0, "embd_pdrop": 0.0}),
    "gpt_neox": ("GPTNeoXConfig", {**_ROTARY, "rotary_pct": 0.5}),
    "opt": (  # word_embed_proj_dim ≠ hidden_size: project_in and project_out
        "OPTConfig",
        {**_PLAIN, "ffn_dim": 64, "word_embed_proj_dim": 16, "dropout": 0.0},
    ),
    "falcon": ("FalconConfig", _PLAIN),
    "mixtral": ("MixtralConfig", {**_GQA, **_MOE, "num_local_experts": 4, "sliding_window": WINDOW}),
    # a shared expert and its gate; block 1 dense (mlp_only_layers), block 0 windowed
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {**_QWEN_MOE, **_SLIDING_QWEN, "shared_expert_intermediate_size": 24, "mlp_only_layers": [1]},
    ),
    "qwen3_moe": ("Qwen3MoeConfig", {**_QWEN_MOE, "head_dim": 8, "norm_topk_prob": True}),
    "falcon-alibi": ("FalconConfig", {**_PLAIN, "alibi": True}),
    "gpt2": (
        "GPT2Config",
        {
            **_SIZES,
            **_IDS,
            "n_embd": 32,
            "n_head": 4,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        },
    ),
}


#: Every family the tests cut, with the attention implementations each supports on CPU
#: (Gemma 2 refuses sdpa: its attention logits are soft-capped).
FAMILIES = {family: ("eager",) if family == "gemma2" else ("eager", "sdpa") for family in _CONFIGS}


#: The mixture-of-experts families (fused 3-D expert weights, top-k routers).
MOE = ("mixtral", "qwen2_moe", "qwen3_moe")


def tiny_model(
    family: str, attn: str = "eager", seed: int = 0, *, experts: str = "eager", **options: Any
) -> nn.Module:
    """A random tiny causal LM of ``family`` with attention implementation ``attn``, float32;
    ``experts`` is a mixture-of-experts model's ``experts_implementation`` (``"eager"`` runs in
    float64 too, ``"grouped_mm"`` in float32 and bfloat16), ``options`` override its config."""
    import transformers

    name, defaults = _CONFIGS[family]
    config = getattr(transformers, name)(**{**defaults, **options})
    torch.manual_seed(seed)
    chosen = {"experts_implementation": experts} if family in MOE else {}
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, **chosen)


def run_layers(layers: list[nn.Module], tokens: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """The layers in sequence in this process, as a Pipeline stage chains them (tuples unpacked,
    each layer given the keyword arguments its ``forward`` takes)."""
    from zerobubble.runtime.construct.staging import StageModule

    return StageModule(layers)(tokens, **kwargs)


def token_batch(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens and next-token targets, ``(batch, SEQ)`` each."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(VOCAB, (batch, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (targets of -100 ignored, as in ``transformers``)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


#: How a test batch is laid out: padded at the end or the start (with or without the position ids
#: ``generate`` passes for left padding), or two packed sequences per row told apart by restarting
#: position ids and no mask.
LAYOUTS = ("right", "left", "left positions", "packed")


def padded_batch(batch: int, layout: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(tokens, labels, keyword arguments)`` of a ``(batch, SEQ)`` batch laid out as ``layout``.

    Row ``r`` has ``r % (SEQ - 2)`` padded positions (row 0 none, so the microbatches hold different
    numbers of real tokens); ``labels`` are the tokens with -100 on the padding, as a collator makes
    them, unshifted (the model's own loss shifts them: :func:`shift_labels`).  ``packed`` rows hold
    two sequences, split at ``2 + r % (SEQ - 3)``.
    """
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (batch, SEQ), generator=generator)
    if layout == "packed":
        starts = [2 + row % (SEQ - 3) for row in range(batch)]
        positions = torch.stack([torch.cat([torch.arange(s), torch.arange(SEQ - s)]) for s in starts])
        return tokens, tokens.clone(), {"position_ids": positions}
    mask = torch.ones(batch, SEQ, dtype=torch.long)
    for row in range(batch):
        pad = row % (SEQ - 2)
        if layout == "right":
            mask[row, SEQ - pad :] = 0
        else:
            mask[row, :pad] = 0
    tokens = tokens.masked_fill(mask == 0, 0)  # the pad token
    kwargs: dict = {"attention_mask": mask}
    if layout == "left positions":
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    return tokens, tokens.masked_fill(mask == 0, -100), kwargs


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets of ``labels`` for a loss on every position: ``labels[:, 1:]`` and an
    ignored last column, which is what ``transformers``' causal-LM loss computes inside the model."""
    return F.pad(labels[:, 1:], (0, 1), value=-100)


def _error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference in units of ``1e-6 + 1e-5 · max |expected|``: at most 1 when close.

    Absolute below 1e-6: some gradients are zero in exact arithmetic (OPT's key-projection bias
    shifts each softmax row by a constant), so their computed values are rounding noise.
    """
    return float((actual - expected).abs().max()) / (1e-6 + 1e-5 * float(expected.abs().max()))


def token_mean_targets(labels: torch.Tensor, microbatches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(next-token targets, weights)`` for :func:`token_mean_loss` (the recipe of
    docs/transformers.md): each real target weighs ``microbatches / real targets in the batch``, so
    the Pipeline's mean over the microbatches of their weighted sums is the batch's mean over its
    real tokens, the loss the model itself computes from ``labels``."""
    targets = shift_labels(labels)
    real = targets != -100
    return targets, real * (microbatches / real.sum())


def token_mean_loss(logits: torch.Tensor, targets: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The weighted sum of next-token cross-entropies (ignored targets weigh nothing)."""
    labels, weights = targets
    losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none")
    return (losses * weights.flatten()).sum()


MICROBATCHES = 4


def _reference(
    model: nn.Module, layout: str, loss: str
) -> tuple[torch.Tensor, Any, dict, torch.Tensor, float]:
    """One case's batch and the model's own loss on it: ``(tokens, targets, keyword arguments,
    expected loss, gap)``; the gap (for "mean") is the :func:`_error` of the gradients of the mean
    over all real tokens against the expected gradients.

    ``layout`` "whole" is an unpadded batch; the others are :func:`padded_batch` layouts.  ``loss``
    "token mean" is :func:`token_mean_loss`, expected to equal the model's own loss from the labels;
    "mean" is :func:`lm_loss` per microbatch, expected to give the mean of the microbatch means (the
    Pipeline's reduction), which differs from the mean over all real tokens of a padded batch.
    """
    if layout == "whole":
        tokens, targets = token_batch(8, seed=1)
        labels, kwargs = None, {}
    else:
        tokens, labels, kwargs = padded_batch(8, layout, seed=1)
        targets = shift_labels(labels)
    if loss == "token mean":
        expected = model(tokens, labels=labels, use_cache=False, **kwargs).loss
        return tokens, token_mean_targets(labels, MICROBATCHES), kwargs, expected, 0.0
    logits = model(tokens, use_cache=False, **kwargs).logits
    rows = len(tokens) // MICROBATCHES
    expected = torch.stack(
        [lm_loss(logits[j : j + rows], targets[j : j + rows]) for j in range(0, len(tokens), rows)]
    ).mean()
    # how far the gradients of the mean over all real tokens are from the expected ones, in the
    # units the Pipeline's gradients are checked in (:func:`_error`)
    params = list(model.parameters())
    means = torch.autograd.grad(expected, params, retain_graph=True, allow_unused=True)
    overall = torch.autograd.grad(lm_loss(logits, targets), params, retain_graph=True, allow_unused=True)
    gap = max(_error(a, b) for a, b in zip(overall, means) if b is not None)
    return tokens, targets, kwargs, expected, gap


def pipeline_cases(cases: list[tuple[str, str, str, str]]) -> dict:
    """For each ``(family, schedule, layout, loss)`` (:func:`_reference`): one Pipeline step, and an
    evaluate, on the batch against the model's own forward (schedule "auto": planned from a profile
    on the batch and its keyword arguments).

    Returns per case the relative loss errors of the step and the evaluate (last rank), the gap of
    :func:`_reference`, the gradient error (:func:`_error`) of every parameter this rank holds
    (named as in the layers), the parameters it covers under their first names and all the model's
    first names (a tied parameter has one).
    """
    from zerobubble import Pipeline
    from zerobubble.hf import pipeline_layers
    from zerobubble.runtime.launch import init_distributed

    init_distributed(backend="gloo", timeout=60)
    out: dict = {}
    for family, schedule, layout, loss_name in cases:
        model = tiny_model(family).train()
        layers = pipeline_layers(model)
        tokens, targets, kwargs, expected_loss, gap = _reference(model, layout, loss_name)
        expected_loss.backward()
        whole = nn.Sequential(*layers)
        expected = {name: p.grad.clone() for name, p in whole.named_parameters(remove_duplicate=False)}
        canonical = {id(p): name for name, p in whole.named_parameters()}  # a tied one: its first name
        model.zero_grad(set_to_none=True)
        loss_fn = token_mean_loss if loss_name == "token mean" else lm_loss
        # schedule="auto" profiles the layers with the batch's keyword arguments
        planned = {"example": (tokens, targets, kwargs), "calibrate": 0} if schedule == "auto" else {}
        pipe = Pipeline(
            layers, schedule=schedule, microbatches=MICROBATCHES, loss_fn=loss_fn, timeout=60, **planned
        )
        loss = pipe.step(tokens, targets, **kwargs)
        evaluated = pipe.evaluate(tokens, targets, **kwargs)
        value = expected_loss.item()
        out[" ".join((family, schedule, layout, loss_name))] = {
            "loss": None if loss is None else abs(loss.item() - value) / value,
            "evaluate": None if evaluated is None else abs(evaluated.item() - value) / value,
            "gap": gap,
            "grads": {n: _error(p.grad, expected[n]) for n, p in pipe.named_parameters()},
            "covered": sorted({canonical[id(p)] for _, p in pipe.named_parameters()}),
            "canonical": sorted(canonical.values()),
        }
    return out


def vocab_pipeline_cases(cases: list[tuple[str, str, str]]) -> dict:
    """For each ``(family, schedule, layout)``: one Pipeline step of the model cut with
    ``pipeline_layers(model, vocab_parallel=True)`` against the model's own mean of microbatch mean
    losses (:func:`_reference`, "mean").  Returns per case the loss error (last rank) and the gradient
    error (:func:`_error`) of every parameter this rank holds, its vocabulary shards against their rows."""
    from zerobubble import Pipeline
    from zerobubble.hf import pipeline_layers
    from zerobubble.runtime.launch import init_distributed

    init_distributed(backend="gloo", timeout=60)
    out: dict = {}
    for family, schedule, layout in cases:
        model = tiny_model(family).train()
        parts = pipeline_layers(model, vocab_parallel=True)
        tokens, targets, kwargs, expected_loss, _ = _reference(model, layout, "mean")
        expected_loss.backward()
        expected = {id(p): p.grad.clone() for p in model.parameters()}
        full = {
            "vocab_embedding": expected[id(parts.embedding.weight)],
            "vocab_head": expected[id(parts.head.weight)],
        }
        model.zero_grad(set_to_none=True)
        pipe = Pipeline(
            parts.layers, schedule=schedule, microbatches=MICROBATCHES, embedding=parts.embedding,
            head=parts.head, timeout=60,
        )  # fmt: skip
        loss = pipe.step(tokens, targets, **kwargs)
        grads = {}
        for name, p in pipe.named_parameters():
            layer = name.split(".")[0]
            if layer in full:
                shard = getattr(pipe.module, layer)
                grads[name] = _error(p.grad, full[layer][shard.vocab_start : shard.vocab_stop])
            else:
                grads[name] = _error(p.grad, expected[id(p)])
        value = expected_loss.item()
        out[" ".join((family, schedule, layout))] = {
            "loss": None if loss is None else abs(loss.item() - value) / value,
            "grads": grads,
            "tied": parts.head.weight is parts.embedding.weight,
        }
    return out


def vocab_training_cases(cases: list[tuple[str, str]]) -> dict:
    """For each ``(family, schedule)``: three AdamW steps clipped to a small norm of the model cut
    with ``pipeline_layers(model, vocab_parallel=True)``, in float64, against the model itself trained
    with ``clip_grad_norm_`` + ``step`` on the mean of microbatch mean losses.  Returns per case the
    worst loss error (last rank) and the worst parameter error after the last step (settled)."""
    from zerobubble import Pipeline
    from zerobubble.hf import pipeline_layers
    from zerobubble.runtime.launch import init_distributed

    init_distributed(backend="gloo", timeout=60)
    out: dict = {}
    for family, schedule in cases:
        model = tiny_model(family).double().train()
        reference = copy.deepcopy(model)
        names = {id(p): name for name, p in model.named_parameters()}
        parts = pipeline_layers(model, vocab_parallel=True)
        vocab_names = {"vocab_embedding": names[id(parts.embedding.weight)]}
        vocab_names["vocab_head"] = names[id(parts.head.weight)]
        pipe = Pipeline(
            parts.layers, schedule=schedule, microbatches=MICROBATCHES, embedding=parts.embedding,
            head=parts.head, timeout=60,
        )  # fmt: skip
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.01)
        expected_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
        losses = []
        for step in range(3):
            tokens, targets = token_batch(8, seed=10 + step)
            logits = reference(tokens, use_cache=False).logits
            expected = torch.stack([lm_loss(x, y) for x, y in zip(logits.chunk(4), targets.chunk(4))]).mean()
            expected.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
            expected_optimizer.step()
            expected_optimizer.zero_grad()
            loss = pipe.step(tokens, targets)
            pipe.optimizer_step(optimizer, max_norm=0.05)
            optimizer.zero_grad()
            if loss is not None:
                losses.append(abs(loss.item() - expected.item()) / expected.item())
        pipe.synchronize()
        params = dict(reference.named_parameters())
        errors = {}
        for name, p in pipe.named_parameters():
            layer = name.split(".")[0]
            if layer in vocab_names:
                shard = getattr(pipe.module, layer)
                full = params[vocab_names[layer]]
                errors[name] = _relative(p, full[shard.vocab_start : shard.vocab_stop])
            else:
                errors[name] = _relative(p, params[names[id(p)]])
        out[f"{family} {schedule}"] = {"losses": losses, "params": errors}
    return out


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-300))
