"""The process groups a Pipeline creates: locally synchronised, the same count on every rank.

``dist.new_group`` by default is collective over the *whole world*: every rank must call it for
every group, in the same order, even ranks outside the group.  A Pipeline built on one slice of a
larger mesh (``group=mesh["pp"].get_group()``, or ``mesh=`` with other dimensions) cannot meet that —
each slice makes its own groups — and the number of calls would grow with the world size.  So every
group here is created with ``use_local_synchronization=True``: only its members call, and creation
costs a rendezvous among them.

torch names such a group from its ranks *and the count of groups the calling rank belongs to*
(``_hash_ranks_to_str`` in ``distributed_c10d``): two members that belong to different numbers of
groups derive different names and wait for each other until the timeout.  Two rules keep the names
equal: (1) :func:`equalize_group_counts` runs once before a Pipeline creates anything — the ranks
exchange their counts over groups that already exist and a rank below the largest creates one-rank
groups (a local gloo context, no peer involved) until it reaches it; (2) afterwards every rank of
the Pipeline creates the same sequence of groups — the same number, in the same roles and order —
whether or not its groups hold the same ranks as another rank's.  Groups only some ranks would need
(the holders of one tied parameter, one channel per rank pair) are therefore not created: those
transfers go point to point over groups every rank has (:mod:`..execute.comm`, :mod:`.consistency`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .. import PipelineError

logger = logging.getLogger(__name__)


def local_group(ranks: Sequence[int], *, timeout: timedelta, backend: str | None = None) -> Any:
    """A process group of global ``ranks``, created by its members only (this rank must be one)."""
    members = sorted(int(rank) for rank in ranks)
    if dist.get_rank() not in members:
        raise PipelineError(f"rank {dist.get_rank()} is not one of the group's ranks {members}")
    return dist.new_group(members, timeout=timeout, backend=backend, use_local_synchronization=True)


def group_count() -> int:
    """How many process groups this rank belongs to: what torch folds into a local group's name."""
    names = getattr(dist.distributed_c10d, "_world", None)
    return len(names.pg_names) if names is not None else 0


def equalize_group_counts(groups: Sequence[Any], *, timeout: timedelta) -> int:
    """Bring every rank reached through ``groups`` to the same :func:`group_count` (collective over each).

    ``groups`` must connect the ranks (the dimensions of a mesh, or one group spanning them all): the
    largest count travels along each in turn, so after the last every rank knows the overall
    largest.  Returns how many one-rank groups this rank created to reach it.
    """
    largest = group_count()
    for group in groups:
        counts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(counts, largest, group=group)
        largest = max(int(count) for count in counts)
    padding = largest - group_count()
    me = dist.get_rank()
    for _ in range(padding):
        dist.new_group([me], timeout=timeout, backend="gloo", use_local_synchronization=True)
    if padding:
        logger.debug("rank %d: %d one-rank groups created to match its peers' group count", me, padding)
    return padding
