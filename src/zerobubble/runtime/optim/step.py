"""A built Pipeline's gradients and optimizer step: reductions after the program, the chained step.

:class:`StepOptimization` owns what happens to the gradients once the executor's program has made
them — averaged over the replicas (:class:`~..parallel.data_parallel.GradientAverager`) or reduce-scattered
by FSDP2 (:class:`~..parallel.fsdp.ShardedStages`), tied parameters' summed over their holders — and the
optimizer step that follows (:class:`~.post_validation.PipelineOptimizer`: clipped, post-validated), settled
by a hook at the start of the next step, before anything reads a parameter.
:meth:`Pipeline.optimizer_step`, ``synchronize`` and ``optimizer_stats`` delegate to it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...schedule.ir import Kind, Op
from .. import PipelineError
from ..construct.resolve import Resolution
from ..execute.executor import Executor, Hook
from ..parallel.consistency import TiedParameter
from ..parallel.data_parallel import (
    GradientAverager,
    ParallelLayout,
    chunk_parameters,
    first_forward,
    last_gradient_ops,
)
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

    Construction installs the executor's hooks: the settle at the start of each step, then the
    reductions after each chunk's last gradient op.
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
        sharded: ShardedStages | None,
        executor: Executor,
    ):
        self.layout, self.rank = layout, layout.grid.pipeline_rank
        self._wait, self._tied, self._sharded = wait, list(tied), sharded
        self._placeholder: torch.optim.Optimizer | None = None
        chained = sharded is not None
        whole = executor.ends.whole_on_replicas()  # the vocabulary rows: not FSDP2 shards
        self._optimizer = chain_optimizer(
            resolution, layout, device, post_validation, wait, tied, sharded=chained, replicated=whole
        )
        program = resolution.schedule.programs[self.rank]
        # The pending step is settled before the next step reads any parameter: at its very start,
        # since the vocabulary embedding's lookups precede the first forward.  (Every rank's first
        # forward waits for its input anyway, so settling earlier costs nothing.)
        executor.add_start_hook(Hook("optimizer settle", self.settle))
        self._averager = None
        if sharded is not None:  # then all-gathered (FSDP2), reduce-scattered chunk by chunk
            install_sharded_reduction(executor, program, sharded)
        else:
            self._averager = install_averager(executor, program, layout, wait)

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
        replicas = [self.layout.grid.global_rank(self.rank, d) for d in range(self.layout.grid.dp)]
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
        """Run ``program`` (the executor's step, whose hooks start the reductions), then finish them:
        the replicas' average (or FSDP2's reshard) and the tied parameters' sums."""
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
        if self._sharded is not None:  # every chunk was reduced and resharded by its hook
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


def install_averager(
    executor: Executor, program: Sequence[Op], layout: ParallelLayout, wait: Callable[..., Any]
) -> GradientAverager | None:
    """With data parallelism, the averager of the replicas' gradients, each chunk's all-reduce
    started by a hook after its last gradient op; None with one replica."""
    if layout.grid.dp == 1:
        return None
    last_ops = last_gradient_ops(program)
    chunks = chunk_parameters(executor.stages, last_ops)
    averager = GradientAverager(chunks, layout.dp_group, layout.grid.dp, wait=wait)
    for stage, position in last_ops.items():  # a chunk's gradients are final after this op
        start = functools.partial(averager.start, stage)
        executor.add_hook(position, Hook(f"all-reduce start (stage {stage})", start), after=True)
    return averager


def install_sharded_reduction(executor: Executor, program: Sequence[Op], sharded: ShardedStages) -> None:
    """``data_parallel="fsdp"``: once a step, every chunk unsharded before the first forward (after
    the optimizer settle hook, added earlier) — or, with layered units, the units a W reads gathered
    around each W op — and reduce-scattered by FSDP2 after its last gradient op."""
    if not sharded.layered:
        executor.add_hook(first_forward(program), Hook("FSDP unshard", sharded.unshard))
    else:
        executor.add_start_hook(Hook("FSDP step start", sharded.begin_step))
    for position, op in enumerate(program):
        if op.kind is Kind.W and sharded.weight_readers(op.stage):
            gather = functools.partial(sharded.gather_for_w, op.stage)
            release = functools.partial(sharded.release_after_w, op.stage)
            executor.add_hook(position, Hook(f"FSDP unshard for W (stage {op.stage})", gather))
            executor.add_hook(position, Hook(f"FSDP reshard after W (stage {op.stage})", release), after=True)
    for stage, position in last_gradient_ops(program).items():
        reduce = functools.partial(sharded.reduce, stage)
        executor.add_hook(position, Hook(f"FSDP reduce-scatter (stage {stage})", reduce), after=True)
