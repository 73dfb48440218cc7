"""``ZeroRedundancyOptimizer`` over the data-parallel group as the Pipeline's optimizer.

4 gloo ranks: pipeline 2 × data_parallel 2, a float64 MLP, schedules zb-h1 and zb-v, with and
without post-validation.  Three steps, chosen so that every path of the validated step runs:

0. clipped, with ``max_norm`` between the chain head's own gradient norm and the total: the head
   steps optimistically, then rolls back and steps again clipped (the first step: the rollback
   deletes the state it created);
1. not clipped: the head's optimistic step is confirmed;
2. an Inf gradient on the chain's tail: the head's optimistic step is rolled back and dropped (the
   rollback's own broadcast restores the other replica's copy of its shard).

ZeRO over AdamW(amsgrad=True), which the rollback cannot invert, steps once the step is final.
After every case the parameters equal one process running ``clip_grad_norm_`` + AdamW on the whole
model and the whole batch, and the same Pipeline with plain AdamW; the replicas hold identical
parameters; ZeRO's optimizer state is about half of AdamW's on every rank.  A ZeRO over the wrong
group is refused; ``consolidate_state_dict`` gathers AdamW's own state dict, which loads back into
every replica's shard.  One spawn runs every case.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist import relative_error, run_ranks
from torch import nn

from zerobubble.runtime.launch import init_distributed
from zerobubble.runtime.optim.post_validation import validation_chain
from zerobubble.runtime.optim.rollback import OptimizerValidationError

WIDTH, LINEARS, MICROBATCHES, ROWS = 64, 8, 4, 16  # ROWS: the global batch
SCHEDULES = ["zb-h1", "zb-v"]
STEPS = 3
LR = 0.01
TOLERANCE = 1e-6


def mlp(seed: int) -> list[nn.Module]:
    """Linear–Tanh pairs (the last Linear bare), float64: 8 × 4160 parameters."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for index in range(LINEARS):
        layers.append(nn.Linear(WIDTH, WIDTH).double())
        if index + 1 < LINEARS:
            layers.append(nn.Tanh())
    return layers


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    inputs = torch.randn(ROWS, WIDTH, generator=generator, dtype=torch.float64)
    return inputs, torch.randn(ROWS, WIDTH, generator=generator, dtype=torch.float64)


def state_bytes(state) -> int:
    """Bytes of the tensors an optimizer's ``state`` holds."""
    return sum(v.numel() * v.element_size() for s in state.values() for v in s.values() if torch.is_tensor(v))


# -- inside the ranks ---------------------------------------------------------------------------------


def run_case(schedule: str, zero: bool, post_validation: bool, amsgrad: bool = False) -> dict:
    """Three steps (see the module docstring); this rank's parameters, state bytes and counters.

    ``amsgrad=True``: an optimizer the rollback cannot invert (every rank steps once it is final).
    """
    # imported in the ranks only: torch.distributed.optim scripts its functional optimizers on import
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from zerobubble import Pipeline

    pipe = Pipeline(
        mlp(seed=7),
        schedule=schedule,
        microbatches=MICROBATCHES,
        loss_fn=F.mse_loss,
        data_parallel=2,
        post_validation=post_validation,
        timeout=60,
    )
    layout = pipe.layout
    if zero:
        optimizer = ZeroRedundancyOptimizer(
            pipe.parameters(),
            optimizer_class=torch.optim.AdamW,
            process_group=layout.dp_group,
            lr=LR,
            amsgrad=amsgrad,
        )
    else:
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR, amsgrad=amsgrad)
    chain = validation_chain([ends[-1] if ends else 0.0 for ends in pipe.timeline.end])
    head, tail = chain[0], chain[-1]
    reference = nn.Sequential(*mlp(seed=7))
    their_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, amsgrad=amsgrad)
    rows = ROWS // 2
    shard = slice(rows * layout.grid.dp_index, rows * (layout.grid.dp_index + 1))
    for step in range(STEPS):
        inputs, targets = batch(step)
        pipe.step(inputs[shard], targets[shard])
        # every rank learns each pipeline rank's gradient norm (identical on the replicas)
        local = torch.stack([p.grad.norm() ** 2 for p in pipe.parameters()]).sum().reshape(1)
        norms = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(norms, local)
        squares = [float(norms[layout.grid.global_rank(r)]) for r in range(layout.grid.pp)]
        head_norm, total = math.sqrt(squares[head]), math.sqrt(sum(squares))
        max_norm = 2.0 * total if step == 1 else 0.5 * (head_norm + total)
        if step == 2 and pipe.rank == tail:
            next(iter(pipe.parameters())).grad.view(-1)[0] = math.inf
        pipe.optimizer_step(optimizer, max_norm=max_norm)
        pipe.zero_grad(set_to_none=True)

        reference.zero_grad(set_to_none=True)
        F.mse_loss(reference(inputs), targets).backward()
        if step != 2:  # the Inf gradient skips the step
            torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
            their_optimizer.step()
    pipe.synchronize()
    expected = dict(reference.named_parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in pipe.parameters()])
    other = torch.empty_like(flat)
    peer = layout.grid.global_rank(pipe.rank, 1 - layout.grid.dp_index)
    sent = dist.isend(flat, peer)  # the other replica's copy of this rank's chunks
    dist.recv(other, peer)
    sent.wait()
    state = optimizer.optim.state if zero else optimizer.state
    if zero:  # collective over the data-parallel group; the state lands on its group rank 0
        optimizer.consolidate_state_dict(to=0)
    full_state = optimizer.state_dict()["state"] if not zero or layout.grid.dp_index == 0 else None
    reloaded = None
    if zero:  # the consolidated dict loaded into a fresh ZeRO on every replica: the same shards
        box = [copy.deepcopy(optimizer.state_dict()) if layout.grid.dp_index == 0 else None]
        dist.broadcast_object_list(box, src=layout.grid.global_rank(pipe.rank, 0), group=layout.dp_group)
        fresh = ZeroRedundancyOptimizer(
            pipe.parameters(), optimizer_class=torch.optim.AdamW, process_group=layout.dp_group, lr=LR
        )
        fresh.load_state_dict(box[0])
        reloaded = max(
            float((fresh.optim.state[p][key].double() - value.double()).abs().max())
            for p, values in optimizer.optim.state.items()
            for key, value in values.items()
        )
    stats = pipe.optimizer_stats
    return {
        "params": {name: p.detach().clone() for name, p in pipe.named_parameters()},
        "reference_error": max(
            relative_error(p.detach(), expected[n].detach()) for n, p in pipe.named_parameters()
        ),
        "replica_difference": float((flat - other).abs().max()),
        "state_bytes": state_bytes(state),
        "full_state": full_state,
        "reloaded": reloaded,
        "numel": sum(p.numel() for p in pipe.parameters()),
        "head": pipe.rank == head,
        "counters": (stats.steps, stats.clipped, stats.skipped, stats.rolled_back),
        "deferred": stats.deferred,
    }


def wrong_group() -> str:
    """A ZeRO over the whole world (process_group=None) is refused on every rank, before any step."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from zerobubble import Pipeline

    pipe = Pipeline(mlp(seed=1), schedule="zb-h1", microbatches=2, loss_fn=F.mse_loss, data_parallel=2)
    optimizer = ZeroRedundancyOptimizer(pipe.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    inputs, targets = batch(0)
    pipe.step(inputs[:8], targets[:8])
    try:
        pipe.optimizer_step(optimizer, max_norm=1.0)
    except OptimizerValidationError as error:
        return str(error)
    return "no error"


def rank_worker() -> dict:
    init_distributed(backend="gloo", timeout=60)
    results: dict = {
        (schedule, zero, post_validation): run_case(schedule, zero, post_validation)
        for schedule in SCHEDULES
        for post_validation in (True, False)
        for zero in (True, False)
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results["amsgrad"] = run_case("zb-h1", zero=True, post_validation=True, amsgrad=True)
    results["amsgrad-warnings"] = [str(w.message) for w in caught]
    results["wrong-group"] = wrong_group()
    return results


# -- the tests ---------------------------------------------------------------------------------------

CASES = [(s, pv) for s in SCHEDULES for pv in (True, False)]
IDS = [f"{s}-{'post-validated' if pv else 'synchronous'}" for s, pv in CASES]


@pytest.fixture(scope="module")
def outcomes() -> list[dict]:
    return run_ranks(rank_worker, 4)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("schedule", "post_validation"), CASES, ids=IDS)
def test_zero_equals_one_process_and_plain_adamw(outcomes, schedule, post_validation):
    for rank, results in enumerate(outcomes):
        zero, plain = results[(schedule, True, post_validation)], results[(schedule, False, post_validation)]
        assert zero["reference_error"] <= TOLERANCE, (rank, zero["reference_error"])
        assert plain["reference_error"] <= TOLERANCE, (rank, plain["reference_error"])
        worst = max(relative_error(p, plain["params"][n]) for n, p in zero["params"].items())
        assert worst <= TOLERANCE, (rank, worst)
        assert zero["replica_difference"] == 0.0, "ZeRO's broadcasts keep the replicas identical"


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_consolidated_state_is_plain_adamws(outcomes, schedule):
    """``consolidate_state_dict`` (after the settled step) gives AdamW's own ``state_dict`` layout, and
    ``load_state_dict`` of it on every replica restores each one's shard exactly."""
    for results in outcomes[:2]:  # replica 0: the data-parallel group's rank 0
        zero, plain = (
            results[(schedule, True, True)]["full_state"],
            results[(schedule, False, True)]["full_state"],
        )
        assert sorted(zero) == sorted(plain) and zero
        for index, state in plain.items():
            assert sorted(zero[index]) == sorted(state)
            for key, value in state.items():
                assert relative_error(zero[index][key].double(), value.double()) <= TOLERANCE, (index, key)
    for results in outcomes:
        assert results[(schedule, True, True)]["reloaded"] == 0.0, "load_state_dict restores every shard"


@pytest.mark.multiprocess
@pytest.mark.parametrize(("schedule", "post_validation"), CASES, ids=IDS)
def test_every_path_of_the_validated_step_ran(outcomes, schedule, post_validation):
    for results in outcomes:
        for zero in (True, False):
            case = results[(schedule, zero, post_validation)]
            rolled_back = 2 if post_validation and case["head"] else 0
            assert case["counters"] == (STEPS, 1, 1, rolled_back), (zero, case["counters"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_zero_holds_about_half_the_optimizer_state(outcomes, schedule):
    for results in outcomes:
        zero, plain = results[(schedule, True, True)], results[(schedule, False, True)]
        assert zero["numel"] >= 16_000, "enough parameters per rank for the ratio to mean something"
        assert plain["state_bytes"] >= 2 * 8 * zero["numel"]  # exp_avg and exp_avg_sq, float64
        assert zero["state_bytes"] <= 0.6 * plain["state_bytes"], (zero["state_bytes"], plain["state_bytes"])


@pytest.mark.multiprocess
def test_zero_over_an_optimizer_without_rollback_steps_once_the_step_is_final(outcomes):
    for results in outcomes:
        case = results["amsgrad"]
        assert case["reference_error"] <= TOLERANCE and case["replica_difference"] == 0.0
        assert case["counters"] == (STEPS, 1, 1, 0)
        if not case["head"]:
            continue
        assert case["deferred"] == STEPS, "the head's prefix allowed every step: it waited instead"
        assert any("amsgrad" in message for message in results["amsgrad-warnings"])


@pytest.mark.multiprocess
def test_zero_over_another_group_is_refused(outcomes):
    for results in outcomes:
        message = results["wrong-group"]
        assert "shards over ranks [0, 1, 2, 3]" in message and "process_group=pipe.layout.dp_group" in message
