"""Our ``dualpipe-v`` against torch's ``ScheduleDualPipeV`` on the same tiny model, on gloo CPU ranks.

    python benchmarks/dualpipe_runtime.py [--model mlp|mixtral] [--ranks 2 4] [--microbatches 8]
                                          [--width 64] [--rows 16] [--rounds 5] [--steps 4]

Per rank count, in one run of ``ranks`` processes (one thread each): ``4·ranks`` layers cut evenly
into ``2·ranks`` chunks, placed in a V (rank ``r`` holds chunks ``r`` and ``2·ranks − 1 − r``) by
both, on the same batch and microbatches.  ``mlp``: Linear + Tanh layers and a mean-squared-error
loss.  ``mixtral``: a tiny random transformers Mixtral (4 experts, top-2, hidden ``width``, vocabulary
256, ``rows`` sequences of 16 tokens a microbatch) as :func:`zerobubble.hf.pipeline_layers` gives it —
the embedding, ``4·ranks − 2`` decoder blocks with their mixture-of-experts layers, the head — and the
cross-entropy of the next tokens; both schedules run the same layer objects' copies (torch's stages
take no keyword arguments, so both use the layers' default positions and no attention mask).  The two
run in rotating rounds (a barrier before and after each step; backward and ``zero_grad`` included,
no optimizer).  Prints per configuration the median step, the spread (fastest–slowest), the ratio
of the medians, and the largest gradient difference of one step against the whole model's backward
in one process (absolute, and relative to the largest gradient), in float32, over every parameter
of the model (each compared on the rank that holds it).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zerobubble import Pipeline
from zerobubble.runtime.launch import init_distributed, launch

OURS, THEIRS = "ours dualpipe-v", "torch ScheduleDualPipeV"


SEQUENCE = 16
VOCAB = 256


def _layers(model: str, count: int, width: int, experts: int = 4) -> list[nn.Module]:
    torch.manual_seed(0)
    if model == "mlp":
        return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(count)]
    from transformers import AutoModelForCausalLM, MixtralConfig

    from zerobubble.hf import pipeline_layers

    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=count - 2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts, num_experts_per_tok=2,
        max_position_embeddings=4 * SEQUENCE, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    causal_lm = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    return pipeline_layers(causal_lm)


def _batch(model: str, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    if model == "mlp":
        return torch.randn(rows, width, generator=generator), torch.randn(rows, width, generator=generator)
    tokens = torch.randint(0, VOCAB, (rows, SEQUENCE + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _loss_fn(model: str):
    if model == "mlp":
        return F.mse_loss

    def next_tokens(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten())

    return next_tokens


class _Chain(nn.Module):
    """Layers run in order, a tuple output passed on as positional arguments (as between stages)."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, *values):
        for layer in self.layers:
            values = layer(*values)
            values = values if isinstance(values, tuple) else (values,)
        return values if len(values) > 1 else values[0]


def _reference(layers: list[nn.Module], inputs, targets, m: int, loss_fn) -> dict[int, torch.Tensor]:
    """The gradients of the mean microbatch loss in one process, by (layer, parameter) position."""
    model = _Chain(copy.deepcopy(layers))
    for x, y in zip(inputs.chunk(m), targets.chunk(m)):
        (loss_fn(model(x), y) / m).backward()
    return {i: p.grad.clone() for i, p in enumerate(model.parameters())}


def _difference(layers: list[nn.Module], expected: dict[int, torch.Tensor]) -> tuple[float, float, int]:
    """Largest |gradient − one process| over this rank's parameters, the largest |gradient|, and how
    many parameters this rank compared (those with a gradient: the ones it holds)."""
    worst, scale, count = 0.0, 0.0, 0
    for i, p in enumerate(param for layer in layers for param in layer.parameters()):
        if p.grad is not None:
            worst = max(worst, float((p.grad - expected[i]).abs().max()))
            scale = max(scale, float(expected[i].abs().max()))
            count += 1
    return worst, scale, count


def _ours(layers: list[nn.Module], m: int, inputs, targets, loss_fn):
    chunks = 2 * dist.get_world_size()
    per = len(layers) // chunks
    pipe = Pipeline(
        layers,
        schedule="dualpipe-v",
        microbatches=m,
        loss_fn=loss_fn,
        partition=[per * (i + 1) for i in range(chunks - 1)],
        timeout=300,
    )

    def step() -> None:
        pipe.step(inputs, targets)

    return step, pipe.zero_grad


def _theirs(layers: list[nn.Module], m: int, inputs, targets, loss_fn):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    rank, world = dist.get_rank(), dist.get_world_size()
    chunks, per = 2 * world, len(layers) // (2 * world)
    stages = [
        PipelineStage(_Chain(layers[i * per : (i + 1) * per]), i, chunks, torch.device("cpu"))
        for i in (rank, chunks - 1 - rank)
    ]
    schedule = ScheduleDualPipeV(stages, n_microbatches=m, loss_fn=loss_fn)
    ends = rank == 0  # the V's first and last chunk live on rank 0

    def step() -> None:
        if ends:
            schedule.step(inputs, target=targets)
        else:
            schedule.step()

    def zero() -> None:
        for stage in stages:
            stage.submod.zero_grad(set_to_none=True)

    return step, zero


def _rank(model: str, m: int, width: int, rows: int, rounds: int, steps: int) -> dict:
    init_distributed(backend="gloo", timeout=300)
    world = dist.get_world_size()
    inputs, targets = _batch(model, m * rows, width)
    loss_fn = _loss_fn(model)
    runners, differences = {}, {}
    for name, build in ((OURS, _ours), (THEIRS, _theirs)):
        layers = _layers(model, 4 * world, width)
        expected = _reference(layers, inputs, targets, m, loss_fn)
        step, zero = build(layers, m, inputs, targets, loss_fn)
        step()  # first step: the gradients, then warm-up
        differences[name] = _difference(layers, expected)
        zero()
        runners[name] = (step, zero)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, (step, zero) in runners.items():
            for _ in range(steps):
                dist.barrier()
                started = time.perf_counter()
                step()
                zero()
                dist.barrier()
                times[name].append(time.perf_counter() - started)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, differences)
    worst = {
        name: (
            max(d[name][0] for d in gathered),
            max(d[name][1] for d in gathered),
            sum(d[name][2] for d in gathered),
        )
        for name in runners
    }
    parameters = sum(1 for layer in _layers(model, 4 * world, width) for _ in layer.parameters())
    return {"times": times, "differences": worst, "parameters": parameters}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("mlp", "mixtral"), default="mlp")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--rows", type=int, default=16, help="rows per microbatch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="steps per configuration per round")
    args = parser.parse_args()
    for ranks in args.ranks:
        m = max(args.microbatches, 2 * ranks)  # both need 2·ranks microbatches to fill the V
        run = (args.model, m, args.width, args.rows, args.rounds, args.steps)
        result = launch(_rank, ranks, run, threads=1)[0]
        times, differences = result["times"], result["differences"]
        layers = (
            f"{4 * ranks} × (Linear {args.width} + Tanh)"
            if args.model == "mlp"
            else f"Mixtral (embedding, {4 * ranks - 2} MoE blocks of width {args.width}, head)"
        )
        unit = "rows" if args.model == "mlp" else f"sequences of {SEQUENCE} tokens"
        print(
            f"\n{ranks} gloo CPU ranks, {layers} in {2 * ranks} chunks, "
            f"{m} microbatches of {args.rows} {unit}, {args.rounds} rounds × {args.steps} steps\n"
        )
        print(
            "| configuration | median step (ms) | spread (ms) | × torch | max abs grad diff | relative |",
            end="",
        )
        print(" params |")
        print("|---|---|---|---|---|---|---|")
        reference = statistics.median(times[THEIRS])
        for name, values in times.items():
            value, (worst, scale, count) = statistics.median(values), differences[name]
            print(
                f"| {name} | {value * 1e3:.2f} | {min(values) * 1e3:.2f}–{max(values) * 1e3:.2f} | "
                f"{value / reference:.3f} | {worst:.2e} | {worst / scale:.2e} | "
                f"{count} of {result['parameters']} |"
            )


if __name__ == "__main__":
    main()
