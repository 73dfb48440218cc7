"""What a wait through ``PeerMonitor`` costs against a bare ``work.wait()``: gloo round trips, 2 ranks.

    python benchmarks/wait_latency.py [--blocks 30] [--trips 150]

Rank 0 sends 256 floats to rank 1 and receives them back; each wait is either a bare
``work.wait()`` (no failure detection: a dead or failed peer would hang it until gloo's timeout) or
:meth:`PeerMonitor.wait` (the runtime's wait, which notices a peer's error notice and the
deadline).  Blocks of ``--trips`` round trips alternate between the two; the median µs per round
trip of each and their ratio are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

TENSOR_FLOATS = 256


def round_trips(blocks: int, trips: int) -> dict[str, list[float]] | None:
    """One rank's side of the alternating blocks; rank 0 returns µs per round trip of each block."""
    import torch
    import torch.distributed as dist

    from zerobubble.runtime.failures import PeerMonitor
    from zerobubble.runtime.launch import init_distributed

    init_distributed()
    rank = dist.get_rank()
    monitor = PeerMonitor("wait-latency", rank, timeout=60.0)
    waits = {"bare wait()": lambda work, what: work.wait(), "PeerMonitor.wait": monitor.wait}
    peer = 1 - rank
    tensor = torch.zeros(TENSOR_FLOATS)
    times: dict[str, list[float]] = {name: [] for name in waits}
    for _ in range(blocks):
        for name, wait in waits.items():
            start = time.perf_counter()
            for _ in range(trips):
                if rank == 0:
                    wait(dist.isend(tensor, peer), "send")
                    wait(dist.irecv(tensor, peer), "receive")
                else:
                    wait(dist.irecv(tensor, peer), "receive")
                    wait(dist.isend(tensor, peer), "send")
            times[name].append((time.perf_counter() - start) / trips * 1e6)
    dist.barrier()
    return times if rank == 0 else None


def main() -> None:
    from zerobubble.runtime.launch import launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--trips", type=int, default=150)
    args = parser.parse_args()
    times = launch(round_trips, 2, (args.blocks, args.trips), threads=1, timeout=600)[0]
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, values in times.items():
        spread = f"blocks {min(values):.0f}–{max(values):.0f}"
        print(f"{name:17s} {medians[name]:8.1f} µs per round trip ({spread})")
    print(f"PeerMonitor.wait / bare wait(): {medians['PeerMonitor.wait'] / medians['bare wait()']:.3f}")


if __name__ == "__main__":
    main()
