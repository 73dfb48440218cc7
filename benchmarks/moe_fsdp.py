"""What FSDP2 beside expert parallelism saves per rank, and what it costs a step.

    python benchmarks/moe_fsdp.py [--blocks 6] [--width 128] [--steps 5]

Four gloo ranks on a (pp 2, ep 2) mesh, a tiny random transformers Mixtral (8 experts, top 2, float32,
``benchmarks/dualpipe_runtime.py``'s, with ``--blocks`` decoder blocks), zb-v, 4 microbatches of 8
sequences per ep rank.  Per layout — replicated, FSDP2 one unit per chunk, FSDP2 per layer — the
largest rank's bytes held between steps (its local parameters, gradients and AdamW state: FSDP2's
shards and this rank's experts) split into experts and the rest, the peak bytes FSDP2's units held
during a step (``parameter_peak``; 0 when replicated), and the median ``step`` + ``optimizer_step`` in
milliseconds (a shared 2-core CPU: a comparison, not a measurement).  The experts are ep's shards in
every layout, so only the rest shrinks, by the replica count at most.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from zerobubble import FSDPOptions, Pipeline
from zerobubble.runtime.launch import init_distributed, launch
from zerobubble.runtime.observe.memory import parameter_peak

sys.path.insert(0, str(Path(__file__).parent))
import dualpipe_runtime  # the same tiny Mixtral

LAYOUTS = {  # name: (data_parallel, fsdp=)
    "replicated": ("replicate", None),
    "FSDP2, a unit per chunk": ("fsdp", None),
    "FSDP2, a unit per layer": ("fsdp", FSDPOptions(units="layer", prefetch=1)),
}
MIB = 2**20


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _held(pipe: Pipeline, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's parameter, gradient and optimizer-state bytes, experts and the rest."""
    held = {"experts": 0, "rest": 0}
    for name, param in pipe.named_parameters():
        state = optimizer.state.get(param, {})
        tensors = [param, *(t for t in (param.grad, *state.values()) if isinstance(t, torch.Tensor))]
        kind = "experts" if ".experts." in name else "rest"  # mlp.experts.gate_up_proj, .down_proj
        held[kind] += sum(_local_bytes(t) for t in tensors if t.dim() > 0)
    return held


def measure(blocks: int, width: int, steps: int) -> dict:
    """This rank's held bytes, FSDP2 peak and step times per layout."""
    init_distributed(backend="gloo", timeout=300)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    tokens, targets = dualpipe_runtime._batch("mixtral", 32, width)
    rows = slice(mesh.get_local_rank("ep") * 16, (mesh.get_local_rank("ep") + 1) * 16)
    out = {}
    for name, (data_parallel, options) in LAYOUTS.items():
        layers = dualpipe_runtime._layers("mixtral", blocks + 2, width, experts=8)
        pipe = Pipeline(
            layers, schedule="zb-v", microbatches=4, loss_fn=dualpipe_runtime._loss_fn("mixtral"),
            mesh=mesh, data_parallel=data_parallel, fsdp=options, timeout=300,
        )  # fmt: skip
        optimizer = torch.optim.AdamW(list(pipe.parameters()), lr=1e-3)
        peaks, times = [], []
        for _ in range(steps):
            start = time.perf_counter()
            with parameter_peak() as peak:
                pipe.step(tokens[rows], targets[rows])
            pipe.optimizer_step(optimizer, max_norm=1.0)
            times.append(time.perf_counter() - start)
            peaks.append(peak.peak)
        pipe.synchronize()
        out[name] = {**_held(pipe, optimizer), "peak": max(peaks), "ms": 1e3 * statistics.median(times[1:])}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    per_rank = launch(measure, 4, (args.blocks, args.width, args.steps), threads=1, timeout=900)
    print(
        f"(pp 2, ep 2), zb-v, tiny Mixtral: {args.blocks} blocks of width {args.width}, 8 experts, float32; "
        "the busiest rank's bytes between steps (parameters, gradients, AdamW state)"
    )
    print(f"{'layout':26} {'experts MiB':>12} {'rest MiB':>9} {'FSDP2 peak MiB':>15} {'ms/step':>8}")
    for name in LAYOUTS:
        worst = max(per_rank, key=lambda r: r[name]["experts"] + r[name]["rest"])[name]
        ms = statistics.median(r[name]["ms"] for r in per_rank)
        print(
            f"{name:26} {worst['experts'] / MIB:12.2f} {worst['rest'] / MIB:9.2f} "
            f"{worst['peak'] / MIB:15.2f} {ms:8.1f}"
        )


if __name__ == "__main__":
    main()
