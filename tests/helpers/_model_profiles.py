"""Model profiles the planner's tests share (tests/schedule/modelplan/, tests/cli/)."""

from __future__ import annotations

from zerobubble.schedule.modelplan import LayerProfile, ModelProfile

MiB = 2**20


def lm_profile() -> ModelProfile:
    """An uneven LM: light embedding, six blocks, a head costing five blocks; bytes in MiB."""
    embed = LayerProfile("embed", 1e-3, 2e-3, 0.0, 1 * MiB, 0, 24 * MiB, 8 * MiB, 16 * MiB, 0.1 * MiB)
    blocks = [
        LayerProfile(f"block{i}", 3e-3, 3e-3, 3e-3, 4 * MiB, 2 * MiB, 4 * MiB, 1 * MiB, 2 * MiB, 0.1 * MiB)
        for i in range(6)
    ]
    head = LayerProfile("head", 1.5e-2, 1.5e-2, 1.5e-2, 8 * MiB, 4 * MiB, 16 * MiB, 4 * MiB, 8 * MiB, 0.0)
    return ModelProfile((embed, *blocks, head), comm_latency=1e-4, comm_bandwidth=1e9)
