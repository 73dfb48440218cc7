"""The builders' shared planning helpers: how the ops inside one schedule are planned.

The schedule families (one module each in :mod:`zerobubble.schedule.builders`) depend on these
helpers, never the reverse: no module here imports a family or the registry
(``tests/guards/test_layering.py``).

* :mod:`.core` — the planning core: :class:`PlanState` (programs under construction, timed as the
  simulator times them), :class:`BuilderCandidate` and :func:`search` over candidates, :func:`replay`
  and the one-microbatch fit check every memory-bound builder runs.  Its names are re-exported here.
* :mod:`.local_improve` — exact retiming of paced plans and the local improvement pass.
* :mod:`.ilp_program` — the sparse rows and the formulated program of zb-ilp's integer program.
* :mod:`.v_greedy`, :mod:`.v_rounds`, :mod:`.v_equalised` — the V-shape planners (time-ordered
  greedy, rounds, equalised) and :func:`~.v_greedy.v_candidates`, shared by zb-v and V-Half/V-Min.
* :mod:`.v_pattern`, :mod:`.v_blocks` — the V-Half / V-Min candidates: the authors' squeezed
  pattern and the modulo-scheduled building blocks.
"""

from .core import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    BuilderCandidate,
    Planned,
    PlanOp,
    PlanState,
    Stuck,
    as_plan_ops,
    check_one_microbatch_fits,
    fixed_candidate,
    one_microbatch_peak,
    replay,
    schedule_meta,
    search,
)

__all__ = [
    "BACKWARD",
    "FORWARD",
    "WEIGHT",
    "BuilderCandidate",
    "PlanOp",
    "PlanState",
    "Planned",
    "Stuck",
    "as_plan_ops",
    "check_one_microbatch_fits",
    "fixed_candidate",
    "one_microbatch_peak",
    "replay",
    "schedule_meta",
    "search",
]
