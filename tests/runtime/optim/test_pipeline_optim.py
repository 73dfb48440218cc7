"""The Pipeline's optimizer step (post-validation through the real pipeline) and data parallelism.

* 2 ranks (zb-v, two chunks per rank) and 4 ranks (1f1b): 30 steps of SGD-momentum, Adam and
  AdamW with clipping on some steps and Inf/NaN gradients on others; after every step the
  parameters and optimizer states equal ``clip_grad_norm_`` + ``step`` on the whole model.  The
  single-process reference steps on the gradients the pipeline computed (gathered from the ranks),
  so the check isolates the optimizer step from the (separately tested) gradient rounding.
* data_parallel = 2 × pipeline 2 (4 ranks): loss, gradients and parameters after a few clipped
  steps equal one process training the whole model on the whole batch.
* Between the last backward and the optimizer step no collective over the pipeline runs in
  post-validation mode (torch.distributed's functions are wrapped and counted in the ranks).

One spawn per world size runs every case.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from _dist import DistSpy, relative_error, rich_batch, rich_layers, run_ranks, token_loss
from _post_validation import (
    COLLECTIVES,
    MAX_NORM,
    OPTIMIZERS,
    SCENARIOS,
    STEPS,
    TOLERANCE,
    counting_distributed_calls,
    expected_counters,
    learning_rate,
    worst_error,
)
from _profile import TWO_AND_FOUR_RANKS
from torch import nn

from zerobubble.runtime import PipelineError
from zerobubble.runtime.launch import init_distributed
from zerobubble.runtime.optim.post_validation import check_max_norm, validation_chain
from zerobubble.runtime.optim.rollback import OptimizerValidationError
from zerobubble.runtime.parallel.data_parallel import last_gradient_ops
from zerobubble.schedule import build_schedule

MICROBATCHES = 4
CASES = ["sgd-momentum", "adam", "adamw"]
SCHEDULE = {2: "zb-v", 4: "1f1b"}
DP_STEPS = 3
DP_TOLERANCE = 1e-5


# -- inside the ranks ---------------------------------------------------------------------------------


def shape_gradients(pipe, step: int, chain: list[int]) -> dict[str, torch.Tensor]:
    """Gather the pipeline's gradients; rescale/poison them for the step's scenario on every rank alike.

    Returns the whole model's shaped gradients (for the reference); this rank's ``.grad`` are
    shaped in place the same way.
    """
    world = dist.get_world_size()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {name: p.grad for name, p in pipe.named_parameters()})
    owner = {name: rank for rank, grads in enumerate(gathered) for name in grads}
    full = {name: grad for grads in gathered for name, grad in grads.items()}
    scenario = SCENARIOS[step % len(SCENARIOS)]
    factors = {}
    for rank in range(world):
        names = [n for n in full if owner[n] == rank]
        norm = float(
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(full[n]) for n in names]))
        )
        big = (scenario == "head" and rank == chain[0]) or (scenario == "tail" and rank == chain[-1])
        factors[rank] = (3.0 * MAX_NORM if big else 0.3 * MAX_NORM / math.sqrt(world)) / norm
    shaped = {name: grad * factors[owner[name]] for name, grad in full.items()}
    poison = {"nan-head": (chain[0], math.nan), "inf-tail": (chain[-1], math.inf)}.get(scenario)
    if poison is not None:
        first = next(n for n in full if owner[n] == poison[0])
        shaped[first].view(-1)[1] = poison[1]
    for name, param in pipe.named_parameters():
        param.grad.copy_(shaped[name])
    return shaped


def run_optimizer_case(name: str, schedule: str, post_validation: bool) -> dict:
    """30 steps through the Pipeline against the whole-model synchronous reference."""
    from zerobubble import Pipeline

    pipe = Pipeline(
        rich_layers(seed=1),
        schedule=schedule,
        microbatches=MICROBATCHES,
        loss_fn=token_loss,
        timeout=60,
        post_validation=post_validation,
    )
    reference = dict(nn.Sequential(*rich_layers(seed=1)).named_parameters())
    names = [n for n, _ in pipe.named_parameters()]
    mine, theirs = [dict(pipe.named_parameters())[n] for n in names], [reference[n] for n in names]
    optimizer, their_optimizer = OPTIMIZERS[name](mine), OPTIMIZERS[name](list(reference.values()))
    base_lr = optimizer.param_groups[0]["lr"]
    finish_times = [ends[-1] for ends in pipe.timeline.end]
    chain = validation_chain(finish_times)
    calls: dict[str, int] = {}
    worst, late = 0.0, False
    for step in range(STEPS):
        with counting_distributed_calls(calls):
            pipe.step(*rich_batch(2 * MICROBATCHES, seed=100 + step))
        if late:  # step k-1 was settled by this step, before its first forward
            worst = max(worst, worst_error(mine, optimizer, theirs, their_optimizer))
        shaped = shape_gradients(pipe, step, chain)
        for param_name, param in reference.items():
            param.grad = shaped[param_name].clone()
        their_optimizer.param_groups[0]["lr"] = learning_rate(base_lr, step)
        if all(torch.isfinite(g).all() for g in shaped.values()):
            torch.nn.utils.clip_grad_norm_(list(reference.values()), MAX_NORM)
            their_optimizer.step()
        optimizer.param_groups[0]["lr"] = learning_rate(base_lr, step)
        with counting_distributed_calls(calls):
            pipe.optimizer_step(optimizer, max_norm=MAX_NORM)
        optimizer.param_groups[0]["lr"] = learning_rate(base_lr, step + 1)  # a scheduler moves on
        pipe.zero_grad(set_to_none=True)
        late = step % 3 == 1
        if not late:
            pipe.synchronize()
            worst = max(worst, worst_error(mine, optimizer, theirs, their_optimizer))
    pipe.synchronize()
    worst = max(worst, worst_error(mine, optimizer, theirs, their_optimizer))
    stats = pipe.optimizer_stats
    return {
        "worst": worst,
        "calls": calls,
        "position": chain.index(pipe.rank),
        "counters": {
            "steps": stats.steps,
            "steps_rolled_back": stats.rolled_back,
            "steps_skipped": stats.skipped,
            "steps_deferred": stats.deferred,
            "steps_clipped": stats.clipped,
        },
    }


class GroupRecorder(DistSpy):
    """Wraps torch.distributed's collectives; records (name, ranks of the group, async) per call."""

    def __init__(self):
        super().__init__(COLLECTIVES)
        self.calls: list[tuple[str, tuple[int, ...], bool]] = []

    def seen(self, name: str, args: tuple, kwargs: dict) -> None:
        group = kwargs.get("group")
        ranks = (
            tuple(dist.get_process_group_ranks(group))
            if group is not None
            else tuple(range(dist.get_world_size()))
        )
        self.calls.append((name, ranks, bool(kwargs.get("async_op", False))))


class EventNames:
    """A recorder keeping the names of the runtime events (hooks) of the last step."""

    def __init__(self):
        self.names: list[str] = []

    def begin_step(self) -> None:
        self.names = []

    def op(self, op, start, end) -> None:
        pass

    def wait(self, key, start, end) -> None:
        pass

    def event(self, name: str, start, end) -> None:
        self.names.append(name)


def run_data_parallel_case() -> dict:
    """DP 2 × PP 2 (zb-v) against one process on the whole batch: loss, gradients, parameters."""
    from zerobubble import Pipeline

    pipe = Pipeline(
        rich_layers(seed=2), schedule="zb-v", microbatches=2, loss_fn=token_loss, timeout=60, data_parallel=2
    )
    pipe.recorder = events = EventNames()
    layers = rich_layers(seed=2)
    model = nn.Sequential(*layers)
    mine = dict(pipe.named_parameters())
    sgd = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)  # noqa: E731
    optimizer, their_optimizer = sgd(list(mine.values())), sgd(list(model.parameters()))
    shard = slice(4 * pipe.layout.grid.dp_index, 4 * pipe.layout.grid.dp_index + 4)
    loss_errors, grad_errors, recorders = [], [], []
    for step in range(DP_STEPS):
        inputs, targets = rich_batch(8, seed=200 + step)
        with GroupRecorder() as recorder:
            loss = pipe.step(inputs[shard], targets[shard])
            grads = {n: p.grad.clone() for n, p in mine.items()}
            pipe.optimizer_step(optimizer, max_norm=0.5)
        recorders.append(recorder.calls)
        model.zero_grad(set_to_none=True)
        values = inputs
        for layer in layers:
            values = layer(*values) if isinstance(values, tuple) else layer(values)
        expected_loss = token_loss(values, targets)
        expected_loss.backward()
        expected = dict(model.named_parameters())
        grad_errors.append(max(relative_error(grads[n], expected[n].grad) for n in grads))
        if loss is not None:
            loss_errors.append(abs(loss.item() - expected_loss.item()) / expected_loss.item())
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.5)
        their_optimizer.step()
        pipe.zero_grad(set_to_none=True)
    pipe.synchronize()
    expected = dict(model.named_parameters())
    return {
        "loss_errors": loss_errors,
        "grad_errors": grad_errors,
        "param_error": max(relative_error(p.detach(), expected[n].detach()) for n, p in mine.items()),
        "calls": recorders,
        "chunks": len(pipe.stages),
        "dp_ranks": [pipe.layout.grid.global_rank(pipe.rank, d) for d in range(2)],
        "pipeline_ranks": pipe.layout.grid.replica_ranks(pipe.layout.grid.dp_index),
        "holds_loss": pipe.holds_loss,
        "stats": pipe.optimizer_stats.clipped,
        "events": events.names,
    }


def bad_data_parallel() -> str:
    from zerobubble import Pipeline

    try:
        Pipeline(rich_layers(seed=0), schedule="1f1b", microbatches=4, loss_fn=token_loss, data_parallel=3)
    except PipelineError as error:
        return str(error)
    return "no error"


def rank_worker(world: int) -> dict:
    init_distributed(backend="gloo", timeout=60)
    results = {name: run_optimizer_case(name, SCHEDULE[world], post_validation=True) for name in CASES}
    results["adamw-synchronous"] = run_optimizer_case("adamw", SCHEDULE[world], post_validation=False)
    if world == 4:
        results["data-parallel"] = run_data_parallel_case()
        results["bad-data-parallel"] = bad_data_parallel()
    return results


# -- the tests ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=TWO_AND_FOUR_RANKS, ids=["2-ranks", "4-ranks"])
def outcomes(request) -> list[dict]:
    """Every rank's results of :func:`rank_worker` on ``request.param`` ranks."""
    return run_ranks(rank_worker, request.param, request.param)


@pytest.mark.multiprocess
def test_every_step_equals_clip_and_step_on_the_whole_model(outcomes):
    for rank, results in enumerate(outcomes):
        for case in [*CASES, "adamw-synchronous"]:
            assert results[case]["worst"] <= TOLERANCE, f"rank {rank} {case}: {results[case]['worst']:.3g}"


@pytest.mark.multiprocess
def test_counters_show_rollbacks_skips_and_clipping_where_expected(outcomes):
    world = len(outcomes)
    per_rank = outcomes
    for results in per_rank:
        for case in [*CASES, "adamw-synchronous"]:
            position = world - 1 if case == "adamw-synchronous" else results[case]["position"]
            expected = expected_counters(position, world, reversible=True)
            assert results[case]["counters"] == {"steps": STEPS, **expected}, case
    assert sum(results["adam"]["counters"]["steps_rolled_back"] for results in per_rank) > 0


@pytest.mark.multiprocess
def test_post_validation_issues_no_collective_between_backward_and_step(outcomes):
    for results in outcomes:
        for case in CASES:
            calls = results[case]["calls"]
            assert not set(calls) & set(COLLECTIVES), calls
            assert calls.get("isend", 0) > 0 and calls.get("irecv", 0) > 0
        synchronous = results["adamw-synchronous"]["calls"]
        assert synchronous.get("all_reduce") == STEPS, synchronous


@pytest.mark.multiprocess
@pytest.mark.parametrize("outcomes", [4], ids=["4-ranks"], indirect=True)
def test_data_parallel_pipeline_equals_one_process_on_the_whole_batch(outcomes):
    per_rank = [results["data-parallel"] for results in outcomes]
    assert [r["pipeline_ranks"] for r in per_rank] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp_ranks"] for r in per_rank] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    losses = [e for r in per_rank for e in r["loss_errors"]]
    assert len(losses) == 2 * DP_STEPS and max(losses) <= DP_TOLERANCE
    assert max(e for r in per_rank for e in r["grad_errors"]) <= DP_TOLERANCE
    assert max(r["param_error"] for r in per_rank) <= DP_TOLERANCE
    assert all(r["stats"] > 0 for r in per_rank), "max_norm 0.5 clips some steps"
    for r in per_rank:
        for calls in r["calls"]:
            assert all(len(ranks) == 2 and list(ranks) == r["dp_ranks"] for _, ranks, _ in calls), calls
            reductions = [c for c in calls if c[0] == "all_reduce" and c[2]]
            # one asynchronous reduction per chunk, plus the loss's on the last stage
            assert len(reductions) == r["chunks"] + r["holds_loss"], "one asynchronous reduction per chunk"
            assert len(calls) == r["chunks"] + r["holds_loss"], "plus the loss on the last stage"
        # the lowered program's actions are visible to a recorder: one settle, then per chunk one
        # all-reduce issued and, at the step's end, waited
        assert r["events"].count("optimizer settle") == 1, r["events"]
        starts = [name for name in r["events"] if name.startswith("issue all_reduce")]
        waits = [name for name in r["events"] if name.startswith("wait all_reduce")]
        assert len(starts) == len(waits) == r["chunks"], r["events"]
        assert r["events"][-len(waits) :] == waits, "the waits end the program"


@pytest.mark.multiprocess
@pytest.mark.parametrize("outcomes", [4], ids=["4-ranks"], indirect=True)
def test_data_parallel_that_does_not_divide_the_ranks_is_refused(outcomes):
    for results in outcomes:
        assert "data_parallel=3 does not divide the 4 ranks" in results["bad-data-parallel"]


# -- without processes --------------------------------------------------------------------------------


def test_chain_starts_with_the_rank_that_finishes_first():
    assert validation_chain([5.0, 3.0, 3.0, 9.0]) == [2, 1, 0, 3]


def test_last_gradient_op_of_each_stage():
    schedule = build_schedule("zb-v", 2, 4)
    for rank, program in enumerate(schedule.programs):
        last = last_gradient_ops(program)
        assert sorted(last) == sorted(schedule.placement.stages_of(rank))
        for stage, position in last.items():
            assert program[position].stage == stage and program[position].kind.value in ("W", "BW", "B")
            assert all(op.stage != stage or op.kind.value == "F" for op in program[position + 1 :])


def test_max_norm_must_be_positive():
    assert check_max_norm(None) is None and check_max_norm(2) == 2.0
    for bad in (0, -1.0, math.nan, "1"):
        with pytest.raises(OptimizerValidationError, match="max_norm"):
            check_max_norm(bad)
