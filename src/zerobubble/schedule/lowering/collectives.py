"""How long the data-parallel collectives take: from the grid's links, or from a measured profile.

The α-β model of :class:`~..grid.Link` (``latency + bytes / bandwidth``) with the ring volumes:
an all-gather or a reduce-scatter over ``n`` ranks moves ``(n−1)/n`` of the full tensor across each
link, an all-reduce ``2(n−1)/n`` of it.  HSDP's reduction is the reduce-scatter within a row plus an
all-reduce of the shard across the rows.  A group whose ranks span more than one node runs at the
inter-node link's speed (a ring is as fast as its slowest hop).  A :class:`CommProfile` measured on
the machine overrides the model for the kinds it holds (``docs/communication.md``).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ...errors import ScheduleError
from ..grid import Grid, Link
from .actions import CommKind


@dataclass(frozen=True)
class CommProfile:
    """Measured seconds of collectives by size: ``points[kind]`` lists ``(bytes, seconds)`` pairs
    (``kind`` a :class:`~.actions.CommKind` value), read by linear interpolation (and extrapolation
    along the last two points)."""

    points: Mapping[str, Sequence[tuple[float, float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for kind, pairs in self.points.items():
            if kind not in {k.value for k in CommKind}:
                raise ScheduleError(
                    f"CommProfile: unknown kind {kind!r}; kinds are {[k.value for k in CommKind]}"
                )
            if not pairs:
                raise ScheduleError(f"CommProfile: no measurements for {kind!r}")
        object.__setattr__(
            self, "points", {kind: tuple(sorted(pairs)) for kind, pairs in self.points.items()}
        )

    def seconds(self, kind: CommKind, volume: float) -> float | None:
        """The measured time of ``kind`` at ``volume`` bytes (None when the profile lacks the kind)."""
        pairs = self.points.get(kind.value)
        if pairs is None:
            return None
        if volume <= 0:
            return 0.0
        if len(pairs) == 1:
            size, time = pairs[0]
            return time * volume / size if size > 0 else time
        sizes = [size for size, _ in pairs]
        i = min(max(bisect.bisect_left(sizes, volume), 1), len(pairs) - 1)
        (x0, y0), (x1, y1) = pairs[i - 1], pairs[i]
        slope = (y1 - y0) / (x1 - x0) if x1 > x0 else 0.0
        return max(0.0, y0 + slope * (volume - x0))


@dataclass(frozen=True)
class CollectiveCosts:
    """The data-parallel collectives of one pipeline rank: ``dp`` replicas, parameters cut over
    ``shard`` of them (1: replicated), ``rows = dp / shard`` (HSDP), timed on ``shard_link`` within a
    shard group and on ``dp_link`` across all replicas (or the rows), or by ``profile``."""

    dp: int = 1
    shard: int = 1
    dp_link: Link = field(default_factory=Link)
    shard_link: Link = field(default_factory=Link)
    profile: CommProfile | None = None

    @classmethod
    def from_grid(
        cls,
        grid: Grid,
        *,
        gpus_per_node: int | None = None,
        inter_node: Link | None = None,
        profile: CommProfile | None = None,
    ) -> CollectiveCosts:
        """The collectives of ``grid``: its ``dp_link`` within a node, ``inter_node`` for a group
        that spans nodes (``gpus_per_node`` GPUs per node, ranks laid out pp × dp × tp row-major, so
        a data-parallel group of ``n`` spans ``n · tp`` consecutive ranks)."""

        def link_for(members: int) -> Link:
            spans = gpus_per_node is not None and members * grid.tp > gpus_per_node
            return inter_node if spans and inter_node is not None else grid.dp_link

        return cls(grid.dp, grid.shard, link_for(grid.dp), link_for(grid.shard), profile)

    def time(self, kind: CommKind, volume: float) -> float:
        """Seconds of ``kind`` on ``volume`` bytes (the unit's or bucket's full size)."""
        if self.profile is not None:
            measured = self.profile.seconds(kind, volume)
            if measured is not None:
                return measured
        n, s = self.dp, self.shard
        if kind is CommKind.UNSHARD:
            return self.shard_link.time((s - 1) / s * volume) if s > 1 else 0.0
        if kind is CommKind.REDUCE_SCATTER:
            scatter = self.shard_link.time((s - 1) / s * volume) if s > 1 else 0.0
            return scatter + Grid.all_reduce(volume / s, n // s, self.dp_link)
        if kind is CommKind.ALL_REDUCE:
            return Grid.all_reduce(volume, n, self.dp_link)
        return 0.0
