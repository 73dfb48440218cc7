"""How much of a mixture-of-experts block's backward the B/W split defers to W, and what it costs.

A transformers Mixtral sparse block (router and fused 3-D expert weights ``gate_up_proj`` /
``down_proj``, no fast path: the generic split, the router's ``F.linear`` routed) is split with
``install_deferral``; each round times one fused backward of an identical copy (plain autograd) and
the split's B then W on the same input and output gradient.  Prints the medians, ``(B + W) /
fused`` and the W share ``W / (B + W)``, per experts implementation (``eager``: a loop over the
experts on slices of the 3-D weights; ``grouped_mm``: one grouped GEMM each) and dtype.

    python benchmarks/moe_split.py --tokens 512 --repeats 15
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from zerobubble.runtime.wgrad import WeightGradStore, install_deferral


def _block(implementation: str, dtype: torch.dtype, hidden: int, experts: int) -> torch.nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_local_experts=experts,
        num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4, vocab_size=16,
    )  # fmt: skip
    config._experts_implementation = implementation
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(config).to(dtype)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.05)
    return block


def measure(implementation: str, dtype: torch.dtype, tokens: int, repeats: int) -> dict[str, float]:
    """Median milliseconds of the fused backward, B and W, over ``repeats`` rounds (after 3 warm)."""
    split = _block(implementation, dtype, hidden=256, experts=8)
    fused = copy.deepcopy(split)
    store = WeightGradStore()
    install_deferral([split], store)
    x = torch.randn(1, tokens, 256, dtype=dtype)
    grad = torch.randn_like(x)
    times: dict[str, list[float]] = {"fused": [], "B": [], "W": []}
    for round_ in range(repeats + 3):
        output = fused(x.clone().requires_grad_())
        start = time.perf_counter()
        output.backward(grad)
        middle = time.perf_counter()
        output = split(x.clone().requires_grad_())
        begin = time.perf_counter()
        store.begin((0, round_), defer=True)
        output.backward(grad)
        store.end()
        between = time.perf_counter()
        store.flush((0, round_))
        end = time.perf_counter()
        if round_ >= 3:
            times["fused"].append(middle - start)
            times["B"].append(between - begin)
            times["W"].append(end - between)
    return {name: 1e3 * statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("experts     dtype     fused ms  B ms    W ms    (B+W)/fused  W share")
    cases = [("eager", torch.float64), ("eager", torch.float32), ("grouped_mm", torch.float32)]
    cases.append(("grouped_mm", torch.bfloat16))
    for implementation, dtype in cases:
        ms = measure(implementation, dtype, args.tokens, args.repeats)
        ratio, share = (ms["B"] + ms["W"]) / ms["fused"], ms["W"] / (ms["B"] + ms["W"])
        name = str(dtype).removeprefix("torch.")
        print(
            f"{implementation:<11} {name:<9} {ms['fused']:8.2f}  {ms['B']:6.2f}  {ms['W']:6.2f}  "
            f"{ratio:11.2f}  {share:7.2f}"
        )


if __name__ == "__main__":
    main()
