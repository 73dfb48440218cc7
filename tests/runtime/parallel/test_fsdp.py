"""``Pipeline(..., mesh=mesh, data_parallel="fsdp")``: FSDP2 for the data-parallel dimension.

One spawn of 4 gloo ranks (pipeline 2 × data-parallel 2) runs every case:

* zb-h1, zb-v (two chunks per rank) and 1f1b in float64: after each of 3 clipped AdamW steps the
  gradients (full tensors, ``DTensor.full_tensor()``) and after the last one the parameters equal
  one process training the whole model on the whole batch, and the replicated
  ``data_parallel="replicate"`` pipeline run beside it; the parameters, gradients and AdamW states are shards;
  per step each chunk is all-gathered once and reduce-scattered once (by FSDP2's own collectives);
  ``full_state_dict()`` is the unpipelined model's; ``load_state_dict`` of it loads; ``evaluate`` runs.
* post_validation=False (a synchronous step) on one schedule.
* ``schedule="auto"`` plans the sharded bytes: a budget only the sharded layout fits is planned.
* a layer the user wrapped in ``fully_shard``, an unknown ``data_parallel`` mode and ``"fsdp"`` with
  one replica are refused on every rank.
"""

from __future__ import annotations

import pytest
import torch
from _dist import DistSpy, relative_error, rich_batch, rich_layers, run_ranks, token_loss
from torch import nn

from zerobubble.runtime import PipelineError
from zerobubble.runtime.launch import init_distributed
from zerobubble.runtime.tensors import full_value

SCHEDULES = ["zb-h1", "zb-v", "1f1b"]
STEPS = 3
MAX_NORM = 0.3
TOLERANCE = 1e-5
BATCH = 8


def _layers(seed: int) -> list[nn.Module]:
    return [layer.double() for layer in rich_layers(seed)]


class CollectiveCounter(DistSpy):
    """Counts FSDP2's all-gathers and reduce-scatters (torch.distributed's functions, wrapped)."""

    NAMES = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor")

    def __init__(self):
        super().__init__(self.NAMES)
        self.counts = dict.fromkeys(self.NAMES, 0)

    def seen(self, name: str, args: tuple, kwargs: dict) -> None:
        self.counts[name] += 1

    def gathers(self) -> int:
        return self.counts["all_gather_single"] + self.counts["all_gather_into_tensor"]

    def scatters(self) -> int:
        return self.counts["reduce_scatter_single"] + self.counts["reduce_scatter_tensor"]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return full_value(tensor).detach()


def run_case(mesh, schedule: str, post_validation: bool = True) -> dict:
    """FSDP pipeline, replicated pipeline and the one-process reference, side by side, on ``mesh``
    (dp 2 × pp 2)."""
    from zerobubble import Pipeline

    def build(mode):
        return Pipeline(
            _layers(seed=3),
            schedule=schedule,
            microbatches=2,
            loss_fn=token_loss,
            timeout=60,
            mesh=mesh,
            data_parallel=mode,
            post_validation=post_validation,
        )

    sharded, replicated = build("fsdp"), build("replicate")
    layers = _layers(seed=3)
    model = nn.Sequential(*layers)
    adamw = lambda params: torch.optim.AdamW(params, lr=0.05, weight_decay=0.01)  # noqa: E731
    opt_s, opt_r, opt_ref = (
        adamw(list(p)) for p in (sharded.parameters(), replicated.parameters(), model.parameters())
    )
    mine_s, mine_r = dict(sharded.named_parameters()), dict(replicated.named_parameters())
    shard = slice(4 * sharded.layout.grid.dp_index, 4 * sharded.layout.grid.dp_index + 4)
    out: dict = {"grad_ref": [], "grad_rep": [], "loss": [], "gathers": [], "scatters": []}
    for step in range(STEPS):
        inputs, targets = rich_batch(BATCH, seed=300 + step)
        with CollectiveCounter() as counter:
            loss = sharded.step(inputs[shard], targets[shard])
        out["gathers"].append(counter.gathers())
        out["scatters"].append(counter.scatters())
        replicated.step(inputs[shard], targets[shard])
        grads = {n: _full(p.grad) for n, p in mine_s.items()}
        model.zero_grad(set_to_none=True)
        values = inputs
        for layer in layers:
            values = layer(*values) if isinstance(values, tuple) else layer(values)
        expected_loss = token_loss(values, targets)
        expected_loss.backward()
        expected = dict(model.named_parameters())
        out["grad_ref"].append(max(relative_error(grads[n], expected[n].grad) for n in grads))
        out["grad_rep"].append(max(relative_error(grads[n], mine_r[n].grad) for n in grads))
        if loss is not None:
            out["loss"].append(abs(loss.item() - expected_loss.item()) / expected_loss.item())
        sharded.optimizer_step(opt_s, max_norm=MAX_NORM)
        replicated.optimizer_step(opt_r, max_norm=MAX_NORM)
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), MAX_NORM)
        opt_ref.step()
        sharded.zero_grad(set_to_none=True)
        replicated.zero_grad(set_to_none=True)
    full = sharded.full_state_dict()  # settles the pending step too
    replicated.synchronize()
    expected = dict(model.named_parameters())
    out["param_ref"] = max(relative_error(_full(p), expected[n].detach()) for n, p in mine_s.items())
    out["param_rep"] = max(relative_error(_full(p), mine_r[n].detach()) for n, p in mine_s.items())
    reference_state = model.state_dict()
    out["full_keys"] = list(full) == list(reference_state)
    out["full_plain"] = all(type(v) is torch.Tensor for v in full.values())
    out["full_error"] = max(relative_error(full[k], reference_state[k]) for k in reference_state)
    states = list(opt_s.state.values())
    out["dtensors"] = all(type(p).__name__ == "DTensor" for p in sharded.parameters()) and all(
        type(s["exp_avg"]).__name__ == "DTensor" for s in states
    )
    out["sharded"] = all(p.to_local().numel() < p.numel() for p in sharded.parameters() if p.shape[0] > 1)
    out["clipped"] = sharded.optimizer_stats.clipped
    out["rolled_back"] = sharded.optimizer_stats.rolled_back
    out["paths"] = sorted({record.path for record in sharded.split_report()})
    out["chunks"] = len(sharded.stages)
    # load the reference's state back (after changing it) and evaluate
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    sharded.load_state_dict(model.state_dict())
    out["load_error"] = max(
        relative_error(_full(p), expected[n].detach()) for n, p in dict(sharded.named_parameters()).items()
    )
    inputs, targets = rich_batch(BATCH, seed=999)
    evaluated = sharded.evaluate(inputs[shard], targets[shard])
    if evaluated is not None:
        with torch.no_grad():
            values = inputs
            for layer in layers:
                values = layer(*values) if isinstance(values, tuple) else layer(values)
            expected_eval = token_loss(values, targets).item()
            out["eval_error"] = abs(evaluated.item() - expected_eval) / expected_eval
    out["resharded"] = all(type(p).__name__ == "DTensor" for p in sharded.parameters())
    return out


def refusals() -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from zerobubble import Pipeline

    messages = {}

    def attempt(name, layers, **kwargs):
        try:
            Pipeline(layers, schedule="1f1b", microbatches=2, loss_fn=token_loss, timeout=60, **kwargs)
            messages[name] = "no error"
        except PipelineError as error:
            messages[name] = str(error)

    wrapped = _layers(seed=0)
    fully_shard(wrapped[2], mesh=init_device_mesh("cpu", (4,)))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    attempt("user-fully-shard", wrapped, mesh=mesh, data_parallel="fsdp")
    attempt("unknown", _layers(seed=0), mesh=mesh, data_parallel="zero3")
    one = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "pp"))
    attempt("one-replica", _layers(seed=0), mesh=one, data_parallel="fsdp")
    return messages


def auto_case(mesh) -> dict:
    """``schedule="auto"`` with FSDP2: the plan counts sharded bytes.  Wide Linear layers on few rows,
    so that parameters, gradients and AdamW state outweigh the activations: first planned without a
    budget, then with a budget 2 % above the least any sharded candidate needs, which no replicated
    plan of the same measured profile fits (:func:`plan` without a layout raises): planned, and one
    step runs."""
    from zerobubble import Pipeline
    from zerobubble.schedule import ScheduleError
    from zerobubble.schedule.modelplan import plan

    def wide() -> list[nn.Module]:
        torch.manual_seed(0)
        return [nn.Sequential(nn.Linear(64, 64), nn.Tanh()).double() for _ in range(4)]

    x = torch.randn(4, 64, dtype=torch.float64)
    options = {"microbatches": 2, "loss_fn": nn.functional.mse_loss, "timeout": 60, "example": (x, x)}
    pipe = Pipeline(wide(), schedule="auto", mesh=mesh, data_parallel="fsdp", **options)
    assert pipe.plan is not None and pipe.profile is not None
    sharded = min(max(c.peak_bytes) for c in pipe.plan.candidates if c.peak_bytes)
    budget = sharded * 1.02
    try:
        plan(pipe.profile, 2, 2, budget)
        replicated = "fits"
    except ScheduleError as error:
        replicated = str(error)
    second = Pipeline(
        wide(), schedule="auto", mesh=mesh, data_parallel="fsdp", memory_limit=budget, **options
    )
    loss = second.step(x, x)
    return {
        "reason": pipe.plan.reason,
        "replicated": replicated,
        "budgeted peak": max(second.plan.winner.peak_bytes) if second.plan else None,
        "budget": budget,
        "loss": float(loss) if loss is not None else None,
    }


def rank_worker() -> dict:
    init_distributed(backend="gloo", timeout=60)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    results: dict = {name: run_case(mesh, name) for name in SCHEDULES}
    results["zb-h1-synchronous"] = run_case(mesh, "zb-h1", post_validation=False)
    results["refusals"] = refusals()
    results["auto"] = auto_case(mesh)
    return results


@pytest.fixture(scope="module")
def outcomes() -> list[dict]:
    return run_ranks(rank_worker, 4)


CASES = [*SCHEDULES, "zb-h1-synchronous"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_sharded_pipeline_equals_one_process_and_the_replicated_pipeline(outcomes, case):
    per_rank = [results[case] for results in outcomes]
    for rank, r in enumerate(per_rank):
        assert max(r["grad_ref"]) <= TOLERANCE, (rank, r["grad_ref"])
        assert max(r["grad_rep"]) <= TOLERANCE, (rank, r["grad_rep"])
        assert r["param_ref"] <= TOLERANCE and r["param_rep"] <= TOLERANCE, (rank, r)
        assert r["clipped"] > 0, "max_norm clips some steps"
    losses = [e for r in per_rank for e in r["loss"]]
    assert len(losses) == 2 * STEPS and max(losses) <= TOLERANCE


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_parameters_gradients_and_optimizer_state_are_shards(outcomes, case):
    for results in outcomes:
        r = results[case]
        assert r["dtensors"] and r["sharded"] and r["resharded"], r


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_each_chunk_is_gathered_and_reduce_scattered_once_a_step(outcomes, case):
    for results in outcomes:
        r = results[case]
        assert r["gathers"] == [r["chunks"]] * STEPS, r["gathers"]
        assert r["scatters"] == [r["chunks"]] * STEPS, r["scatters"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_full_state_dict_is_the_unpipelined_models_and_loads_back(outcomes, case):
    for results in outcomes:
        r = results[case]
        assert r["full_keys"] and r["full_plain"], r
        assert r["full_error"] <= TOLERANCE and r["load_error"] <= TOLERANCE, r
        if "eval_error" in r:
            assert r["eval_error"] <= TOLERANCE, r["eval_error"]  # the mean loss is float32


@pytest.mark.multiprocess
def test_wrong_sharding_arguments_are_refused_on_every_rank(outcomes):
    for results in outcomes:
        messages = results["refusals"]
        assert 'data_parallel="fsdp"' in messages["user-fully-shard"], messages
        assert "fully_shard" in messages["user-fully-shard"], messages
        assert "data_parallel='zero3' with mesh=" in messages["unknown"], messages
        assert "data-parallel dimension, which has 1 rank" in messages["one-replica"], messages


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_the_split_stays_on_its_paths_under_fsdp(outcomes, case):
    """The split guard checks the unsharded parameters the forwards use: nothing falls back."""
    for results in outcomes:
        paths = results[case]["paths"]
        assert paths and not any("fallback" in path for path in paths), paths
        if case != "1f1b":
            assert any(path.startswith("fast path") for path in paths), paths


@pytest.mark.multiprocess
def test_post_validation_rolls_back_sharded_states_exactly(outcomes):
    """zb-v's optimistic steps are rolled back on some rank (DTensor parameters and AdamW states),
    and the parameters still equal the reference (checked above)."""
    assert sum(results["zb-v"]["rolled_back"] for results in outcomes) > 0


@pytest.mark.multiprocess
def test_the_planner_counts_sharded_bytes_and_plans_a_budget_only_sharding_fits(outcomes):
    for results in outcomes:
        auto = results["auto"]
        assert "on dp 2 (FSDP2) × tp 1 the busiest rank holds" in auto["reason"], auto
        assert "no schedule fits the memory budget" in auto["replicated"], auto
        assert auto["budgeted peak"] <= auto["budget"], auto
    assert any(results["auto"]["loss"] is not None for results in outcomes)
