"""dualpipe-v's overlapped F&B pairs run one half after the other, or ``overlap="threads"``, on a
tiny Mixtral over a (pp 2, ep 2) mesh of four gloo CPU ranks.

    python benchmarks/pair_overlap.py [--hidden 128] [--seq 64] [--rows 2] [--microbatches 4]
                                      [--latency 0 5] [--rounds 5] [--steps 3]

Both pipelines hold copies of one model and train on the same batch (each ep rank its half); they
run in rotating rounds (a barrier before and after each step; backward and ``zero_grad`` included,
no optimizer).  ``--latency`` adds a sleep (ms, the GIL released like a network wait) to every
experts call and to its backward, standing in for a slow all-to-all link.  Prints the median step,
the spread, the ratio of the medians, the overlapped pairs a rank runs per step and what the
threads save per pair, and the largest difference of the gradients of one step between the two
(relative to the largest gradient): the threads are exact, so it is 0.
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
from zerobubble.hf import pipeline_layers
from zerobubble.runtime.launch import init_distributed, launch

MODES = ("sequential", "threads")


def _model(hidden: int, blocks: int) -> nn.Module:
    from transformers import AutoModelForCausalLM, MixtralConfig

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=blocks,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=1024, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()


class _Latency(torch.autograd.Function):
    """The identity, sleeping ``seconds`` in its forward and in its backward."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, seconds: float) -> torch.Tensor:  # type: ignore[override]
        ctx.seconds = seconds
        time.sleep(seconds)
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        time.sleep(ctx.seconds)
        return grad, None


def _add_latency(module: nn.Module, seconds: float) -> None:
    if seconds <= 0:
        return
    for child in module.modules():
        if type(child).__name__ == "ExpertParallelExperts":
            child.register_forward_hook(lambda _m, _args, out: _Latency.apply(out, seconds))


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _rank(args: argparse.Namespace, seconds: float) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    init_distributed(backend="gloo", timeout=300)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    model = _model(args.hidden, 4)
    generator = torch.Generator().manual_seed(1)
    rows = args.rows * args.microbatches  # per ep rank
    tokens = torch.randint(0, 256, (2 * rows, args.seq), generator=generator)
    targets = torch.randint(0, 256, (2 * rows, args.seq), generator=generator)
    pipes = {}
    for mode in MODES:
        pipe = Pipeline(
            pipeline_layers(copy.deepcopy(model)), schedule="dualpipe-v", microbatches=args.microbatches,
            loss_fn=_loss, mesh=mesh, timeout=300, overlap="threads" if mode == "threads" else None,
        )  # fmt: skip
        _add_latency(pipe.module, seconds)
        share = slice(pipe.layout.dp_index * rows, (pipe.layout.dp_index + 1) * rows)
        pipes[mode] = (pipe, tokens[share], targets[share])
    grads = {}
    for mode, (pipe, x, y) in pipes.items():
        pipe.step(x, y)  # warm-up, and the gradients of one step
        grads[mode] = [p.grad.detach().clone() for p in pipe.parameters() if p.grad is not None]
        pipe.zero_grad()
    worst = max(float((a - b).abs().max()) for a, b in zip(grads["threads"], grads["sequential"]))
    scale = max(float(g.abs().max()) for g in grads["sequential"])
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode, (pipe, x, y) in pipes.items():
            for _ in range(args.steps):
                dist.barrier()
                started = time.perf_counter()
                pipe.step(x, y)
                pipe.zero_grad()
                dist.barrier()
                times[mode].append(time.perf_counter() - started)
    pairs = sum(1 for f, _ in pipes["sequential"][0].schedule.overlapped if f in _mine(pipes))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (worst / scale if scale else 0.0, pairs))
    return {"times": times, "relative": max(g[0] for g in gathered), "pairs": max(g[1] for g in gathered)}


def _mine(pipes: dict) -> set:
    pipe = pipes["sequential"][0]
    return set(pipe.schedule.programs[pipe.rank])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64, help="tokens per row")
    parser.add_argument("--rows", type=int, default=2, help="rows per microbatch")
    parser.add_argument("--microbatches", type=int, default=4, help="per ep rank (dualpipe-v: ≥ 4)")
    parser.add_argument("--latency", type=float, nargs="+", default=[0.0, 5.0], help="ms per experts call")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per mode per round")
    args = parser.parse_args()
    print(
        f"4 gloo CPU ranks (pp 2 × ep 2), Mixtral hidden {args.hidden}, 4 blocks, 4 experts top-2; "
        f"{args.microbatches} microbatches of {args.rows} × {args.seq} tokens per ep rank; "
        f"{args.rounds} rounds × {args.steps} steps\n"
    )
    print("| latency (ms) | mode | median step (ms) | spread (ms) | × sequential | pairs/rank ", end="")
    print("| saved/pair (ms) |")
    print("|---|---|---|---|---|---|---|")
    for latency in args.latency:
        result = launch(_rank, 4, (args, latency / 1e3), threads=1)[0]
        times, pairs = result["times"], result["pairs"]
        base = statistics.median(times["sequential"])
        for mode in MODES:
            value = statistics.median(times[mode])
            saved = (base - value) / pairs * 1e3 if pairs else 0.0
            print(
                f"| {latency:g} | {mode} | {value * 1e3:.1f} | {min(times[mode]) * 1e3:.1f}–"
                f"{max(times[mode]) * 1e3:.1f} | {value / base:.3f} | {pairs} | {saved:.2f} |"
            )
        relative = result["relative"]
        print(f"  (latency {latency:g}: threads' gradients vs sequential, relative: {relative:.1e})")


if __name__ == "__main__":
    main()
