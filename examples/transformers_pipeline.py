"""Pipeline a Hugging Face ``transformers`` model end to end with a zero-bubble schedule.

    python examples/transformers_pipeline.py                      # GPT-2, 2 local CPU ranks, zb-v
    python examples/transformers_pipeline.py --model llama --schedule zb-h1 --steps 30
    python examples/transformers_pipeline.py --model gemma2     # or qwen2, mixtral, qwen3_moe, opt, …
    torchrun --nproc-per-node 4 examples/transformers_pipeline.py --model llama   # your launcher

A small randomly initialised model (nothing is downloaded) learns a Markov chain's next token.  The
model is cut into layers with :func:`zerobubble.hf.pipeline_layers` — an embedding, one layer per
decoder block and a head, weights shared (and tied) as in the transformers model, each block given
the causal mask the model would give it — and every parameter's gradient is split into B and W
without changing the model: GPT-2's ``Conv1D`` projections, linear layers, embeddings and layer
norms take fast paths, RMS norms the generic split.  ``--trace DIR`` writes the measured timeline
and prints each stage's W share of the backward.
"""

from __future__ import annotations

import argparse
import os

import torch

import zerobubble
from zerobubble.hf import ADAPTERS, pipeline_layers, with_router_aux_loss
from zerobubble.runtime.launch import launch, under_launcher
from zerobubble_demo.models import MarkovCorpus, lm_loss

HEADS = 4
MOE = {"num_experts_per_tok": 2, "output_router_logits": True}

#: Options a family's config needs on top of the common sizes (per-head width, OPT's own names).
FAMILY_OPTIONS = {
    "gemma": lambda width: {"head_dim": width // HEADS},
    "gemma2": lambda width: {"head_dim": width // HEADS, "query_pre_attn_scalar": width // HEADS},
    "qwen3": lambda width: {"head_dim": width // HEADS},
    "opt": lambda width: {"ffn_dim": 4 * width, "word_embed_proj_dim": width},
    # mixture of experts: 4 experts, top 2, with the router's load-balancing loss
    "mixtral": lambda width: {"num_local_experts": 4, **MOE},
    "qwen2_moe": lambda width: {
        "num_experts": 4,
        "moe_intermediate_size": width,
        "shared_expert_intermediate_size": width,
        **MOE,
    },
    "qwen3_moe": lambda width: {"num_experts": 4, "moe_intermediate_size": width, **MOE},
}


def build_model(name: str, vocab: int, seq_len: int, width: int, depth: int) -> torch.nn.Module:
    """A random causal LM of family ``name`` (a ``config.model_type``) built from a config: nothing
    is downloaded.  The family's default ties (GPT-2's head is its token embedding) are kept."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    sizes = {
        "vocab_size": vocab, "hidden_size": width, "intermediate_size": 4 * width, "num_hidden_layers": depth,
        "num_attention_heads": HEADS, "num_key_value_heads": 2, "max_position_embeddings": seq_len,
        "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
    }  # fmt: skip
    options = FAMILY_OPTIONS.get(name, lambda _: {})(width)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(name, **sizes, **options))


def train(args: argparse.Namespace) -> None:
    """One rank's training loop (the same script runs on every rank)."""
    model = build_model(args.model, args.vocab, args.seq_len, args.width, args.depth)
    layers = pipeline_layers(model)
    del model  # the layers hold the weights; each rank keeps only its own after construction
    pipe = zerobubble.Pipeline(
        layers,
        schedule=args.schedule,
        microbatches=args.microbatches,
        loss_fn=with_router_aux_loss(lm_loss),  # adds a MoE model's router aux loss, if asked for
        trace=bool(args.trace),
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    corpus = MarkovCorpus(args.vocab, args.seq_len, seed=0)  # same seed on every rank: same batches
    for step in range(args.steps):
        inputs, targets = corpus.batch(args.batch)
        loss = pipe.step(inputs, targets)
        pipe.optimizer_step(optimizer, max_norm=1.0)
        optimizer.zero_grad(set_to_none=True)
        if loss is not None and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.3f}  (the chain's entropy: {corpus.entropy:.3f})")
    pipe.synchronize()
    if args.trace:
        report = pipe.write_trace(args.trace)
        timelines = pipe.measured_timelines()
        if timelines is not None:
            print("\n".join(report.lines()))
            print("W share of each stage's backward:", _w_shares(timelines[-1]))


def _w_shares(timeline) -> dict[int, float]:
    times: dict[int, dict[str, float]] = {}
    for rank, program in enumerate(timeline.schedule.programs):
        for op, start, end in zip(program, timeline.start[rank], timeline.end[rank]):
            kinds = times.setdefault(op.stage, {})
            kinds[op.kind.name] = kinds.get(op.kind.name, 0.0) + end - start
    return {
        stage: round(k.get("W", 0.0) / (k.get("B", 0.0) + k.get("W", 0.0) or 1.0), 3)
        for stage, k in sorted(times.items())
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(ADAPTERS), default="gpt2", help="the transformers family")
    parser.add_argument("--schedule", default="zb-v")
    parser.add_argument("--ranks", type=int, default=2, help="local ranks to spawn (without torchrun)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=4, help="decoder blocks")
    parser.add_argument("--trace", metavar="DIR", help="record the last steps and write the timeline here")
    args = parser.parse_args()
    if under_launcher():
        train(args)
    else:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        launch(train, args.ranks, (args,), threads=1)


if __name__ == "__main__":
    main()
