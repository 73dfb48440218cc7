"""The Pipeline's request record (``zerobubble.runtime.construct.request``), in one process, no ranks.

``Pipeline(...)``'s keyword API builds a :class:`PipelineRequest`: the same names, defaults and
annotations; the record is frozen; the checks that need no peer raise when it is made, with the
messages they had before it existed, and so from ``Pipeline(...)`` before any process group is
joined.  The construction's functions read the record instead of loose parameters: none of the
runtime's takes more than 8, but for the public names whose keyword arguments are the API.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
import torch.nn.functional as F
from torch import nn

from zerobubble import Pipeline, VocabParallelEmbedding, VocabParallelHead
from zerobubble.runtime import PipelineError
from zerobubble.runtime.construct.request import PipelineRequest


def _layers() -> list[nn.Module]:
    return [nn.Linear(4, 4), nn.Linear(4, 4)]


def _pipeline_parameters() -> list[inspect.Parameter]:
    return list(inspect.signature(Pipeline.__init__).parameters.values())[1:]  # without self


def test_the_pipelines_keywords_are_the_requests_fields_with_their_defaults():
    pipeline = _pipeline_parameters()
    record = list(inspect.signature(PipelineRequest).parameters.values())
    assert [p.name for p in pipeline] == [p.name for p in record]
    assert [p.name for p in pipeline] == [f.name for f in dataclasses.fields(PipelineRequest)]
    assert [p.default for p in pipeline] == [p.default for p in record]
    assert [p.annotation for p in pipeline] == [p.annotation for p in record]
    assert len(pipeline) == 29  # the layers and 28 options
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in pipeline[1:])


def test_the_request_is_frozen_and_keyword_only():
    request = PipelineRequest(layers=_layers(), schedule="1f1b", microbatches=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.schedule = "zb-v"  # type: ignore[misc]
    with pytest.raises(TypeError):
        PipelineRequest(_layers())  # type: ignore[misc]
    assert isinstance(Pipeline.__dict__["request"], property) and Pipeline.request.fset is None


def test_the_derived_facts_are_properties_of_the_request():
    plain = PipelineRequest(layers=_layers(), partition=[1])
    assert not plain.vocab_parallel and not plain.parallelized and not plain.wants_profile
    assert plain.cut_points == [1] and plain.vocab_layers == (None, None)
    head = VocabParallelHead(4, 8)
    vocab = PipelineRequest(layers=_layers(), head=head, partition="profile")
    assert vocab.vocab_parallel and not vocab.parallelized and vocab.wants_profile
    assert PipelineRequest(layers=_layers(), parallelize=lambda layer, mesh: layer).parallelized
    assert vocab.cut_points is None and vocab.vocab_layers == (head, None)
    assert PipelineRequest(layers=_layers(), schedule="auto").wants_profile


def _head() -> VocabParallelHead:
    return VocabParallelHead(4, 8)


CHECKS = [  # (options, the PipelineError's message: the one Pipeline(...) raised before the record)
    (
        {"timeout": 0},
        "timeout must be a positive number of seconds, got 0",
    ),
    (
        {"compile": "yes"},
        "compile= takes True, False or a dict of torch.compile keyword arguments, not str",
    ),
    (
        {"partition": "even"},
        "partition='even': pass a list of cut points, None (even), or \"profile\" with a schedule name "
        '(schedule="auto" always chooses its partition from the profile)',
    ),
    (
        {"schedule": "auto", "partition": "profile"},
        "partition='profile': pass a list of cut points",
    ),
    (
        {"head": "lm_head"},
        "head= takes a zerobubble.VocabParallelHead, not str",
    ),
    (
        {"embedding": nn.Embedding(8, 4)},
        "embedding= takes a zerobubble.VocabParallelEmbedding, not Embedding",
    ),
    (
        {"head": "head", "loss_fn": F.mse_loss},
        "head= computes the loss (the exact cross-entropy over the whole vocabulary): drop loss_fn=",
    ),
    (
        {"head": "head", "data_parallel": "hsdp"},
        "the vocabulary-parallel head and embedding shard over each replica's pipeline ranks: they combine "
        'with data_parallel= (a replica count, "replicate" or "fsdp") but not with data_parallel="hsdp"',
    ),
    (
        {"embedding": "embedding", "schedule": "auto"},
        'schedule="auto" with embedding= needs head= too',
    ),
    (  # the checks run in their order of before: the vocabulary layers, compile, timeout, partition
        {"head": "lm_head", "compile": "yes", "timeout": 0, "partition": "even"},
        "head= takes a zerobubble.VocabParallelHead, not str",
    ),
    (
        {"compile": "yes", "timeout": 0, "partition": "even"},
        "compile= takes True",
    ),
]


def _options(options: dict) -> dict:
    """``options`` with the stand-ins ``"head"`` and ``"embedding"`` made vocabulary-parallel layers."""
    made = {"head": _head, "embedding": lambda: VocabParallelEmbedding(8, 4)}
    return {k: made[k]() if k in made and v == k else v for k, v in options.items()}


@pytest.mark.parametrize(("options", "message"), CHECKS, ids=[str(sorted(o)) for o, _ in CHECKS])
def test_the_request_raises_todays_errors_when_made_and_so_does_the_pipeline(options, message):
    """Raised before any collective: no process group exists in this test."""
    with pytest.raises(PipelineError, match=re.escape(message)):
        PipelineRequest(layers=_layers(), **_options(options))
    with pytest.raises(PipelineError, match=re.escape(message)):
        Pipeline(_layers(), **_options(options))
