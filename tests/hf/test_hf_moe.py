"""The mixture-of-experts families (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE): the cut
computes the model's loss with its router load-balancing loss, the B/W split of the fused 3-D expert
weights equals plain autograd, and 2 ranks train like the model in one process in float64.

The families without the auxiliary loss are also in ``_hf_models.FAMILIES``: tests/hf/test_hf.py and
tests/hf/test_hf_vocab.py check them as every other family.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from _dist import run_ranks
from _hf_models import MOE, lm_loss, padded_batch, run_layers, shift_labels, tiny_model
from _hf_moe import batch, moe_model, moe_training_cases
from hypothesis import given, settings
from hypothesis import strategies as st

from zerobubble.hf import pipeline_layers, with_router_aux_loss
from zerobubble.runtime.wgrad import WeightGradStore, install_deferral

LAYOUTS = ("whole", "left", "packed")


def _loss_and_grads(model, layers, layout):
    """The model's own loss (cross-entropy + coef · its aux_loss) and gradients, then the cut's."""
    tokens, targets, kwargs = batch(layout, seed=3)
    output = model(tokens, use_cache=False, **kwargs)
    expected = lm_loss(output.logits, targets) + model.config.router_aux_loss_coef * output.aux_loss
    expected.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss = with_router_aux_loss(lm_loss)(run_layers(layers, tokens, **kwargs), targets)
    loss.backward()
    return expected, grads, loss


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_cut_adds_the_models_router_aux_loss_exactly(family, layout):
    model = moe_model(family, aux=True)
    layers = pipeline_layers(model)
    expected, grads, loss = _loss_and_grads(model, layers, layout)
    # measured: bitwise equal (transformers 5.25, CPU, float64): the same ops in the same order
    torch.testing.assert_close(loss, expected, rtol=1e-14, atol=0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], rtol=1e-12, atol=1e-15, msg=name)


@pytest.mark.parametrize("family", MOE)
def test_the_aux_loss_reaches_every_router(family):
    """The check above can fail: without the auxiliary loss every router's gradient differs."""
    routers = {}
    for aux in (False, True):
        model = moe_model(family, aux)
        tokens, targets, _ = batch("whole", seed=3)
        with_router_aux_loss(lm_loss)(run_layers(pipeline_layers(model), tokens), targets).backward()
        routers[aux] = {n: p.grad for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")}
    assert len(routers[True]) >= 3  # one per sparse block (Qwen2-MoE's block 1 is dense)
    for name, grad in routers[True].items():
        assert (grad - routers[False][name]).abs().max() > 1e-4 * grad.abs().max(), name


def test_the_aux_loss_of_the_microbatches_is_not_the_whole_batchs():
    """Why the Pipeline matches the mean of the microbatches' losses (docs/transformers.md): the
    auxiliary loss multiplies counts by probabilities summed over the batch it is given."""
    model = moe_model("mixtral", aux=True)
    tokens, _, _ = batch("whole", seed=3)
    whole = model(tokens, use_cache=False).aux_loss
    parts = torch.stack([model(part, use_cache=False).aux_loss for part in tokens.chunk(4)]).mean()
    assert abs(whole - parts) > 1e-3 * whole


def test_vocab_parallel_refuses_the_aux_loss():
    with pytest.raises(ValueError, match="output_router_logits = False"):
        pipeline_layers(moe_model("qwen3_moe", aux=True), vocab_parallel=True)
    pipeline_layers(moe_model("qwen3_moe", aux=False), vocab_parallel=True)  # without it: cut


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_experts_have_the_models_logits_and_gradients(family, dtype):
    """transformers' default ``grouped_mm`` experts (float32, bfloat16 on CPU) cut exactly too."""
    model = tiny_model(family, "sdpa", experts="grouped_mm").to(dtype).train()
    tokens, labels, kwargs = padded_batch(4, "right")
    output = model(tokens, use_cache=False, **kwargs)
    lm_loss(output.logits.float(), shift_labels(labels)).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    logits = run_layers(pipeline_layers(model), tokens, **kwargs)
    lm_loss(logits.float(), shift_labels(labels)).backward()
    torch.testing.assert_close(logits, output.logits, rtol=0, atol=0)  # measured: bitwise
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], rtol=0, atol=0, msg=name)


# -- the B/W split of the fused expert weights ------------------------------------------------------

#: family → (its config class, its experts class).
_EXPERTS = {
    "mixtral": ("MixtralConfig", "MixtralExperts"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeExperts"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeExperts"),
}


@st.composite
def expert_cases(draw):
    family = draw(st.sampled_from(MOE))
    experts = draw(st.integers(1, 6))
    implementation = draw(st.sampled_from(["eager", "grouped_mm"]))
    dtypes = [torch.float32, torch.bfloat16] + ([torch.float64] if implementation == "eager" else [])
    unit = 8 if implementation == "grouped_mm" else 1  # grouped_mm's strides: multiples of 16 bytes
    return {
        "family": family,
        "experts": experts,
        "top_k": draw(st.integers(1, min(experts, 3))),
        "tokens": draw(st.integers(1, 24)),
        "hidden": unit * draw(st.integers(1, 12 // unit + 1)),
        "intermediate": unit * draw(st.integers(1, 10 // unit + 1)),
        "implementation": implementation,
        "dtype": draw(st.sampled_from(dtypes)),
        "seed": draw(st.integers(0, 2**16)),
    }


def _experts_module(case):
    import importlib

    import transformers

    family = case["family"]
    config = getattr(transformers, _EXPERTS[family][0])(
        hidden_size=case["hidden"], intermediate_size=case["intermediate"],
        moe_intermediate_size=case["intermediate"], num_local_experts=case["experts"],
        num_experts=case["experts"], num_experts_per_tok=case["top_k"],
    )  # fmt: skip
    config._experts_implementation = case["implementation"]
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cls = getattr(modeling, _EXPERTS[family][1])
    experts = cls(config).to(case["dtype"])
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(0, 0.5)
    return experts


@settings(max_examples=60, deadline=None)
@given(expert_cases())
def test_the_split_of_the_fused_expert_weights_equals_plain_autograd(case):
    """B gives the hidden states' and the routing weights' gradients and no weight gradient; W the
    gradients of ``gate_up_proj`` and ``down_proj``: all bitwise those of plain autograd."""
    generator = torch.Generator().manual_seed(case["seed"])
    dtype, n, k, e = case["dtype"], case["tokens"], case["top_k"], case["experts"]
    experts = _experts_module(case)
    reference = copy.deepcopy(experts)
    hidden = torch.randn(n, case["hidden"], generator=generator).to(dtype)
    index = torch.rand(n, e, generator=generator).argsort(dim=-1)[:, :k]  # k distinct experts a token
    weights = torch.rand(n, k, generator=generator).to(dtype)
    grad = torch.randn(n, case["hidden"], generator=generator).to(dtype)

    inputs = [hidden.clone().requires_grad_(), weights.clone().requires_grad_()]
    reference(inputs[0], index, inputs[1]).backward(grad)

    store = WeightGradStore()
    deferral = install_deferral([experts], store)
    split = [hidden.clone().requires_grad_(), weights.clone().requires_grad_()]
    output = experts(split[0], index, split[1])
    store.begin((0, 0), defer=True)
    output.backward(grad)
    store.end()
    assert all(p.grad is None for p in experts.parameters()), "B computed a weight gradient"
    for actual, expected in zip(split, inputs):
        torch.testing.assert_close(actual.grad, expected.grad, rtol=0, atol=0)
    store.flush((0, 0))
    for (name, param), expected in zip(experts.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, expected.grad, rtol=0, atol=0, msg=name)
    # routed to a closed form: the eager loop's F.linear on one expert's matrix (W: one GEMM into that
    # expert's rows of the gradient) and torch's grouped product (W: one grouped product); float64 has
    # no torch grouped product, and transformers' own fallback op runs on the generic split's local graph
    routed = case["implementation"] == "eager" or case["dtype"] != torch.float64
    path = "generic+linear" if routed else "generic"
    assert set(deferral.summary()) == {f"{path} {_EXPERTS[case['family']][1]}"}


# -- 2 ranks ----------------------------------------------------------------------------------------

#: Every family on 1F1B, ZB-V (each rank two stages) and ZB-H1 (B and W apart), with the auxiliary
#: loss on unpadded and padded batches, and without it against the whole batch in one process.
TRAINED = [
    case
    for family in MOE
    for case in [
        (family, "1f1b", True, "whole"),
        (family, "zb-v", True, "left"),
        (family, "zb-h1", True, "right"),
        (family, "zb-v", False, "whole"),
    ]
]


@pytest.fixture(scope="module")
def trained() -> list[dict]:
    return run_ranks(moe_training_cases, 2, TRAINED, timeout=400)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", TRAINED, ids=lambda case: " ".join(map(str, case)))
def test_two_ranks_train_like_the_model_in_one_process(case, trained):
    family, schedule, aux, layout = case
    results = [ranks[" ".join((family, schedule, "aux" if aux else "no-aux", layout))] for ranks in trained]
    losses = [result["losses"] for result in results if result["losses"]]
    assert len(losses) == 1 and len(losses[0]) == 3 and max(losses[0]) <= 1e-12, losses
    covered = set().union(*(result["params"] for result in results))
    assert covered == {name for name, _ in moe_model(family, aux).named_parameters()}
    for result in results:
        worst = max(result["params"].items(), key=lambda item: item[1])
        assert worst[1] <= 1e-10, worst  # after three AdamW steps, float64
        assert result["mismatches"] == [], "the split guard found no mismatch"
        # 1F1B has no W ops: only the fast paths are installed, the experts keep plain autograd
        assert bool(result["report"]) == (schedule != "1f1b")
        assert all(path.startswith("generic") and verified for _, path, verified in result["report"])
