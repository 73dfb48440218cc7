"""Every registered schedule, run by the Pipeline on 2 and 4 gloo ranks, gives the loss and the
gradients of a single-process backward of the same model and batch (float32, relative error ≤ 1e-5).

All cases of one world size run in one spawn (the machine has two cores); each parametrized test
reads its case from that shared result.
"""

from __future__ import annotations

import pytest
import torch
from _dist import RUNTIME_SCHEDULES, gradient_cases, rich_layers, run_ranks

from zerobubble.schedule import REGISTRY

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-5
MICROBATCHES = {2: (2, 5), 4: (4, 8)}
DUALPIPE_MICROBATCHES = {2: (4, 5), 4: (8, 9)}  # dualpipe-v needs 2·ranks
EXTRA_CASES = {  # (schedule, microbatches, chunks, partition) beyond the defaults
    2: [
        ("object:zb-h1", 4, None, None),
        ("zb-v", 4, None, None, False),
        ("1f1b", 4, None, (5,)),
        ("interleaved-1f1b", 4, 3, None),
        ("interleaved-1f1b", 2, 2, (1, 3, 6)),
    ],
    4: [],
}


def _cases(world: int) -> list[tuple]:
    cases = []
    for name in RUNTIME_SCHEDULES:
        counts = (DUALPIPE_MICROBATCHES if name == "dualpipe-v" else MICROBATCHES)[world]
        if world == 4 and name != "interleaved-1f1b":
            counts = counts[:1]
        cases += [(name, m, None, None) for m in counts if not (name == "interleaved-1f1b" and m % world)]
    return cases + EXTRA_CASES[world]


def _results(world: int) -> dict[tuple, list[dict]]:
    cases = _cases(world)
    per_rank = run_ranks(gradient_cases, world, cases)
    return {case: [rank_result[index] for rank_result in per_rank] for index, case in enumerate(cases)}


@pytest.fixture(scope="module")
def two_ranks() -> dict[tuple, list[dict]]:
    """Every rank's result of every 2-rank case (:func:`_cases`), by case."""
    return _results(2)


@pytest.fixture(scope="module")
def four_ranks() -> dict[tuple, list[dict]]:
    """Every rank's result of every 4-rank case (:func:`_cases`), by case."""
    return _results(4)


def _check_case(results: dict[tuple, list[dict]], case: tuple) -> None:
    ranks = results[case]
    expected_names = {name for name, _ in torch.nn.Sequential(*rich_layers(0)).named_parameters()}
    seen = [name for rank in ranks for name in rank["grads"]]
    assert sorted(seen) == sorted(expected_names), "every parameter lives on exactly one rank"
    losses = [rank["loss"] for rank in ranks if rank["loss"] is not None]
    assert len(losses) == 1 and losses[0] <= TOLERANCE
    worst = max(error for rank in ranks for error in rank["grads"].values())
    assert worst <= TOLERANCE, f"gradient relative error {worst:.2e}"
    assert max(rank["second_step"] for rank in ranks) <= TOLERANCE
    assert all(sorted(rank["state_keys"]) == sorted(rank["expected_state_keys"]) for rank in ranks)
    assert all(rank["loaded"] == 0.0 for rank in ranks), "load_state_dict of a whole-model checkpoint"
    for rank in ranks:
        assert rank["leftover"] == 0, "activations or deferred W work left after the step"
        assert rank["recorded"]["ops"] == rank["program_length"] and rank["recorded"]["negative"] == 0
    assert sum(rank["recorded"]["waits"] for rank in ranks) > 0


def _ids(case: tuple) -> str:
    name, m, chunks, partition, *static = case
    suffix = (
        (f"-v{chunks}" if chunks else "")
        + ("-partition" if partition else "")
        + ("-dynamic" if static else "")
    )
    return f"{name}-m{m}{suffix}"


def _planned(world: int) -> list[tuple]:
    """The cases a test is generated for: every registry name but zb-ilp, plus the extra cases."""
    counts = {
        name: (DUALPIPE_MICROBATCHES if name == "dualpipe-v" else MICROBATCHES)[world] for name in REGISTRY
    }
    return [(name, counts[name][0], None, None) for name in RUNTIME_SCHEDULES] + EXTRA_CASES[world]


@pytest.mark.parametrize("case", _planned(2), ids=_ids)
def test_two_ranks_match_single_process(case, two_ranks):
    _check_case(two_ranks, case)
    for other in two_ranks:
        if other[0] == case[0] and other[1] != case[1] and other[2:] == (None, None) and len(case) == 4:
            _check_case(two_ranks, other)


@pytest.mark.parametrize("case", _planned(4), ids=_ids)
def test_four_ranks_match_single_process(case, four_ranks):
    if case[0] == "interleaved-1f1b":
        case = (case[0], 4, None, None)
    _check_case(four_ranks, case)
