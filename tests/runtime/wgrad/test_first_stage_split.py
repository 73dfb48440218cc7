"""Issue 25's silent wrong gradients, on every split schedule on 2 ranks: a first stage whose
parameter meets an input that needs no gradient (``tok(ids) + pos[:T]`` with a head tied to the
embedding, ``linear(x) + p``, ``linear(x) * g``, a ViT patch embedding).  Each trained once with
the split guard off (the split itself must be exact) and once with it on (no fall-back needed).
These failed before the split's fixes: gradients None or 24-64 % off."""

from __future__ import annotations

import pytest
from _dist import run_ranks
from _first_stage_models import split_schedule_cases

SPLIT_SCHEDULES = ["zb-h1", "zb-h2", "zb-1p", "zb-2p", "zb-v", "v-half", "v-min"]
MODELS = ["gpt", "shift", "scale", "vit"]
CASES = [(model, schedule, False) for schedule in SPLIT_SCHEDULES for model in MODELS]
CASES += [(model, "zb-v", True) for model in MODELS]


@pytest.fixture(scope="module")
def results():
    """Both ranks' results of every case, merged: each rank reports its own parameters."""
    per_rank = run_ranks(split_schedule_cases, 2, CASES, timeout=300)
    merged = []
    for index in range(len(CASES)):
        case = {"errors": {}, "warnings": [], "fallen": []}
        for rank in per_rank:
            case["errors"].update(rank[index]["errors"])
            case["warnings"] += rank[index]["warnings"]
            case["fallen"] += rank[index]["fallen"]
        merged.append(case)
    return merged


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "index", range(len(CASES)), ids=[f"{m}-{s}{'-verify' if v else ''}" for m, s, v in CASES]
)
def test_first_stage_parameters_get_exact_gradients(results, index):
    result = results[index]
    missing = [name for name, error in result["errors"].items() if error is None]
    assert not missing, f"no gradient for {missing}"
    wrong = {name: error for name, error in result["errors"].items() if error > 1e-5}
    assert not wrong, f"gradients off plain autograd's: {wrong}"
    assert result["warnings"] == [] and result["fallen"] == []
