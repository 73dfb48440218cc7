"""Optim: the optimizer step of a pipeline, post-validated, and undoing it.

:mod:`.post_validation` (the protocol: ``PostValidator``, ``PipelineOptimizer``, the chain; its
names are re-exported here, so ``zerobubble.runtime.optim.PostValidator`` is the public path),
:mod:`.grad_state` (the global gradient state, pure functions), :mod:`.rollback` (undoing one torch
optimizer step in place) and :mod:`.step` (a built Pipeline's reductions and chained step).
"""

from .post_validation import (
    OptimizerStats,
    PipelineOptimizer,
    PostValidator,
    StepOutcome,
    Verdict,
    chain_neighbours,
    check_max_norm,
    check_sharded_optimizer,
    clip_coefficient,
    combine_states,
    local_state,
    partial_decision,
    reduce_op,
    validation_chain,
    verdict_of,
)

__all__ = [
    "OptimizerStats",
    "PipelineOptimizer",
    "PostValidator",
    "StepOutcome",
    "Verdict",
    "chain_neighbours",
    "check_max_norm",
    "check_sharded_optimizer",
    "clip_coefficient",
    "combine_states",
    "local_state",
    "partial_decision",
    "reduce_op",
    "validation_chain",
    "verdict_of",
]
