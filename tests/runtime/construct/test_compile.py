"""Compiled layers in a Pipeline (``docs/wgrad.md``, "torch.compile"), on 2 gloo ranks, float64.

The user's ``layer.compile()``, ``torch.compile(layer)`` and ``Pipeline(compile=...)``, with
``fullgraph=True`` and without, under zb-h1, zb-v and 1f1b: the gradients of plain autograd, no
graph break and no recompile in steady state, the uncompiled model's parameter names, and every
compiled layer reported as what it is: under zb-h1 and zb-v its linears' weight gradients in W
("compiled: weight gradient in W", the layer "compiled: linear weights in W, other parameters in
B"), under 1f1b the compiled fused backward ("compiled: fused backward in B").  The aot_eager backend
(dynamo + AOTAutograd, what decides graph breaks and the backward node) keeps compile time small;
two cases run inductor.
"""

from __future__ import annotations

import pytest
from _compile_cases import compile_cases
from _dist import run_ranks

from zerobubble.runtime.wgrad.install import COMPILED_LINEAR_PATH, COMPILED_PATH, COMPILED_SPLIT_PATH

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-6  # relative, float64: the compiled graph computes what eager does
AOT = {"backend": "aot_eager"}
CASES = [
    ("inplace", "zb-h1", AOT),
    ("optimized", "zb-v", {**AOT, "fullgraph": True}),
    ("pipeline", "1f1b", {"fullgraph": True}),  # inductor
    ("pipeline", "zb-v", {}),  # compile=True: inductor, torch.compile's defaults
]


@pytest.fixture(scope="module")
def results() -> dict[tuple, list[dict]]:
    per_rank = run_ranks(compile_cases, 2, CASES)
    return {case: [rank[index] for rank in per_rank] for index, case in enumerate(map(_key, CASES))}


def _key(case: tuple) -> tuple:
    how, schedule, options = case
    return how, schedule, tuple(sorted(options.items()))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{'-'.join(map(str, c[2].values()))}")
def test_compiled_layers_are_exact_without_graph_breaks_or_recompiles(case, results):
    ranks = results[_key(case)]
    how = case[0]
    names = []
    for rank in ranks:
        assert max(rank["errors"].values()) < TOLERANCE, rank["errors"]
        assert max(rank["steady_errors"].values()) < TOLERANCE, rank["steady_errors"]
        assert rank["warm"]["breaks"] == 0 and rank["steady_breaks"] == 0
        assert rank["recompiled"] is None, rank["recompiled"]
        assert rank["steady_graphs"] == 0
        assert rank["loaded"] == 0.0
        assert rank["verified"]
        names += rank["names"]
        assert set(rank["state_keys"]) <= set(rank["expected_keys"])
        split = case[1] != "1f1b"  # a schedule with W ops splits the compiled layers' linears
        layer_path = COMPILED_SPLIT_PATH if split else COMPILED_PATH
        compiled = {m for m, path in rank["paths"].items() if path == layer_path}
        linears = {m for m, path in rank["paths"].items() if path == COMPILED_LINEAR_PATH}
        assert {m.rsplit(".", 1)[0] for m in linears} == (compiled if split else set())
        assert all(m.rsplit(".", 1)[1] in ("fc1", "fc2") for m in linears)
        # B writes only the norms' gradients of compiled layers (the compiled backward's); the
        # linears' wait for W (uncompiled layers: nothing in B)
        assert all(name.split(".")[1] == "norm" for name in rank["grads_touched_in_b"]), rank
        if split and rank["paths"]:
            assert any(name.split(".")[0] in compiled for name in rank["grads_touched_in_b"])
        if how == "inplace":  # only layers 1 and 2 compiled: 0 and 3 keep their fast paths
            assert compiled == {"1", "2"} & {m.split(".")[0] for m in rank["paths"]}
            assert any(path.startswith("fast path") for path in rank["paths"].values())
        else:
            assert compiled and set(rank["paths"].values()) <= {layer_path, COMPILED_LINEAR_PATH}
    # the names of the uncompiled model, every one on some rank, none with _orig_mod
    assert sorted(names) == sorted(ranks[0]["expected_keys"])


def test_the_layers_did_compile(results):
    """Dynamo captured graphs on every rank (later cases reuse the graphs of earlier ones)."""
    for rank in range(2):
        assert sum(case[rank]["warm"]["graphs"] for case in results.values()) >= 1
