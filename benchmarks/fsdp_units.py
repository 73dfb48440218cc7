"""Peak parameter memory per rank of FSDP2 units per chunk against per layer (``fsdp=FSDPOptions``).

Four gloo ranks, a stack of Linear–GELU–Linear blocks (float32), pp 2 × fsdp 2 and pp 1 × fsdp 4
(ZeRO-3, no pipeline).  Per layout, the most parameter bytes a rank's FSDP2 units held at once
during a training step (``parameter_peak``: shards, gathered parameters and pending all-gather
buffers, sampled after every all-gather starts or completes), the largest over the ranks and the
steps, printed beside what it should be: the shards plus one unit's full size (plus the ``prefetch``
units gathered ahead), or the shards plus the whole chunk for the default layout; and the median
time of ``step`` + ``optimizer_step`` (noisy on a shared CPU: a comparison, not a measurement).

    python benchmarks/fsdp_units.py [--blocks 8] [--width 256] [--steps 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from zerobubble import FSDPOptions, Pipeline
from zerobubble.runtime.launch import init_distributed, launch
from zerobubble.runtime.observe.memory import parameter_peak
from zerobubble_bench.workloads import gelu_block_bytes, gelu_blocks

LAYOUTS = {  # name: FSDPOptions (None: the default, one unit per chunk gathered once a step)
    "per chunk (default)": None,
    "per layer, prefetch 1": FSDPOptions(units="layer", prefetch=1),
    "per layer, prefetch 0": FSDPOptions(units="layer", prefetch=0),
    "2 layers, prefetch 1": FSDPOptions(units=2, prefetch=1),
}
MIB = 2**20


def measure(shape: tuple[int, int], count: int, width: int, steps: int) -> dict:
    """This rank's peak parameter bytes, shard bytes and step times per layout on a (dp, pp) mesh."""
    init_distributed(backend="gloo", timeout=120)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "pp"))
    rows = 16
    out = {}
    for name, options in LAYOUTS.items():
        pipe = Pipeline(
            gelu_blocks(count, width), schedule="zb-h1", microbatches=4, loss_fn=nn.functional.mse_loss,
            mesh=mesh, data_parallel="fsdp", fsdp=options, timeout=120,
        )  # fmt: skip
        optimizer = torch.optim.AdamW(list(pipe.parameters()), lr=1e-3)
        x = torch.randn(rows, width, generator=torch.Generator().manual_seed(1))
        peaks, shards, times = [], 0, []
        for _ in range(steps):
            start = time.perf_counter()
            with parameter_peak() as peak:
                pipe.step(x, x)
            pipe.optimizer_step(optimizer, max_norm=1.0)
            pipe.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
            peaks.append(peak.peak)
            shards = peak.shards
        pipe.synchronize()
        out[name] = {"peak": max(peaks), "shards": shards, "ms": 1e3 * statistics.median(times[1:] or times)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    unit = gelu_block_bytes(args.width)
    for shape in ((2, 2), (4, 1)):
        per_rank = launch(measure, 4, (shape, args.blocks, args.width, args.steps), threads=1, timeout=900)
        chunk_layers = args.blocks // shape[1]
        print(
            f"\npp {shape[1]} × fsdp {shape[0]}, zb-h1, {args.blocks} blocks of width {args.width}, float32: "
            f"one layer {unit / MIB:.2f} MiB, one chunk {chunk_layers * unit / MIB:.2f} MiB"
        )
        print(f"{'layout':24} {'peak (MiB)':>11} {'shards (MiB)':>13} {'expected (MiB)':>15} {'ms/step':>9}")
        for name, options in LAYOUTS.items():
            worst = max(per_rank, key=lambda r: r[name]["peak"])[name]
            if options is None:
                held, what = chunk_layers * unit, "shards + chunk"
            else:
                size = options.unit_size(chunk_layers) * unit
                held, what = size * (1 + options.prefetch), f"shards + {1 + options.prefetch} unit(s)"
            expected = worst["shards"] + held
            times = statistics.median(r[name]["ms"] for r in per_rank)
            print(
                f"{name:24} {worst['peak'] / MIB:11.2f} {worst['shards'] / MIB:13.2f} "
                f"{expected / MIB:9.2f} ({what}) {times:9.1f}"
            )


if __name__ == "__main__":
    main()
