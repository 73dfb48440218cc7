"""A built Pipeline's gradients and optimizer step: reductions after the program, the chained step.

:class:`StepOptimization` owns what happens to the gradients once the executor's program has made
them — averaged over the replicas (:class:`~..parallel.data_parallel.GradientAverager`) or reduce-scattered
by FSDP2 (:class:`~..parallel.fsdp.ShardedStages`), tied parameters' summed over their holders — and the
optimizer step that follows (:class:`~.post_validation.PipelineOptimizer`: clipped, post-validated), settled
by a start entry of the next step, before anything reads a parameter.  The reductions are actions of
the lowered program the executor runs (``docs/communication.md``, "What the executor runs").
:meth:`Pipeline.optimizer_step`, ``synchronize`` and ``optimizer_stats`` delegate to it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...schedule.lowering import LoweredSchedule
from .. import PipelineError
from ..construct.resolve import Resolution
from ..execute.executor import Executor, Hook
from ..parallel.consistency import TiedParameter
from ..parallel.data_parallel import (
    GradientAverager,
    ParallelLayout,
    bucket_parameters,
    last_gradient_ops,
)
from ..parallel.experts import expert_parameters
from ..parallel.fsdp import ShardedStages
from .post_validation import (
    OptimizerStats,
    PipelineOptimizer,
    check_sharded_optimizer,
    unscale_gradients,
    validation_chain,
)

logger = logging.getLogger(__name__)


class StepOptimization:
    """The reductions and the optimizer step of ``layout``'s pipeline rank (see the module docstring).

    Construction adds the settle as a start entry of each step and binds the executor's lowered
    communication actions (:meth:`~..execute.executor.Executor.communicate`) to ``reductions``: the
    replicas' bucket all-reduces (:class:`GradientAverager`, :func:`gradient_averager`) or FSDP2's
    unshards and reduce-scatters (:class:`ShardedStages`).
    """

    def __init__(
        self,
        *,
        resolution: Any,
        layout: ParallelLayout,
        device: torch.device,
        post_validation: bool,
        wait: Callable[..., Any],
        tied: Sequence[Any],
        reductions: ShardedStages | GradientAverager | None,
        executor: Executor,
    ):
        self.layout, self.rank = layout, layout.grid.pipeline_rank
        sharded = reductions if isinstance(reductions, ShardedStages) else None
        self._wait, self._tied, self._sharded = wait, list(tied), sharded
        self._placeholder: torch.optim.Optimizer | None = None
        chained = sharded is not None
        whole = executor.ends.whole_on_replicas()  # the vocabulary rows: not FSDP2 shards
        if chained and layout.grid.ep > 1 and layout.grid.dp_index >= layout.grid.ep:
            # the expert shards are equal along "dp": the first row's count, the others' do not
            whole = [*whole, *expert_parameters(stage.module for stage in executor.stages.values())]
        self._optimizer = chain_optimizer(
            resolution, layout, device, post_validation, wait, tied, sharded=chained, replicated=whole
        )
        # The pending step is settled before the next step reads any parameter: at its very start,
        # since the vocabulary embedding's lookups precede the first forward.  (Every rank's first
        # forward waits for its input anyway, so settling earlier costs nothing.)
        executor.add_start_hook(Hook("optimizer settle", self.settle))
        self._averager = reductions if isinstance(reductions, GradientAverager) else None
        if sharded is not None and sharded.layered:
            executor.add_start_hook(Hook("FSDP step start", sharded.begin_step))
        if reductions is not None:  # the lowered program's all-reduces, or unshards and reduce-scatters
            executor.communicate(reductions)

    @property
    def stats(self) -> OptimizerStats:
        """Counters of this rank's settled optimizer steps."""
        return self._optimizer.stats

    def prepare(
        self, optimizer: torch.optim.Optimizer | None, parameters: Sequence[Any], unscale: float | None
    ) -> torch.optim.Optimizer:
        """The optimizer to step — ``optimizer``, or a stand-in on a rank without ``parameters`` (it
        still joins the norm reduction) — with the gradients divided by ``unscale`` when given.
        Raises before anything is sent when the optimizer cannot be used."""
        if optimizer is None:
            if parameters:
                raise PipelineError(
                    f"rank {self.rank} holds parameters: pass an optimizer over pipe.parameters()"
                )
            if self._placeholder is None:
                self._placeholder = torch.optim.SGD([torch.zeros(0, requires_grad=True)], lr=0.0)
            optimizer = self._placeholder
        replicas = [self.layout.grid.global_rank(self.rank, d) for d in range(self.layout.grid.replicas)]
        check_sharded_optimizer(optimizer, replicas)
        if unscale is not None:
            unscale_gradients(parameters, float(unscale))
        return optimizer

    def step(self, optimizer: torch.optim.Optimizer, max_norm: float | None) -> None:
        """The chained, clipped, post-validated step (communicates)."""
        self._optimizer.step(optimizer, max_norm)

    def close(self) -> None:
        """Settle a pending step now (collective over the pipeline)."""
        self._optimizer.close()

    def settle(self) -> None:
        """Settle the pending optimizer step (confirm it or roll it back); log a rollback."""
        if not logger.isEnabledFor(logging.INFO):
            self._optimizer.finish()
            return
        rolled_back = self._optimizer.stats.rolled_back
        self._optimizer.finish()
        if self._optimizer.stats.rolled_back > rolled_back:
            logger.info("rank %d: the optimistic optimizer step was rolled back", self.rank)

    def run(self, program: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        """Run ``program`` (the executor's step, whose lowered actions reduce the gradients), then
        finish: what is still unsharded resharded (FSDP2) and the tied parameters' sums."""
        try:
            losses = program()
        except BaseException:
            if self._averager is not None:
                self._averager.discard()
            if self._sharded is not None:
                self._sharded.discard()
            raise
        if self._averager is not None:
            self._averager.finish()
        if self._sharded is not None:  # every chunk was reduced and resharded by its action
            self._sharded.reshard()
        for tie in self._tied:
            tie.sum_gradients(self._wait)
        return losses


def chain_optimizer(
    resolution: Resolution,
    layout: ParallelLayout,
    device: torch.device,
    post_validation: bool,
    wait: Callable[..., Any],
    tied: Sequence[TiedParameter],
    sharded: bool = False,
    replicated: Sequence[torch.Tensor] = (),
) -> PipelineOptimizer:
    """The optimizer step of ``layout``'s pipeline rank: the ranks chained in the order the resolved
    timeline finishes them (:func:`~.post_validation.validation_chain`).  ``replicated``: parameters
    whole on every replica (the vocabulary-parallel rows), whose norm the first replica alone counts
    when the norm state is summed over the shards' holders (``sharded``)."""
    rank = layout.grid.pipeline_rank
    finish_times = [ends[-1] if ends else 0.0 for ends in resolution.timeline.end]
    chain = [layout.grid.global_rank(r) for r in validation_chain(finish_times)]
    return PipelineOptimizer(
        chain,
        layout.grid.global_rank(rank),
        layout.control_group,
        post_validation,
        device,
        wait=wait,
        # a tied parameter's summed gradient is counted once, by the holder of its first layer
        norm_excludes=[t.param for t in tied if t.source != layout.grid.global_rank(rank)]
        + (list(replicated) if sharded and layout.grid.dp_index != 0 else []),
        # sharded gradients: each rank's norm state covers its shards, summed over their holders first
        shard_group=layout.shard_group if sharded else None,
    )


def averager_of(
    executor: Executor, lowered: LoweredSchedule, layout: ParallelLayout, monitor: Any
) -> GradientAverager | None:
    """The averager of the replicas' gradients of this rank's chunks, in the buckets of ``lowered``
    (:func:`~..parallel.data_parallel.bucket_parameters`), to bind the lowered program's all-reduce
    actions, waited through ``monitor`` (the peer monitor); None unless the replicas are several and
    not sharded.  The experts of expert parallelism are reduced over the ranks holding them only."""
    if layout.grid.replicas == 1 or lowered.data_parallel != "replicate":
        return None
    program = lowered.source.programs[layout.grid.pipeline_rank]
    buckets = bucket_parameters(executor.stages, last_gradient_ops(program), lowered.part_layers)
    experts = expert_parameters(stage.module for stage in executor.stages.values())
    return GradientAverager(
        buckets, layout.dp_group, layout.grid.replicas, wait=monitor.wait,
        experts=experts, expert_group=layout.expert_group,
    )  # fmt: skip
