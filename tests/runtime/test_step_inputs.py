"""Model inputs and outputs: keyword arguments to the layers, returned outputs, per-microbatch losses.

One spawn of two gloo ranks runs every pipelined case (``_step_inputs.step_cases``); the unit tests
below it need no ranks.
"""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from _dist import run_ranks
from _step_inputs import step_cases
from torch import nn

from zerobubble.runtime import PipelineError
from zerobubble.runtime.construct.staging import (
    StageModule,
    layer_keywords,
    merge_microbatches,
    split_keywords,
)
from zerobubble.runtime.parallel.consistency import CallSignature, explain_calls, keyword_signature

SCHEDULES = ("zb-h1", "zb-v", "1f1b")


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(step_cases, 2, timeout=240)


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_keyword_arguments_give_the_gradients_of_plain_autograd(ranks, schedule):
    for rank in ranks:
        assert rank[schedule]["grads"] < 1e-5
        assert rank[schedule]["second"] < 1e-5
    if schedule != "1f1b":  # a schedule with W ops: Open(**kwargs) is split generically
        paths = {path for rank in ranks for path in rank[schedule]["split"]}
        assert any(path.startswith("generic") for path in paths), paths


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_return_outputs_and_losses_on_the_last_stage(ranks, schedule):
    last, other = sorted((rank[schedule] for rank in ranks), key=lambda case: not case["holds_loss"])
    assert last["loss"] < 1e-6
    assert last["outputs"] < 1e-6 and last["outputs_shape"] == [8, 3, 11]
    assert last["losses_count"] == 4 and last["losses"] < 1e-6
    assert last["eval_loss"] < 1e-6 and last["eval_outputs"] < 1e-6 and last["eval_losses"] < 1e-6
    assert last["plain_return"] == "Tensor"  # without return_outputs: the loss alone, as before
    assert other["returned"] == (None, None) and other["plain_return"] == "NoneType"


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "case, words",
    [
        ("missing_on_rank_1", "'position_ids' is passed on rank 0 but not on rank 1"),
        ("shape_on_rank_1", "'attention_mask' is a [8, 3] int64 tensor on rank 0 but a [8, 2] int64 tensor"),
        ("value_on_rank_1", "'temperature' is 0.7 on rank 0 but 0.5 on rank 1"),
        ("requires_grad", "'token_weights' of step() requires grad"),
        ("not_split", "batch size 6 (dimension 0), which does not split into 4 equal microbatches"),
        ("container", "is a list holding tensors"),
        ("losses_tuple", "losses= takes a list"),
    ],
)
def test_keyword_errors_are_the_same_on_every_rank(ranks, case, words):
    messages = [rank["errors"][case] for rank in ranks]
    assert words in messages[0], messages[0]
    if case.endswith("on_rank_1"):
        assert messages[0] == messages[1]  # the call check: one message everywhere
    else:  # a local error, made on both ranks: each raises it (named by the check on the others)
        assert all(words in message for message in messages)


@pytest.mark.multiprocess
def test_the_pipeline_stays_usable_after_keyword_errors(ranks):
    assert all(rank["errors"]["usable_after"] < 1e-5 for rank in ranks)


@pytest.mark.multiprocess
def test_auto_profiles_the_layers_with_the_examples_keyword_arguments(ranks):
    for rank in ranks:
        auto = rank["auto"]
        assert auto["layers"] == 8 and auto["grads"] < 1e-5
        # without its keywords the layer needing the mask fails in the profile, on every rank
        assert 'schedule="auto" cannot run: profiling the layers failed' in auto["without_keywords"]
        assert "attention_mask" in auto["without_keywords"]
        assert "batch size 6 (dimension 0), which does not split into 4" in auto["not_split"]
        assert "example=(inputs, targets, {" in auto["not_a_dict"]
        assert "a third element that is a list, not a dict" in auto["not_a_dict"]


@pytest.mark.multiprocess
def test_a_keyword_no_layer_takes_is_refused(ranks):
    for rank in ranks:
        message = rank["unknown"]
        assert "'past_key_values' of step() is taken by no layer's forward" in message
        assert "1 (attention_mask, position_ids, temperature)" in message


@pytest.mark.multiprocess
def test_a_dict_between_stages_is_refused_naming_the_layer(ranks):
    for rank in ranks:
        message = rank["dict_between_stages"]
        assert "returns a dict with keys ['hidden', 'scaled']" in message
        assert "make layer 2 return a tuple of tensors" in message


# -- no ranks ----------------------------------------------------------------------------------------


class _Named(nn.Module):
    def forward(self, x, mask=None, *, scale=1.0):
        return x * scale if mask is None else x * mask * scale


class _Rest(nn.Module):
    def forward(self, x, y, **kwargs):
        return x + y + sum(kwargs.values())


def test_layer_keywords_follow_the_class_forward_and_skip_positional_values():
    named = layer_keywords(_Named())
    assert named.positional == ("x", "mask") and named.named == {"scale"} and not named.rest
    assert named.select({"mask": 2, "scale": 3, "other": 4}, given=1) == {"mask": 2, "scale": 3}
    assert named.select({"mask": 2, "scale": 3}, given=2) == {"scale": 3}  # mask came by position
    rest = layer_keywords(_Rest())
    assert rest.rest and rest.select({"y": 1, "z": 2}, given=2) == {"z": 2}
    layer = _Named()
    layer.forward = lambda *args, **kwargs: None  # an installed forward does not change what it takes
    assert layer_keywords(layer) == named
    assert layer_keywords(nn.Linear(2, 2)).positional == ("input",)


def test_stage_module_passes_each_layer_its_keywords():
    stage = StageModule([_Named(), nn.Tanh(), _Named()])
    x = torch.ones(2, 3)
    out = stage(x, mask=torch.full((2, 3), 0.5), scale=2.0)
    torch.testing.assert_close(out, torch.tanh(torch.ones(2, 3)) * 0.5 * 2.0)
    torch.testing.assert_close(stage(x), torch.tanh(x))


def test_split_keywords():
    keywords = [("0", layer_keywords(_Named()))]
    mask = torch.arange(8.0).reshape(4, 2)
    pieces = split_keywords({"mask": mask, "scale": 2.0}, 2, torch.device("cpu"), "step", keywords)
    assert len(pieces) == 2 and pieces[1]["scale"] == 2.0
    torch.testing.assert_close(pieces[1]["mask"], mask[2:])
    scalar = torch.tensor(3.0)
    assert split_keywords({"scale": scalar}, 2, torch.device("cpu"), "step", keywords)[1]["scale"] is scalar
    assert split_keywords({}, 2, torch.device("cpu"), "step", keywords) == []
    with pytest.raises(PipelineError, match="requires grad"):
        split_keywords({"mask": mask.requires_grad_()}, 2, torch.device("cpu"), "step", keywords)
    # evaluate runs no backward: a tensor that requires grad is only a constant there
    assert len(split_keywords({"mask": mask}, 2, torch.device("cpu"), "evaluate", keywords)) == 2
    with pytest.raises(PipelineError, match="taken by no layer's forward"):
        split_keywords({"bias": 1}, 2, torch.device("cpu"), "step", keywords)


def test_merge_microbatches():
    Pair = namedtuple("Pair", "a b")
    parts = [
        {"logits": torch.ones(2, 3) * j, "aux": torch.tensor(float(j)), "pair": Pair(torch.ones(1) * j, "x")}
        for j in range(3)
    ]
    merged = merge_microbatches(parts)
    assert merged["logits"].shape == (6, 3) and merged["aux"].tolist() == [0.0, 1.0, 2.0]
    assert isinstance(merged["pair"], Pair) and merged["pair"].a.tolist() == [0.0, 1.0, 2.0]
    assert merged["pair"].b == ["x", "x", "x"]


def test_keyword_signature_and_its_explanation():
    mask = torch.ones(8, 3, dtype=torch.int64)
    mine = keyword_signature(
        {"position_ids": mask, "attention_mask": mask, "causal": True, "cache": object()}
    )
    assert [name for name, _ in mine] == ["attention_mask", "cache", "causal", "position_ids"]
    base = CallSignature("step", 1.0, None, None, keywords=mine)
    other = CallSignature("step", 1.0, None, None, keywords=keyword_signature({"attention_mask": mask[:4]}))
    assert base.items()[4] != other.items()[4]
    assert CallSignature("step", 1.0).items()[4] == CallSignature("step", 1.0, keywords=()).items()[4]
    text = explain_calls([base, other])
    assert "'attention_mask' is a [8, 3] int64 tensor on rank 0 but a [4, 3] int64 tensor on rank 1" in text
    flag = CallSignature("step", 1.0, keywords=keyword_signature({"causal": False}))
    assert "'attention_mask' is passed on rank 0 but not on rank 1" in explain_calls([other, flag])
