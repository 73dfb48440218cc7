"""Model-level planning: which schedule, chunk count and partition to run a measured model with.

The planner of ``schedule="auto"`` and ``zerobubble plan`` (``docs/auto-planning.md``), one layer
above the builders: it plans *between* registry schedules from a per-layer profile, where the
builders' own planning core (:mod:`zerobubble.schedule.builders.planning`) plans the ops *inside*
one schedule.

* :mod:`.amounts` — byte budgets: :func:`parse_bytes`, :func:`format_bytes`;
* :mod:`.profile` — :class:`LayerProfile`, :class:`ModelProfile`, :func:`median_profile`,
  :func:`stage_costs`;
* :mod:`.layout` — :class:`Grid` (``MeshLayout``, its earlier name; :mod:`..grid`), :class:`Link`,
  :func:`parse_mesh`, :func:`mesh_layout`: a stage on ``dp × tp`` ranks; :data:`DATA_PARALLEL_MODES`;
* :mod:`.result` — :class:`PlanCandidate`, :class:`Plan`, :class:`Calibration`;
* :mod:`.search` — :func:`plan`, the search and the reason text;
* :mod:`.cluster` — :func:`~.cluster.plan_cluster`: a cluster planned on paper from a model's sizes
  (its kernel model :mod:`.kernels`, FSDP units :mod:`.sharding` and :mod:`.choices`; :mod:`.published`;
  its table and drawing :mod:`.cluster_text`);
  :mod:`.moe`: a mixture of experts' sizes, all-to-all and ep sizes, with ``dualpipe-v``;
* :mod:`.calibration` — :func:`calibrate`, :func:`calibrated_profile`, :func:`profile_from_trace`.

Each module imports only those listed before it.  Pure Python; no torch.
"""

from .amounts import format_bytes, parse_bytes
from .calibration import calibrate, calibrated_profile, profile_from_trace
from .layout import DATA_PARALLEL_MODES, Grid, Link, MeshLayout, mesh_layout, parse_mesh
from .profile import LayerProfile, ModelProfile, median_profile, stage_costs
from .result import Calibration, Plan, PlanCandidate
from .search import HEAD_LAYOUTS, plan

__all__ = [
    "DATA_PARALLEL_MODES",
    "HEAD_LAYOUTS",
    "Calibration",
    "Grid",
    "LayerProfile",
    "Link",
    "MeshLayout",
    "ModelProfile",
    "Plan",
    "PlanCandidate",
    "calibrate",
    "calibrated_profile",
    "format_bytes",
    "median_profile",
    "mesh_layout",
    "parse_bytes",
    "parse_mesh",
    "plan",
    "profile_from_trace",
    "stage_costs",
]
