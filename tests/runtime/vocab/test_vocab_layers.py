"""The vocabulary-parallel head and embedding against the unsharded layers, in float64.

Every shard of a module (deep copies, ``keep_shard``) is run in this one process and the partials are
combined as the pipeline runtime would after its collectives: the loss, the gradient of the hidden
states and the concatenated weight gradients must equal ``F.cross_entropy`` / ``F.embedding`` and
their backward to 1e-10, over uneven splits, ignored labels, softcap, scale and widely spread logits.
"""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from zerobubble.runtime import PipelineError
from zerobubble.runtime.vocab.layers import (
    VocabParallelEmbedding,
    VocabParallelHead,
    check_labels,
    embedding_partial,
    embedding_weight_grad,
    head_input_grad,
    head_partials,
    head_totals,
    head_weight_grad,
    shard_bounds,
)

F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}
IGNORE = -100


def _shards(module, count):
    shards = []
    for index in range(count):
        shard = copy.deepcopy(module)
        shard.keep_shard(index, count)
        shards.append(shard)
    return shards


def _reference_head(weight, hidden, labels, softcap, scale):
    weight = weight.detach().clone().requires_grad_()
    hidden = hidden.detach().clone().requires_grad_()
    logits = hidden @ weight.T
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE)
    (loss * scale).backward()
    return loss.detach(), hidden.grad, weight.grad


def _sharded_head(head, hidden, labels, count, scale):
    shards = _shards(head, count)
    partials = [head_partials(shard, hidden, labels) for shard in shards]
    stats = torch.stack([partial.stats for partial in partials])
    parts = torch.stack([partial.parts for partial in partials])
    totals = head_totals(stats, labels, ignore_index=head.ignore_index)
    hidden_grad = head_input_grad(stats, parts, totals, scale=scale)
    weight_grads = [
        head_weight_grad(shard, partial.logits, hidden, labels, totals, scale=scale)
        for shard, partial in zip(shards, partials)
    ]
    return totals.loss, hidden_grad, torch.cat(weight_grads)


@st.composite
def head_cases(draw):
    count = draw(st.integers(1, 5))
    vocab = draw(st.integers(count, 23))
    dim, n = draw(st.integers(1, 6)), draw(st.integers(1, 9))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    spread = draw(st.sampled_from([1.0, 5.0, 30.0]))
    weight = torch.randn(vocab, dim, generator=generator, dtype=F64) * spread
    hidden = torch.randn(n, dim, generator=generator, dtype=F64)
    labels = torch.randint(0, vocab, (n,), generator=generator)
    ignored = torch.rand(n, generator=generator) < draw(st.sampled_from([0.0, 0.3, 1.0]))
    labels[ignored] = IGNORE
    softcap = draw(st.none() | st.floats(0.5, 50.0))
    scale = draw(st.floats(0.01, 100.0))
    return count, weight, hidden, labels, softcap, scale


@settings(max_examples=40, deadline=None)
@given(head_cases())
def test_sharded_head_matches_cross_entropy(case):
    count, weight, hidden, labels, softcap, scale = case
    head = VocabParallelHead(weight, ignore_index=IGNORE, softcap=softcap)
    loss, hidden_grad, weight_grad = _reference_head(weight, hidden, labels, softcap, scale)
    sharded_loss, sharded_hidden_grad, sharded_weight_grad = _sharded_head(head, hidden, labels, count, scale)
    torch.testing.assert_close(sharded_loss, loss, equal_nan=True, **TOL)
    torch.testing.assert_close(sharded_hidden_grad, hidden_grad, **TOL)
    torch.testing.assert_close(sharded_weight_grad, weight_grad, **TOL)


@st.composite
def embedding_cases(draw):
    count = draw(st.integers(1, 5))
    vocab = draw(st.integers(count, 23))
    dim = draw(st.integers(1, 6))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    weight = torch.randn(vocab, dim, generator=generator, dtype=F64)
    tokens = torch.randint(0, vocab, shape, generator=generator)
    grad = torch.randn(*shape, dim, generator=generator, dtype=F64)
    padding_idx = draw(st.none() | st.integers(-vocab, vocab - 1))
    scale = draw(st.none() | st.floats(0.01, 100.0))
    return count, weight, tokens, grad, padding_idx, scale


@settings(max_examples=40, deadline=None)
@given(embedding_cases())
def test_sharded_embedding_matches_f_embedding(case):
    count, weight, tokens, grad, padding_idx, scale = case
    embedding = VocabParallelEmbedding(weight.clone(), padding_idx=padding_idx, scale=scale)
    reference_weight = weight.clone().requires_grad_()
    output = F.embedding(tokens, reference_weight, embedding.padding_idx) * (1.0 if scale is None else scale)
    output.backward(grad)
    shards = _shards(embedding, count)
    combined = sum(embedding_partial(shard, tokens) for shard in shards)
    torch.testing.assert_close(combined, output.detach(), **TOL)
    weight_grad = torch.cat([embedding_weight_grad(shard, tokens, grad) for shard in shards])
    torch.testing.assert_close(weight_grad, reference_weight.grad, **TOL)
    forward = embedding(tokens)  # the unsharded module is the ordinary layer
    forward.backward(grad)
    torch.testing.assert_close(forward.detach(), output.detach(), **TOL)
    torch.testing.assert_close(embedding.weight.grad, reference_weight.grad, **TOL)


def test_shard_bounds_are_contiguous_and_balanced():
    assert shard_bounds(10, 3) == ((0, 4), (4, 7), (7, 10))
    assert shard_bounds(5, 5) == ((0, 1), (1, 2), (2, 3), (3, 4), (4, 5))
    assert shard_bounds(7, 1) == ((0, 7),)
    for vocab in range(1, 30):
        for count in range(1, vocab + 1):
            bounds = shard_bounds(vocab, count)
            sizes = [stop - start for start, stop in bounds]
            assert bounds[0][0] == 0 and bounds[-1][1] == vocab
            assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
            assert sizes == [vocab // count + (i < vocab % count) for i in range(count)]


@pytest.mark.parametrize(("vocab", "count"), [(2, 3), (0, 1), (5, 0), (-1, -1)])
def test_shard_bounds_refuses_empty_shards(vocab, count):
    with pytest.raises(PipelineError, match=rf"vocabulary of {vocab} rows into {count} shards"):
        shard_bounds(vocab, count)


def test_check_labels_names_value_position_and_vocabulary():
    check_labels(torch.tensor([0, 4, IGNORE]), 5, IGNORE)
    with pytest.raises(PipelineError, match=r"label 7 at position \[1\] .*vocabulary of 5 tokens"):
        check_labels(torch.tensor([1, 7, IGNORE, 9]), 5, IGNORE)
    with pytest.raises(PipelineError, match=r"label -1 at position \[1, 0\].*ignore_index -100"):
        check_labels(torch.tensor([[1, 2], [-1, 3]]), 5, IGNORE)
    with pytest.raises(PipelineError, match=r"integer tensor.*float"):
        check_labels(torch.tensor([1.0]), 5, IGNORE)
    head = VocabParallelHead(3, 5, dtype=F64)
    with pytest.raises(PipelineError, match="label 5 at position"):
        head_partials(head, torch.zeros(2, 3, dtype=F64), torch.tensor([0, 5]))
    with pytest.raises(PipelineError, match="label 5 at position"):
        head(torch.zeros(2, 3, dtype=F64), torch.tensor([0, 5]))


def test_embedding_refuses_out_of_range_tokens():
    embedding = VocabParallelEmbedding(10, 3)
    shard = _shards(embedding, 2)[1]
    for tokens in (torch.tensor([[1, 12]]), torch.tensor([-3])):
        bad = int(tokens[(tokens < 0) | (tokens >= 10)][0])
        with pytest.raises(PipelineError, match=rf"token {bad} at position .*vocabulary of 10 tokens"):
            embedding_partial(shard, tokens)
        with pytest.raises(PipelineError, match=rf"token {bad} at position"):
            embedding(tokens)
        with pytest.raises(PipelineError, match=rf"token {bad} at position"):
            embedding_weight_grad(shard, tokens, torch.zeros(*tokens.shape, 3))


@pytest.mark.parametrize("make", [lambda: VocabParallelHead(4, 9), lambda: VocabParallelEmbedding(9, 4)])
def test_keep_shard_clones_rows_once(make):
    module = make()
    module.weight.requires_grad_(False)
    full = module.weight.detach().clone()
    module.keep_shard(1, 2)
    assert (module.vocab_start, module.vocab_stop, module.vocab_size, module.dim) == (5, 9, 9, 4)
    assert module.weight.shape == (4, 4) and not module.weight.requires_grad
    assert torch.equal(module.weight, full[5:9]) and module.weight.is_contiguous()
    assert [name for name, _ in module.named_parameters()] == ["weight"]
    with pytest.raises(PipelineError, match="already keeps shard 1 of 2"):
        module.keep_shard(0, 2)
    with pytest.raises(PipelineError, match="shard index 2 is outside"):
        make().keep_shard(2, 2)


def test_forward_of_a_sharded_module_raises():
    head, embedding = VocabParallelHead(4, 9), VocabParallelEmbedding(9, 4)
    head.keep_shard(0, 3)
    embedding.keep_shard(2, 3)
    with pytest.raises(PipelineError, match=r"forward of a sharded head \(rows \[0, 3\) of 9\)"):
        head(torch.zeros(2, 4), torch.tensor([0, 1]))
    with pytest.raises(PipelineError, match=r"forward of a sharded embedding \(rows \[6, 9\) of 9\)"):
        embedding(torch.tensor([0]))


def test_from_linear_keeps_the_weight_and_refuses_a_bias():
    linear = nn.Linear(4, 7, bias=False)
    head = VocabParallelHead.from_linear(linear, softcap=3.0)
    assert head.weight is linear.weight and head.softcap == 3.0 and (head.vocab_size, head.dim) == (7, 4)
    with pytest.raises(PipelineError, match=r"nn.Linear\(4, 7\) with a bias.*bias=False"):
        VocabParallelHead.from_linear(nn.Linear(4, 7))


def test_from_embedding_keeps_the_weight_and_refuses_what_it_cannot_shard():
    source = nn.Embedding(8, 3, padding_idx=-2)
    embedding = VocabParallelEmbedding.from_embedding(source, scale=2.0)
    assert embedding.weight is source.weight and embedding.padding_idx == 6 and embedding.scale == 2.0
    for options, named in (({"max_norm": 1.0}, "max_norm=1.0"), ({"sparse": True}, "sparse=True")):
        with pytest.raises(PipelineError, match=rf"nn.Embedding\(8, 3\) with {named}"):
            VocabParallelEmbedding.from_embedding(nn.Embedding(8, 3, **options))


def test_tied_weight_is_the_same_parameter_until_sharded():
    embedding = nn.Embedding(11, 5)
    head, vocab_embedding = VocabParallelHead(embedding.weight), VocabParallelEmbedding(embedding.weight)
    assert head.weight is embedding.weight and vocab_embedding.weight is embedding.weight
    head.keep_shard(0, 2)
    assert head.weight is not embedding.weight and vocab_embedding.weight is embedding.weight


def test_new_weights_are_initialised_like_torch():
    torch.manual_seed(3)
    linear = nn.Linear(6, 13, bias=False)
    torch.manual_seed(3)
    assert torch.equal(VocabParallelHead(6, 13).weight, linear.weight)
    torch.manual_seed(4)
    embedding = nn.Embedding(13, 6, padding_idx=2, dtype=F64)
    torch.manual_seed(4)
    assert torch.equal(VocabParallelEmbedding(13, 6, padding_idx=2, dtype=F64).weight, embedding.weight)


@pytest.mark.parametrize("softcap", [None, 2.5])
def test_head_forward_is_cross_entropy(softcap):
    generator = torch.Generator().manual_seed(0)
    head = VocabParallelHead(5, 17, softcap=softcap, dtype=F64)
    hidden = torch.randn(2, 3, 5, generator=generator, dtype=F64)
    labels = torch.randint(0, 17, (2, 3), generator=generator)
    labels[0, 1] = IGNORE
    logits = head.logits(hidden)
    assert logits.shape == (2, 3, 17)
    expected = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE)
    torch.testing.assert_close(head(hidden, labels), expected, **TOL)
    if softcap is not None:
        assert float(logits.detach().abs().max()) < softcap
        raw = hidden @ head.weight.T
        torch.testing.assert_close(logits, softcap * torch.tanh(raw / softcap), **TOL)


@pytest.mark.parametrize("softcap", [None, 2.5])
def test_plain_models_head_defers_its_weight_gradient_to_w(softcap):
    """The plain model ``schedule="auto"`` weighs runs its head through ``forward``: B computes the
    hidden states' gradient and leaves the weight's to W, and the two equal plain autograd's."""
    from zerobubble.runtime.vocab.runner import plain_model
    from zerobubble.runtime.wgrad.install import install_deferral
    from zerobubble.runtime.wgrad.store import WeightGradStore

    generator = torch.Generator().manual_seed(1)
    head = VocabParallelHead(5, 17, softcap=softcap, dtype=F64)
    hidden = torch.randn(2, 3, 5, generator=generator, dtype=F64)
    labels = torch.randint(0, 17, (2, 3), generator=generator)
    torch.testing.assert_close(head(hidden), head.logits(hidden), **TOL)
    expected = copy.deepcopy(head)
    expected_hidden = hidden.clone().requires_grad_()
    expected(expected_hidden, labels).backward()
    layers, loss_fn = plain_model(head, None, [])
    store = WeightGradStore()
    install_deferral(layers, store)
    split_hidden = hidden.clone().requires_grad_()
    store.begin((0, 0), True)
    try:
        loss_fn(layers[-1](split_hidden), labels).backward()
    finally:
        store.end()
    assert head.weight.grad is None and (0, 0) in store.pending_keys()  # B left the weight to W
    torch.testing.assert_close(split_hidden.grad, expected_hidden.grad, **TOL)
    store.flush((0, 0))
    torch.testing.assert_close(head.weight.grad, expected.weight.grad, **TOL)


def test_embedding_padding_row_gets_no_gradient_and_scale_applies():
    embedding = VocabParallelEmbedding(6, 2, padding_idx=4, scale=math.sqrt(2.0), dtype=F64)
    assert torch.equal(embedding.weight[4], torch.zeros(2, dtype=F64))
    tokens = torch.tensor([[4, 1, 4], [5, 1, 0]])
    grad = torch.ones(2, 3, 2, dtype=F64)
    output = embedding(tokens)
    torch.testing.assert_close(output[1, 1], embedding.weight[1].detach() * math.sqrt(2.0), **TOL)
    output.backward(grad)
    expected = torch.zeros(6, 2, dtype=F64)
    expected[[0, 1, 5]] = torch.tensor([1.0, 2.0, 1.0], dtype=F64)[:, None] * math.sqrt(2.0)
    torch.testing.assert_close(embedding.weight.grad, expected, **TOL)
    shards = _shards(embedding, 2)  # rows [0, 3) and [3, 6): the padding row is in the second
    torch.testing.assert_close(torch.cat([embedding_weight_grad(s, tokens, grad) for s in shards]), expected)
    partial = embedding_partial(shards[0], tokens)
    assert torch.equal(partial[0, 0], torch.zeros(2, dtype=F64))  # token 4 is not in shard 0
    torch.testing.assert_close(partial[0, 1], output[0, 1].detach(), **TOL)


def test_constructor_and_shape_errors_name_the_sizes():
    with pytest.raises(PipelineError, match=r"vocab=5 disagrees with the head weight's 7 rows"):
        VocabParallelHead(torch.zeros(7, 3), 5)
    with pytest.raises(PipelineError, match="needs the vocabulary size"):
        VocabParallelHead(3)
    with pytest.raises(PipelineError, match=r"dim=4 disagrees with the embedding weight's 3 columns"):
        VocabParallelEmbedding(torch.zeros(7, 3), 4)
    with pytest.raises(PipelineError, match="padding_idx 7 is outside"):
        VocabParallelEmbedding(7, 3, padding_idx=7)
    with pytest.raises(PipelineError, match="softcap must be"):
        VocabParallelHead(3, 5, softcap=0.0)
    with pytest.raises(PipelineError, match="dtype apply only to a new weight"):
        VocabParallelHead(torch.zeros(7, 3), dtype=F64)
    head = VocabParallelHead(3, 5)
    with pytest.raises(PipelineError, match=r"hidden states must be 2-D \[n, 3\].*\(2, 4\)"):
        head_partials(head, torch.zeros(2, 4), torch.tensor([0, 1]))
    with pytest.raises(PipelineError, match=r"labels must have shape \[2\]"):
        head_partials(head, torch.zeros(2, 3), torch.tensor([0, 1, 2]))
    with pytest.raises(PipelineError, match=r"float64 but the head weight is torch.float32"):
        head_partials(head, torch.zeros(2, 3, dtype=F64), torch.tensor([0, 1]))
    with pytest.raises(PipelineError, match=r"stats must be \[shards, 2, 3\]"):
        head_totals(torch.zeros(2, 3), torch.tensor([0, 1]), ignore_index=IGNORE)
    with pytest.raises(PipelineError, match=r"gradient must have shape \(2, 3\)"):
        embedding_weight_grad(VocabParallelEmbedding(5, 3), torch.tensor([0, 1]), torch.zeros(2, 4))


@pytest.mark.parametrize("softcap", [None, 3000.0])
def test_huge_logits_do_not_overflow(softcap):
    """Logits of ±thousands: exp of a raw logit would be inf; the rescaled sums stay exact."""
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(13, 4, generator=generator, dtype=F64) * 1000
    hidden = torch.randn(6, 4, generator=generator, dtype=F64)
    labels = torch.tensor([0, 12, 5, IGNORE, 7, 3])
    assert math.isinf(torch.exp(hidden @ weight.T).max().item())
    head = VocabParallelHead(weight, softcap=softcap)
    expected = _reference_head(weight, hidden, labels, softcap, 0.5)
    for count in (1, 3, 13):
        for got, want in zip(_sharded_head(head, hidden, labels, count, 0.5), expected):
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-8)
