"""A tiny GPT-like model with a vocabulary-parallel embedding and head, its unsharded reference, and the
rank worker of tests/runtime/vocab/test_vocab_pipeline.py (module-level so spawned ranks can import it).

Float64 throughout: the pipeline's loss and gradients must equal the unsharded model's to 1e-10.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from zerobubble.runtime.launch import init_distributed
from zerobubble.runtime.vocab.layers import VocabParallelEmbedding, VocabParallelHead, shard_bounds

WIDTH, SEQ = 6, 5


class Block(nn.Module):
    """Pre-norm causal mixing (a cumulative mean over the sequence) and an MLP: hidden in, hidden out."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, hidden):
        mixed = self.mix(self.norm(hidden))
        steps = torch.arange(1, hidden.shape[1] + 1, dtype=hidden.dtype).view(1, -1, 1)
        hidden = hidden + mixed.cumsum(1) / steps
        return hidden + self.down(torch.tanh(self.up(hidden)))


class FinalNorm(nn.Module):
    """The last layer before the head (its output is what the head projects)."""

    def __init__(self):
        super().__init__()
        self.block, self.norm = Block(), nn.LayerNorm(WIDTH)

    def forward(self, hidden):
        return self.norm(self.block(hidden))


def model(seed: int, *, vocab: int, blocks: int = 4, tied: bool = False, softcap: float | None = None):
    """``(embedding, layers, head)`` in float64: the embedding and head vocabulary-parallel layers."""
    torch.manual_seed(seed)
    embedding = VocabParallelEmbedding(vocab, WIDTH, dtype=torch.float64)
    with torch.no_grad():
        embedding.weight.mul_(0.5)
    layers = [Block() for _ in range(blocks - 1)] + [FinalNorm()]
    layers = [layer.double() for layer in layers]
    weight = embedding.weight if tied else None
    head = VocabParallelHead(
        weight if tied else WIDTH, None if tied else vocab, softcap=softcap, dtype=torch.float64
    )
    if not tied:
        with torch.no_grad():
            head.weight.mul_(3.0)  # a wide spread of logits: the max rescaling matters
    return embedding, layers, head


def batch(size: int, vocab: int, seed: int, *, ignored: float = 0.0):
    """Tokens and labels ``(size, SEQ)``; a share ``ignored`` of the labels is -100."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab, (size, SEQ), generator=generator)
    labels = torch.randint(vocab, (size, SEQ), generator=generator)
    if ignored:
        labels[torch.rand(size, SEQ, generator=generator) < ignored] = -100
    return tokens, labels


def _forward_loss(parts, tokens, labels, microbatches: int):
    embedding, layers, head = parts
    losses = []
    for t, y in zip(tokens.chunk(microbatches), labels.chunk(microbatches)):
        hidden = embedding(t)
        for layer in layers:
            hidden = layer(hidden)
        losses.append(head(hidden, y))
    loss = torch.stack(losses).mean()
    return loss.item(), loss


def reference(parts, tokens, labels, microbatches: int):
    """The unsharded model's mean of per-microbatch losses and its gradients (plain autograd; the
    gradients are left in ``parts``' parameters)."""
    embedding, layers, head = parts
    _, loss = _forward_loss(parts, tokens, labels, microbatches)
    loss.backward()
    grads = {
        f"{i}.{n}": p.grad.clone() for i, layer in enumerate(layers) for n, p in layer.named_parameters()
    }
    grads["embedding"] = embedding.weight.grad.clone()
    grads["head"] = head.weight.grad.clone() if head.weight is not embedding.weight else None
    return loss.item(), grads


def _error(actual, expected) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-300)).item()


def vocab_cases(cases: list[dict]) -> list[dict]:
    """Each case ``{schedule, microbatches, vocab, tied, softcap, ignored, steps}``: the errors of the
    loss and of every gradient of this rank against the unsharded model (max over ``steps`` steps of
    SGD, each step's reference from the same parameters)."""
    init_distributed(backend="gloo", timeout=60)
    from zerobubble import Pipeline

    results: list[dict] = []
    for index, case in enumerate(cases):
        if "error" in case:
            results.append({"error": _error_case(case)})
            continue
        vocab, m = case["vocab"], case["microbatches"]
        parts = model(
            index,
            vocab=vocab,
            blocks=case.get("blocks", 4),
            tied=case.get("tied", False),
            softcap=case.get("softcap"),
        )
        reference_parts = copy.deepcopy(parts)
        embedding, layers, head = parts
        pipe = Pipeline(
            layers, schedule=case["schedule"], microbatches=m, head=head, embedding=embedding, timeout=60
        )
        worst = {"loss": 0.0, "grads": 0.0}
        for step in range(case.get("steps", 1)):
            tokens, labels = batch(2 * m, vocab, seed=100 * index + step, ignored=case.get("ignored", 0.0))
            expected_loss, expected = reference(reference_parts, tokens, labels, m)
            loss = pipe.step(tokens, labels)
            if loss is not None:
                worst["loss"] = max(worst["loss"], abs(loss.item() - expected_loss) / abs(expected_loss))
            worst["grads"] = max(worst["grads"], _worst_grad(pipe, expected, layers))
            _sgd_step(pipe, reference_parts)
        evaluated = pipe.evaluate(tokens, labels)  # the last step's batch, with the updated weights
        with torch.no_grad():
            expected_eval, _ = _forward_loss(reference_parts, tokens, labels, m)
        if evaluated is not None:
            worst["loss"] = max(worst["loss"], abs(evaluated.item() - expected_eval) / abs(expected_eval))
        results.append(worst)
    return results


def _error_case(case: dict) -> str:
    """The message of the PipelineError a bad call raises on this rank (``case["error"]`` names it)."""
    from zerobubble import Pipeline
    from zerobubble.runtime import PipelineError

    vocab = case["vocab"]
    embedding, layers, head = model(0, vocab=vocab)
    try:
        pipe = Pipeline(layers, schedule="1f1b", microbatches=2, head=head, embedding=embedding, timeout=60)
    except PipelineError as error:
        return str(error)
    tokens, labels = batch(4, vocab, seed=0)
    if case["error"] == "label":
        labels[1, 2] = vocab + 3
    elif case["error"] == "token":
        tokens[0, 0] = -1
    try:
        pipe.step(tokens, labels)
        message = "no error"
    except PipelineError as error:
        message = str(error)
    tokens, labels = batch(4, vocab, seed=1)
    pipe.step(tokens, labels)  # the pipeline stays usable after the refused call
    return message + "; the next step ran"


def _worst_grad(pipe, expected, layers) -> float:
    errors = []
    for stage in pipe.stages:
        lo, hi = pipe.layer_bounds[stage], pipe.layer_bounds[stage + 1]
        for i in range(lo, hi):
            for n, p in layers[i].named_parameters():
                errors.append(_error(p.grad, expected[f"{i}.{n}"]))
    head, embedding = pipe.module.vocab_head, pipe.module.vocab_embedding
    rows = slice(embedding.vocab_start, embedding.vocab_stop)
    errors.append(_error(embedding.weight.grad, expected["embedding"][rows]))  # tied: both uses
    if head.weight is not embedding.weight:
        errors.append(_error(head.weight.grad, expected["head"][head.vocab_start : head.vocab_stop]))
    return max(errors)


def _sgd_step(pipe, reference_parts, lr: float = 0.1) -> None:
    """The same SGD step on the pipeline's shards and on the reference, gradients then cleared."""
    with torch.no_grad():
        for p in pipe.parameters():
            p -= lr * p.grad
        embedding, layers, head = reference_parts
        for p in {
            id(p): p
            for p in [*embedding.parameters(), *head.parameters()]
            + [q for layer in layers for q in layer.parameters()]
        }.values():
            if p.grad is not None:
                p -= lr * p.grad
    pipe.zero_grad()
    for module in (*reference_parts[1], reference_parts[0], reference_parts[2]):
        module.zero_grad(set_to_none=True)


__all__ = ["F", "batch", "model", "reference", "shard_bounds", "vocab_cases"]


def checkpoint_cases(cases: list[dict]) -> list[dict]:
    """Each case ``{schedule, tied}``: full_state_dict equals the unsharded weights (every row), a
    pipeline of another schedule loaded from it computes the same loss, and each rank's state_dict
    holds both vocabulary weights as shards of the full shape whose data are its own rows."""
    init_distributed(backend="gloo", timeout=60)
    from zerobubble import Pipeline

    results = []
    for index, case in enumerate(cases):
        vocab, m = 11, 2
        parts = model(index, vocab=vocab, tied=case["tied"])
        unsharded = copy.deepcopy(parts)
        embedding, layers, head = parts
        pipe = Pipeline(layers, schedule=case["schedule"], microbatches=m, head=head, embedding=embedding)
        full = pipe.full_state_dict()
        errors = [
            (full["vocab_embedding.weight"] - unsharded[0].weight).abs().max().item(),
            (full["vocab_head.weight"] - unsharded[2].weight).abs().max().item(),
        ]
        tokens, labels = batch(2 * m, vocab, seed=index)
        loss = pipe.step(tokens, labels)
        pipe.zero_grad()
        fresh = model(index + 50, vocab=vocab, tied=case["tied"])
        other = Pipeline(fresh[1], schedule="1f1b", microbatches=m, head=fresh[2], embedding=fresh[0])
        other.load_state_dict(full)
        again = other.step(tokens, labels)
        if loss is not None and again is not None:
            errors.append(abs(loss.item() - again.item()))
        own = pipe.state_dict()
        shards = {k: v for k, v in own.items() if k.startswith("vocab")}
        errors += _optimizer_state_errors(pipe, unsharded, other, tokens, labels, m)
        results.append(
            {
                "errors": errors,
                "keys": sorted(shards),
                "shapes": sorted({tuple(v.shape) for v in shards.values()}),
                "own rows": all(
                    v._local_tensor.local_shards()[0].data_ptr()
                    == getattr(pipe.module, k.split(".")[0]).weight.data_ptr()
                    for k, v in shards.items()
                ),
            }
        )
    return results


def _optimizer_state_errors(pipe, unsharded, other, tokens, labels, m) -> list[float]:
    """AdamW state of a vocabulary-parallel pipeline: each rank's shard of the head's rows equals the
    unsharded model's; the unsharded optimizer's state by name (full tensors) loaded into another
    layout keeps each rank's rows."""
    from zerobubble.runtime.state.checkpoint import optimizer_state_by_name

    embedding, layers, head = unsharded
    tied = head.weight is embedding.weight
    reference(unsharded, tokens, labels, m)  # the gradients the pipeline's step computes too
    names = {id(p): f"{i}.{n}" for i, layer in enumerate(layers) for n, p in layer.named_parameters()}
    names[id(head.weight)] = "vocab_head.weight"
    names[id(embedding.weight)] = "vocab_embedding.weight"  # a tied weight's first name
    reference_optimizer = torch.optim.AdamW(
        {id(p): p for part in (embedding, *layers, head) for p in part.parameters()}.values(), lr=0.1
    )
    reference_optimizer.step()
    full_rows = reference_optimizer.state[head.weight]["exp_avg"]
    pipe.step(tokens, labels)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.1)
    pipe.optimizer_step(optimizer)
    saved = pipe.optimizer_state_dict(optimizer, flatten=True)
    mine = pipe.module.vocab_head
    key = f"state.{'vocab_embedding' if tied else 'vocab_head'}.weight.exp_avg"
    rows = saved[key]._local_tensor.local_shards()[0]
    errors = [(rows - full_rows[mine.vocab_start : mine.vocab_stop]).abs().max().item()]
    whole = optimizer_state_by_name(reference_optimizer, names, flatten=True)
    loaded = torch.optim.AdamW(other.parameters(), lr=0.1)
    other.load_optimizer_state_dict(loaded, whole)
    theirs = other.module.vocab_head
    rows = loaded.state[theirs.weight]["exp_avg"]
    errors.append((rows - full_rows[theirs.vocab_start : theirs.vocab_stop]).abs().max().item())
    return errors


def _budget_between(plan) -> float | None:
    """A budget between the smallest planned peak of a vocabulary-parallel candidate and that of a
    plain one (None when the vocabulary-parallel layout is not the leaner)."""
    peaks = {True: [], False: []}
    for candidate in plan.candidates:
        if candidate.peak_bytes and candidate.period is not None:
            peaks[candidate.vocab_parallel].append(max(candidate.peak_bytes))
    lean, plain = min(peaks[True]), min(peaks[False])
    return (lean + plain) / 2 if lean < plain else None


def auto_cases(cases: list[dict]) -> list[dict]:
    """Each case ``{vocab, blocks, budget}``: ``schedule="auto"`` with ``head=`` and ``embedding=``
    chooses a layout (``budget="vocab only"``: under a byte budget only the vocabulary-parallel
    layout fits, set from a first plan's peaks); its step's loss and gradients against the unsharded
    model."""
    init_distributed(backend="gloo", timeout=120)
    from zerobubble import Pipeline

    results = []
    for index, case in enumerate(cases):
        vocab, m = case["vocab"], 4
        tokens, labels = batch(2 * m, vocab, seed=index)
        budget = None
        if case.get("budget") == "vocab only":
            embedding, layers, head = model(index, vocab=vocab, blocks=case["blocks"])
            first = Pipeline(
                layers, schedule="auto", microbatches=m, head=head, embedding=embedding,
                example=(tokens, labels), timeout=120,
            )  # fmt: skip
            budget = _budget_between(first.plan)
        parts = model(index, vocab=vocab, blocks=case["blocks"])
        reference_parts = copy.deepcopy(parts)
        embedding, layers, head = parts
        pipe = Pipeline(
            layers, schedule="auto", microbatches=m, head=head, embedding=embedding, example=(tokens, labels),
            timeout=120, memory_limit=budget,
        )  # fmt: skip
        expected_loss, expected = reference(reference_parts, tokens, labels, m)
        loss = pipe.step(tokens, labels)
        vocab_parallel = pipe.plan.winner.vocab_parallel
        grads = [_worst_grad(pipe, expected, layers)] if vocab_parallel else []
        results.append(
            {
                "vocab_parallel": vocab_parallel,
                "budget": budget,
                "reason": pipe.plan.reason,
                "loss": None if loss is None else abs(loss.item() - expected_loss) / abs(expected_loss),
                "grads": max(grads, default=0.0),
            }
        )
    return results


def feature_cases(cases: list[dict]) -> list[dict]:
    """The Pipeline's other options with the vocabulary-parallel layers: ``trace=True`` (the recorded
    timeline holds the S and T ops; the trace is written), ``static_shapes=False``, and
    ``return_outputs=True`` (the last stage's hidden states); the loss against the unsharded model."""
    import tempfile

    init_distributed(backend="gloo", timeout=60)
    from zerobubble import Pipeline

    results = []
    for index, case in enumerate(cases):
        vocab, m = 13, 2
        parts = model(index, vocab=vocab)
        reference_parts = copy.deepcopy(parts)
        embedding, layers, head = parts
        pipe = Pipeline(
            layers, schedule="zb-h1", microbatches=m, head=head, embedding=embedding,
            trace=case.get("trace", False), static_shapes=case.get("static_shapes", True),
        )  # fmt: skip
        tokens, labels = batch(2 * m, vocab, seed=index)
        expected_loss, _ = reference(reference_parts, tokens, labels, m)
        loss, outputs = pipe.step(tokens, labels, return_outputs=True)
        result = {"loss": None if loss is None else abs(loss.item() - expected_loss) / abs(expected_loss)}
        result["outputs"] = None if outputs is None else list(outputs.shape)
        if case.get("trace"):
            pipe.step(tokens, labels)
            with tempfile.TemporaryDirectory() as folder:
                report = pipe.write_trace(folder)
            timelines = pipe.measured_timelines() or []
            result["recorded"] = sorted({op.kind.value for t in timelines for _, op in t.schedule.ops()})
            result["report"] = report is not None
        results.append(result)
    return results
