"""What a user asked of a Pipeline: one frozen record of its arguments, checked once.

:class:`PipelineRequest` holds the layers and every keyword option of :class:`~..pipeline.Pipeline`,
under the same names and with the same defaults; ``Pipeline(...)`` builds it first and keeps it as
``pipe.request``.  The construction reads the record instead of loose parameters: the planner
(:func:`~.construction.planned_resolution`, :mod:`.auto`), the resolution every rank agrees on
(:func:`~.construction.agreed_resolution`) and the building of this rank's part (:mod:`.build`).

Making the record runs the checks that are pure and need no peer: the vocabulary-parallel layers'
combinations, ``compile``, ``timeout`` and the ``partition`` word.  Every rank raises the same
:class:`PipelineError` before any collective.  The checks whose outcome the ranks exchange (the
schedule, the loss function, ``verify``, the sharding: :func:`~.resolve.agree_on`) stay in the
exchange, so that a rank with a wrong argument still joins it and its peers raise naming that rank
instead of waiting for it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...schedule.sharding import FSDPOptions
from .. import PipelineError
from ..execute.pairs import check_overlap
from ..launch import check_timeout
from ..parallel.fsdp import check_fsdp_options
from ..vocab.runner import check_vocab_request
from .compiled import compile_options

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from ...schedule import CostModel, Schedule
    from ..vocab.layers import VocabParallelEmbedding, VocabParallelHead
    from ..wgrad import FastPaths
    from .resolve import LossFn


@dataclass(frozen=True, kw_only=True)
class PipelineRequest:
    """Everything asked of one Pipeline: ``layers`` and the keyword options of ``Pipeline(...)``
    (their meanings: :class:`~..pipeline.Pipeline` and ``docs/guide.md``), checked when made
    (module docstring).  Frozen: the construction reads it, nothing changes it."""

    layers: nn.Sequential | Sequence[nn.Module]
    schedule: str | Schedule = "zb-v"
    microbatches: int | None = None
    loss_fn: LossFn | None = None
    chunks: int | None = None
    partition: Sequence[int] | str | None = None
    group: dist.ProcessGroup | None = None
    costs: CostModel | None = None
    timeout: float = 300.0
    static_shapes: bool = True
    trace: bool = False
    emulate: CostModel | None = None
    data_parallel: int | str | None = None
    mesh: DeviceMesh | None = None
    mesh_dims: Mapping[str, str] | None = None
    post_validation: bool = True
    seed: int | None = None
    fast_paths: FastPaths | None = None
    memory_limit: str | float | None = None
    example: Any = None
    calibrate: int = 3
    verify: bool | str = True
    check_calls: bool = True
    parallelize: Callable[[nn.Module, Any], nn.Module] | None = None
    compile: bool | Mapping[str, Any] = False
    head: VocabParallelHead | None = None
    embedding: VocabParallelEmbedding | None = None
    fsdp: FSDPOptions | None = None
    overlap: Callable[[Any], None] | str | None = None  # runs each overlapped F&B pair (execute/pairs.py)

    def __post_init__(self) -> None:
        # today's order of the checks, each with its message (tests/runtime/construct/test_request.py)
        check_vocab_request(
            self.head,
            self.embedding,
            loss_fn=self.loss_fn,
            data_parallel=self.data_parallel,
            mesh=self.mesh,
            schedule=self.schedule,
            parallelize=self.parallelize,
        )
        compile_options(self.compile)
        check_timeout(self.timeout)
        check_partition(self.schedule, self.partition)
        check_fsdp_options(self.fsdp, self.data_parallel)
        check_overlap(self.overlap)

    @property
    def vocab_parallel(self) -> bool:
        """Whether the loss is a vocabulary-parallel head's (``head=`` given)."""
        return self.head is not None

    @property
    def vocab_layers(self) -> tuple[VocabParallelHead | None, VocabParallelEmbedding | None]:
        """The vocabulary-parallel head and embedding asked for (either may be None)."""
        return self.head, self.embedding

    @property
    def parallelized(self) -> bool:
        """Whether each layer gets tensor parallelism (``parallelize=`` given)."""
        return self.parallelize is not None

    @property
    def wants_profile(self) -> bool:
        """Whether the planner resolves this request (``schedule="auto"`` or ``partition="profile"``)."""
        return self.schedule == "auto" or isinstance(self.partition, str)

    @property
    def cut_points(self) -> Sequence[int] | None:
        """The partition's cut points when given as a list; None for even chunks or a profile's."""
        return None if isinstance(self.partition, str) else self.partition


def check_partition(schedule: Any, partition: Any) -> None:
    """A partition word is ``"profile"`` with a schedule name other than ``"auto"``; anything else raises."""
    profiled = isinstance(partition, str)
    if profiled and (partition != "profile" or not isinstance(schedule, str) or schedule == "auto"):
        raise PipelineError(
            f'partition={partition!r}: pass a list of cut points, None (even), or "profile" with a '
            'schedule name (schedule="auto" always chooses its partition from the profile)'
        )
