"""The split inside compiled layers (``runtime/wgrad/compiled.py``), one process, against eager autograd.

Each case compiles a few identical blocks (LayerNorm, Linear with and without bias, transformers'
``Conv1D``, a weight shared by two linears, GELU, residual), installs the split as a zero-bubble
schedule does, runs B per microbatch then W, and checks: no linear weight has a gradient after B
(the norm's does: the compiled backward computes it), every gradient after W and every input
gradient equals eager autograd's, the first stage's case (an input without gradient) included,
with no graph break, one graph per input kind (not per block) and no recompile on a second step.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from zerobubble.runtime.construct.staging import StageModule
from zerobubble.runtime.wgrad import SplitGuard, SplitMismatchWarning, WeightGradStore, install_deferral
from zerobubble.runtime.wgrad import compiled as compiled_split
from zerobubble.runtime.wgrad.install import COMPILED_LINEAR_PATH, COMPILED_PATH, COMPILED_SPLIT_PATH
from zerobubble.runtime.wgrad.rules import MatmulRule

WIDTH = 8
LINEARS = ("up", "down", "proj", "tied_a", "tied_b")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH, bias=False)
        self.proj = Conv1D(WIDTH, WIDTH)  # GPT-2's: x @ W + b with W (in, out)
        self.tied_a = nn.Linear(WIDTH, WIDTH, bias=False)
        self.tied_b = nn.Linear(WIDTH, WIDTH)
        self.tied_b.weight = self.tied_a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.down(F.gelu(self.up(self.norm(x))))
        return h + self.proj(torch.tanh(self.tied_b(self.tied_a(h))))


def _blocks(dtype: torch.dtype) -> list[nn.Module]:
    torch.manual_seed(0)
    return [Block().to(dtype) for _ in range(3)]


def _microbatches(dtype: torch.dtype, first_stage: bool) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [
        torch.randn(2, 3, WIDTH, generator=generator, dtype=dtype).requires_grad_(not first_stage)
        for _ in range(2)
    ]


def _run(blocks, x, autocast):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for block in blocks:
            x = block(x)
    return x.float().square().mean()


CASES = [
    # backend, first stage (input without gradient), bf16 autocast, fullgraph, defer
    ("aot_eager", False, False, True, True),
    ("aot_eager", True, False, False, True),
    ("aot_eager", False, True, True, True),
    ("aot_eager", False, False, False, False),  # a zero-bubble schedule's fused BW op
    ("inductor", True, False, True, True),
    ("inductor", False, True, False, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_compiled_linears_defer_their_weights_to_w_and_match_eager_autograd(case):
    backend, first_stage, autocast, fullgraph, defer = case
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    dtype = torch.float32 if autocast else torch.float64
    blocks, reference = _blocks(dtype), _blocks(dtype)
    for block in blocks:
        block.compile(backend=backend, fullgraph=fullgraph)
    store = WeightGradStore()
    deferral = install_deferral(blocks, store)
    linears = {id(getattr(block, name)) for block in blocks for name in LINEARS}
    assert {id(m) for m in deferral.compiled_linears} == linears
    paths = {id(m): path for m, path in deferral.paths()}
    assert all(paths[id(block)] == COMPILED_SPLIT_PATH for block in blocks)
    assert all(paths[key] == COMPILED_LINEAR_PATH for key in linears)

    for step in range(2):  # the second step must reuse the graphs: any recompile raises
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            inputs = _microbatches(dtype, first_stage)
            for j, x in enumerate(inputs):
                loss = _run(blocks, x, autocast)
                store.begin((0, j), defer=defer)
                loss.backward()
                store.end()
            if defer:
                early = [n for b in blocks for n, p in b.named_parameters() if p.grad is not None]
                assert sorted(set(early)) == ["norm.bias", "norm.weight"], early  # the rest waits for W
                for key in reversed(store.pending_keys()):
                    store.flush(key)
            assert store.pending_keys() == []
            references = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
            for x in references:
                _run(reference, x, autocast).backward()
            _assert_close(blocks, reference, inputs, references, autocast)
            for block in blocks + reference:
                block.zero_grad(set_to_none=True)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] <= 2  # the first block's input kind, the others'


def _assert_close(blocks, reference, inputs, references, autocast):
    # under bf16 autocast the compiled graph and eager round differently: a looser bound
    rtol, atol = (5e-2, 5e-3) if autocast else (1e-9, 1e-12)
    for block, expected in zip(blocks, reference):
        want = dict(expected.named_parameters())
        for name, param in block.named_parameters():
            assert param.grad is not None and param.grad.dtype == param.dtype, name
            torch.testing.assert_close(param.grad, want[name].grad, rtol=rtol, atol=atol, msg=name)
    for x, r in zip(inputs, references):
        if x.requires_grad:
            torch.testing.assert_close(x.grad, r.grad, rtol=rtol, atol=atol)


def test_a_schedule_without_w_keeps_the_compiled_fused_backward():
    blocks = _blocks(torch.float64)
    for block in blocks:
        block.compile(backend="aot_eager")
    deferral = install_deferral(blocks, WeightGradStore(), generic=False)
    assert deferral.compiled_linears == []
    assert all(path == COMPILED_PATH for _, path in deferral.paths())


def test_removing_the_split_gives_the_linears_their_own_forward_back():
    block = copy.deepcopy(_blocks(torch.float64)[0])
    block.compile(backend="aot_eager")
    deferral = install_deferral([block], WeightGradStore())
    deferral.remove()
    for name in LINEARS:
        linear = getattr(block, name)
        assert "forward" not in linear.__dict__
        assert not any(key.startswith("_zerobubble") for key in linear.weight.__dict__)


class _OffByTwo(MatmulRule):
    """A broken W for compiled linears: twice the weight gradient."""

    def accumulate_into(self, weight, bias, saved, grad_output, needed):
        super().accumulate_into(weight, bias, saved, 2 * grad_output, needed)


def test_the_split_guard_checks_compiled_linears_against_eager_and_falls_them_back(monkeypatch):
    """A wrong W inside a compiled layer is caught before training: the linears fall back to the
    compiled fused backward (recompiled without the split) and the step's gradients are exact."""
    monkeypatch.setitem(compiled_split._RULES, True, _OffByTwo(weight_is_out_by_in=True))
    torch._dynamo.reset()
    blocks, reference = _blocks(torch.float64), _blocks(torch.float64)
    for block in blocks:
        block.compile(backend="aot_eager")
    store = WeightGradStore()
    deferral = install_deferral(blocks, store)
    stage = StageModule(blocks)
    guard = SplitGuard(
        stage=0, module=stage, store=store, deferral=deferral, names={}, strict=False,
        deferred=True, fused=False,
    )  # fmt: skip
    x = _microbatches(torch.float64, first_stage=False)[0]
    with pytest.warns(SplitMismatchWarning, match="compiled: weight gradient in W"):
        guard.before_forward((x,))
    fallen = {id(module) for module, _ in deferral.fallen}
    assert {id(block.up) for block in blocks} <= fallen  # nn.Linear: the broken rule's
    assert not {id(block.proj) for block in blocks} & fallen  # Conv1D's rule is intact
    with store.keyed_forward((0, 0)):
        loss = _run([stage], x, autocast=False)
    store.begin((0, 0), defer=True)
    loss.backward()
    store.end()
    store.flush((0, 0))
    reference_x = x.detach().clone().requires_grad_()
    _run(reference, reference_x, autocast=False).backward()
    _assert_close(blocks, reference, [x], [reference_x], autocast=False)


@pytest.mark.parametrize("family", ["gpt2", "llama", "opt"])
def test_compiled_transformers_layers_keep_the_split_and_match_eager(family):
    """The Hugging Face adapters' layers compiled (sdpa attention, float64): their projections defer
    to W, nothing breaks the graph, and the gradients after W are eager autograd's."""
    from _hf_models import lm_loss, run_layers, tiny_model, token_batch
    from torch._dynamo.utils import counters

    from zerobubble.hf import pipeline_layers

    torch._dynamo.reset()
    counters.clear()
    layers = pipeline_layers(tiny_model(family, "sdpa").double())
    reference = copy.deepcopy(layers)
    for layer in layers:
        layer.compile(backend="aot_eager")
    store = WeightGradStore()
    deferral = install_deferral(layers, store)
    tokens, targets = token_batch(2)
    loss = lm_loss(run_layers(layers, tokens), targets)
    store.begin((0, 0), defer=True)
    loss.backward()
    store.end()
    tied = {id(m.weight) for layer in layers for m in layer.modules() if isinstance(m, nn.Embedding)}
    untied = [m for m in deferral.compiled_linears if id(m.weight) not in tied]  # not the tied head
    assert untied
    assert all(m.weight.grad is None for m in untied)  # waiting for W
    store.flush((0, 0))
    lm_loss(run_layers(reference, tokens), targets).backward()
    for layer, expected in zip(layers, reference):
        for (name, param), want in zip(layer.named_parameters(), expected.parameters()):
            assert (param.grad is None) == (want.grad is None), name
            if want.grad is not None:
                torch.testing.assert_close(param.grad, want.grad, rtol=1e-9, atol=1e-12, msg=name)
    assert sum(counters["graph_break"].values()) == 0
