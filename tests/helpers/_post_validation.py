"""The post-validation harness shared by tests/runtime/optim/test_post_validation.py and
test_pipeline_optim.py: a small sliced model, its scenarios, the synchronous reference and the rank worker.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from zerobubble.runtime.launch import init_distributed
from zerobubble.runtime.optim import PostValidator

STEPS = 30
MAX_NORM = 1.0
TOLERANCE = 1e-6
# What happens to the gradients at step k: SCENARIOS[k % len(SCENARIOS)].
#   calm: total norm 0.3 * MAX_NORM;  head/tail: the first/last rank of the chain has a slice
#   of norm 3 * MAX_NORM (clipping; decided at once by everyone / only learned at the tail);
#   nan-head / inf-tail: a non-finite gradient on the first / last rank of the chain.
SCENARIOS = ["calm", "tail", "calm", "head", "nan-head", "calm", "inf-tail", "tail", "calm", "head"]
OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.05),
    "rmsprop-fallback": lambda ps: torch.optim.RMSprop(ps, lr=0.01),
}
COLLECTIVES = [
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "gather",
    "scatter",
    "all_gather_object",
    "broadcast_object_list",
    "all_reduce_coalesced",
]
POINT_TO_POINT = ["isend", "irecv", "send", "recv", "batch_isend_irecv"]


# -- helpers run inside the ranks -------------------------------------------------------------------


def small_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)
    )


def slice_bounds(count: int, world: int, rank: int) -> tuple[int, int]:
    """The contiguous share [begin, end) of ``count`` parameter tensors that ``rank`` holds."""
    return rank * count // world, (rank + 1) * count // world


def scenario_grads(model: nn.Sequential, step: int, chain: list[int]) -> list[torch.Tensor]:
    """The whole model's gradients at ``step``, shaped by the step's scenario (same on every rank)."""
    generator = torch.Generator().manual_seed(step)
    inputs, targets = torch.randn(16, 6, generator=generator), torch.randn(16, 3, generator=generator)
    model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(inputs), targets).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    world, scenario = len(chain), SCENARIOS[step % len(SCENARIOS)]
    for rank in range(world):
        begin, end = slice_bounds(len(grads), world, rank)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads[begin:end]]))
        big = (scenario == "head" and rank == chain[0]) or (scenario == "tail" and rank == chain[-1])
        target = 3.0 * MAX_NORM if big else 0.3 * MAX_NORM / math.sqrt(world)
        for grad in grads[begin:end]:
            grad.mul_(target / norm)
    poisoned = {"nan-head": (chain[0], math.nan), "inf-tail": (chain[-1], math.inf)}.get(scenario)
    if poisoned is not None:
        grads[slice_bounds(len(grads), world, poisoned[0])[0]].view(-1)[1] = poisoned[1]
    return grads


def learning_rate(base: float, step: int) -> float:
    return base * (1.0 - step / (2 * STEPS))


def worst_error(mine: list[nn.Parameter], my_optimizer, theirs: list[nn.Parameter], their_optimizer) -> float:
    """Largest max-norm relative error over parameters and optimizer state; step counters must match."""
    worst = 0.0
    for param, expected in zip(mine, theirs):
        pairs = [(param.detach(), expected.detach())]
        state, expected_state = my_optimizer.state.get(param, {}), their_optimizer.state.get(expected, {})
        if sorted(state) != sorted(expected_state):
            return math.inf
        for key, value in expected_state.items():
            if key == "step":
                if float(state[key]) != float(value):
                    return math.inf
            elif isinstance(value, torch.Tensor):
                pairs.append((state[key], value))
        for actual, wanted in pairs:
            scale = wanted.abs().max().item() or 1.0
            worst = max(worst, (actual - wanted).abs().max().item() / scale)
    return worst


@contextmanager
def counting_distributed_calls(counts: dict[str, int]):
    """Count calls to torch.distributed's collectives and point-to-point functions while inside."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES + POINT_TO_POINT if hasattr(dist, name)}

    def counted(name, function):
        def wrapper(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return function(*args, **kwargs)

        return wrapper

    try:
        for name, function in originals.items():
            setattr(dist, name, counted(name, function))
        yield counts
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)


def run_case(name: str, chain: list[int], post_validation: bool) -> dict:
    """30 steps of one optimizer; the worst error over all steps, the counters, the calls made."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference, distributed = small_model(), small_model()
    all_reference = list(reference.parameters())
    begin, end = slice_bounds(len(all_reference), world, rank)
    mine, theirs = list(distributed.parameters())[begin:end], all_reference[begin:end]
    my_optimizer, their_optimizer = OPTIMIZERS[name](mine), OPTIMIZERS[name](all_reference)
    base_lr = my_optimizer.param_groups[0]["lr"]
    position = chain.index(rank)
    validator = PostValidator(
        my_optimizer,
        MAX_NORM,
        post_validation=post_validation,
        prev_rank=chain[position - 1] if position > 0 else None,
        next_rank=chain[position + 1] if position + 1 < world else None,
    )
    calls: dict[str, int] = {}
    worst, late_finish = 0.0, False
    for step in range(STEPS):
        grads = scenario_grads(reference, step, chain)
        for param, grad in zip(mine, grads[begin:end]):
            param.grad = grad.clone()  # a new backward after zero_grad(set_to_none=True)
        if late_finish:  # step k-1 is validated only now, during step k ("warm-up")
            with counting_distributed_calls(calls):
                validator.finish()
            worst = max(worst, worst_error(mine, my_optimizer, theirs, their_optimizer))
        for param, grad in zip(all_reference, grads):
            param.grad = grad
        their_optimizer.param_groups[0]["lr"] = learning_rate(base_lr, step)
        if all(torch.isfinite(g).all() for g in grads):
            torch.nn.utils.clip_grad_norm_(all_reference, MAX_NORM)
            their_optimizer.step()
        my_optimizer.param_groups[0]["lr"] = learning_rate(base_lr, step)
        with counting_distributed_calls(calls):
            validator.step()
        my_optimizer.param_groups[0]["lr"] = learning_rate(base_lr, step + 1)  # the scheduler moves on
        late_finish = step % 3 == 1
        if not late_finish:
            if step % 2:
                my_optimizer.zero_grad(set_to_none=True)
            with counting_distributed_calls(calls):
                validator.finish()
            worst = max(worst, worst_error(mine, my_optimizer, theirs, their_optimizer))
    validator.close()
    worst = max(worst, worst_error(mine, my_optimizer, theirs, their_optimizer))
    return {
        "worst": worst,
        "position": position,
        "calls": calls,
        "counters": {
            "steps": validator.stats.steps,
            "steps_rolled_back": validator.stats.rolled_back,
            "steps_skipped": validator.stats.skipped,
            "steps_deferred": validator.stats.deferred,
            "steps_clipped": validator.stats.clipped,
        },
    }


def rank_worker(chain: list[int]) -> dict:
    """All cases of one world size in one spawn."""
    init_distributed(backend="gloo", timeout=60)
    results = {name: run_case(name, chain, post_validation=True) for name in OPTIMIZERS}
    results["adamw-synchronous"] = run_case("adamw", chain, post_validation=False)
    return results


# -- the tests ---------------------------------------------------------------------------------------


def expected_counters(position: int, world: int, reversible: bool) -> dict[str, int]:
    """What each step's scenario must cost a rank at ``position`` in the chain."""
    counts = dict.fromkeys(("steps_rolled_back", "steps_skipped", "steps_deferred", "steps_clipped"), 0)
    tail = position == world - 1
    for step in range(STEPS):
        scenario = SCENARIOS[step % len(SCENARIOS)]
        nonfinite_seen = scenario == "nan-head" or (scenario == "inf-tail" and tail)
        counts["steps_skipped"] += scenario in ("nan-head", "inf-tail")
        counts["steps_clipped"] += scenario in ("head", "tail")
        if tail or nonfinite_seen:
            continue
        optimistic = reversible and scenario in ("calm", "tail", "inf-tail")
        counts["steps_rolled_back"] += optimistic and scenario in ("tail", "inf-tail")
        counts["steps_deferred"] += not optimistic
    return counts
