"""The 4-rank worker of tests/runtime/parallel/test_expert_parallel.py: mixture-of-experts models on a
(pp 2, ep 2) mesh trained against the model in one process on the whole batch, in float64; their
checkpoints saved with DCP and loaded into other layouts; the refusals.

Each ``ep`` rank runs its half of the batch (2 microbatches of 2 rows); the reference runs the same
4 microbatches in one process.  Module-level so that spawned ranks can import it.
"""

from __future__ import annotations

import copy
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
from _hf_moe import batch, moe_model, reference_loss
from torch import nn

EP_MICROBATCHES = 2  # per ep rank: the reference's 4 microbatches of 2 rows, split over the ep ranks
#: dualpipe-v needs 2p microbatches a pipeline: 4 of one row each per ep rank (without the aux loss,
#: whose reference is per microbatch of 2 rows)
SCHEDULE_MICROBATCHES = {"dualpipe-v": 4, "dualpipe-v threads": 4, "auto": 4}
MAX_NORM = 0.05  # small enough to clip every step
VOCAB_SCHEDULES = ["zb-v", "dualpipe-v"]  # the vocabulary-parallel ends on (pp 2, ep 2)


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    with torch.no_grad():
        return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-300))


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _microbatches(schedule: str) -> int:
    return SCHEDULE_MICROBATCHES.get(schedule, EP_MICROBATCHES)


def _pipeline(model: nn.Module, schedule: str, mesh: Any, aux: bool) -> Any:
    from _hf_models import lm_loss

    from zerobubble import Pipeline
    from zerobubble.hf import pipeline_layers, with_router_aux_loss

    loss = with_router_aux_loss(lm_loss) if aux else lm_loss
    name, _, overlap = schedule.partition(" ")  # "dualpipe-v threads": overlap="threads"
    # "auto": planned from a profile of this rank's half of the first batch, the experts' exchanges timed
    example = _half(*batch("whole", seed=10)[:2], mesh) if name == "auto" else None
    return Pipeline(
        pipeline_layers(model), schedule=name, microbatches=_microbatches(schedule), loss_fn=loss,
        timeout=60, mesh=mesh, overlap=overlap or None, example=example,
    )  # fmt: skip


def _half(tokens: torch.Tensor, targets: torch.Tensor, mesh: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``ep`` rank's half of a batch (as :func:`_my_rows` cuts it on a (pp, ep) mesh)."""
    index, rows = mesh.get_local_rank("ep"), len(tokens) // 2
    return tokens[index * rows : (index + 1) * rows], targets[index * rows : (index + 1) * rows]


def _my_rows(pipe: Any, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This replica's share of the batch (replica ``dp_index`` of ``dp · ep``)."""
    index, replicas = pipe.layout.dp_index, pipe.layout.grid.replicas
    rows = len(tokens) // replicas
    return tokens[index * rows : (index + 1) * rows], targets[index * rows : (index + 1) * rows]


def _train(
    pipe: Any, reference: nn.Module, mesh: Any, steps: range, optimizers: tuple[Any, Any]
) -> tuple[list[float], list[str]]:
    """``steps`` clipped steps of ``pipe`` and ``reference`` with their ``optimizers``: the loss
    errors, the split guard's warnings."""
    from zerobubble.runtime.wgrad import SplitMismatchWarning

    optimizer, expected_optimizer = optimizers
    losses: list[float] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SplitMismatchWarning)
        for step in steps:
            tokens, targets, expected = _reference_step(reference, expected_optimizer, step)
            loss = pipe.step(*_my_rows(pipe, tokens, targets))
            pipe.optimizer_step(optimizer, max_norm=MAX_NORM)
            optimizer.zero_grad()
            if loss is not None:
                losses.append(abs(loss.item() - expected.item()) / expected.item())
        pipe.synchronize()
    mismatches = [str(w.message) for w in caught if issubclass(w.category, SplitMismatchWarning)]
    return losses, mismatches


def _reference_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, step: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One clipped step of ``model`` in one process on the whole batch of ``step``: the batch
    (tokens, targets) and the loss."""
    tokens, targets, _ = batch("whole", seed=10 + step)
    expected = reference_loss(model, tokens, targets, {})
    expected.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    optimizer.zero_grad()
    return tokens, targets, expected


def _parameter_errors(pipe: Any, reference: nn.Module) -> dict[str, float]:
    """Each of this rank's parameters against the reference's (an expert DTensor's full tensor)."""
    from zerobubble.hf import pipeline_layers

    params = dict(nn.Sequential(*pipeline_layers(reference)).named_parameters())  # the Pipeline's names
    errors = {}
    for name, param in pipe.named_parameters():
        value = param.full_tensor() if hasattr(param, "full_tensor") else param
        errors[name] = _relative(value, params[name])
    return errors


class _Exchanges:
    """Counts the experts' all-to-all exchanges (dispatch, combine and their backwards)."""

    def __init__(self) -> None:
        from zerobubble.runtime.parallel import experts

        self.count, self._module, self._original = 0, experts, experts._exchange
        self.groups: set[int] = set()  # the process groups the exchanges went over
        self.threads: set[str] = set()  # the threads that ran them
        lock = threading.Lock()  # overlap="threads" exchanges from two threads

        def counted(*args: Any) -> torch.Tensor:
            with lock:
                self.count += 1
                self.groups.add(id(args[-1]))
                self.threads.add(threading.current_thread().name.split("_")[0])
            return self._original(*args)

        experts._exchange = counted

    def close(self) -> None:
        self._module._exchange = self._original


def trained_cases(cases: list[tuple[str, str, bool]]) -> dict:
    """For each ``(family, schedule, aux)``: three clipped AdamW steps on the (pp 2, ep 2) mesh, and
    the exchanges of the last one against one dispatch and one combine per F and per B."""
    from zerobubble.runtime.launch import init_distributed
    from zerobubble.runtime.parallel.experts import ExpertParallelExperts

    init_distributed(backend="gloo", timeout=60)
    torch.set_num_threads(1)
    mesh = _mesh((2, 2), ("pp", "ep"))
    out: dict = {}
    exchanges = _Exchanges()
    for family, schedule, aux in cases:
        model = moe_model(family, aux)
        reference = copy.deepcopy(model)
        pipe = _pipeline(model, schedule, mesh, aux)
        optimizers = tuple(torch.optim.AdamW(m.parameters(), lr=0.01) for m in (pipe, reference))
        losses, mismatches = _train(pipe, reference, mesh, range(2), optimizers)  # the split guard's runs too
        exchanges.count, exchanges.groups, exchanges.threads = 0, set(), set()
        last, more = _train(pipe, reference, mesh, range(2, 3), optimizers)
        blocks = sum(isinstance(m, ExpertParallelExperts) for m in pipe.module.modules())
        experts = [name for name, p in pipe.named_parameters() if hasattr(p, "full_tensor")]
        out[f"{family} {schedule} {'aux' if aux else 'no-aux'}"] = {
            "losses": losses + last,
            "params": _parameter_errors(pipe, reference),
            "mismatches": mismatches + more,
            "exchanges": (exchanges.count, 4 * blocks * _microbatches(schedule)),
            "groups": len(exchanges.groups),
            "threads": sorted(exchanges.threads),
            "experts": experts,
            "report": [(r.type, r.path, r.verified) for r in pipe.split_report() if "Experts" in r.type],
            "schedule": pipe.schedule.name,
            "plan": _plan_summary(pipe),
        }
    exchanges.close()
    return out


def _plan_summary(pipe: Any) -> dict | None:
    """``schedule="auto"``'s reason, candidates and each layer's measured all-to-all (None otherwise)."""
    if pipe.plan is None:
        return None
    return {
        "reason": pipe.plan.reason,
        "candidates": sorted({c.schedule for c in pipe.plan.candidates}),
        "all_to_all": [layer.all_to_all for layer in pipe.profile.layers],
    }


# -- checkpoints across layouts ------------------------------------------------------------------------

SAVED_AT = 2  # steps before the checkpoint; every layout then takes step SAVED_AT


def _distance(state: dict, expected: dict) -> float:
    if set(state) != set(expected):
        return float("inf")
    return max(_relative(state[k].double(), expected[k].double()) for k in expected)


def _reference_run(family: str) -> tuple[dict, dict, nn.Module, torch.optim.Optimizer, float]:
    """The uninterrupted run on the whole batch: the cut's state after SAVED_AT steps and after one
    more, the model and optimizer at the checkpoint, the loss of step SAVED_AT."""
    from zerobubble.hf import pipeline_layers

    model = moe_model(family, aux=True)
    whole = nn.Sequential(*pipeline_layers(model))  # the Pipeline's names
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    states, loss = [], 0.0
    for step in range(SAVED_AT + 1):
        if step == SAVED_AT:
            states.append({k: v.detach().clone() for k, v in whole.state_dict().items()})
            saved = copy.deepcopy(model)
            saved_optimizer = torch.optim.AdamW(saved.parameters(), lr=0.01)
            saved_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        loss = _reference_step(model, optimizer, step)[2].item()
    states.append({k: v.detach().clone() for k, v in whole.state_dict().items()})
    return states[0], states[1], saved, saved_optimizer, loss


def _resumed(pipe: Any, mesh: Any, directory: str, expected: dict, expected_loss: float) -> dict:
    """Load ``directory`` into ``pipe`` (DCP), take step SAVED_AT, compare with the reference."""
    import torch.distributed.checkpoint as dcp

    optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    state = {"model": pipe.state_dict(), "optim": pipe.optimizer_state_dict(optimizer, flatten=True)}
    dcp.load(state, checkpoint_id=directory)
    loaded = pipe.load_state_dict(state["model"])
    missing = pipe.load_optimizer_state_dict(optimizer, state["optim"])
    tokens, targets, _ = batch("whole", seed=10 + SAVED_AT)
    loss = pipe.step(*_my_rows(pipe, tokens, targets))
    pipe.optimizer_step(optimizer, max_norm=MAX_NORM)
    return {
        "loss": None if loss is None else abs(loss.item() - expected_loss) / expected_loss,
        "params": _distance(pipe.full_state_dict(), expected),
        "strict": (list(loaded.missing_keys), list(loaded.unexpected_keys), missing),
    }


def checkpoint_cases(root: str) -> dict:
    """Mixtral with its aux loss: SAVED_AT steps of zb-v on (pp 2, ep 2) saved with DCP, loaded into
    1f1b on (pp 2, dp 2), into the unpipelined cut (torch's get/set_state_dict, rank 0), and the
    unpipelined cut's checkpoint loaded into (pp 2, ep 2); each takes the next step."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    from zerobubble.hf import pipeline_layers
    from zerobubble.runtime.launch import init_distributed

    init_distributed(backend="gloo", timeout=60)
    torch.set_num_threads(1)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    saved, saved_plain = str(Path(root) / "ep"), str(Path(root) / "plain")
    at_save, after, model, model_optimizer, last_loss = _reference_run("mixtral")
    ep_mesh, dp_mesh = _mesh((2, 2), ("pp", "ep")), _mesh((2, 2), ("pp", "dp"))
    out: dict = {}

    pipe = _pipeline(moe_model("mixtral", aux=True), "zb-v", ep_mesh, True)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    _, out["mismatches"] = _train_steps(pipe, optimizer, ep_mesh, range(SAVED_AT))
    state = {"model": pipe.state_dict(), "optim": pipe.optimizer_state_dict(optimizer, flatten=True)}
    experts = {k: v for k, v in state["model"].items() if "experts" in k}
    out["expert entries"] = {k: (str(v.placements), tuple(v.to_local().shape)) for k, v in experts.items()}
    out["full tensors"] = max(_relative(v.full_tensor(), at_save[k]) for k, v in experts.items())
    out["optimizer DTensors"] = sum(hasattr(v, "placements") for v in state["optim"].values())
    dcp.save(state, checkpoint_id=saved)
    if dist.get_rank() == 0:
        whole = nn.Sequential(*pipeline_layers(model))
        model_state, optim_state = get_state_dict(whole, model_optimizer, options=flat)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=saved_plain, no_dist=True)
    del pipe, optimizer, state
    dist.barrier()

    pipe = _pipeline(moe_model("mixtral", aux=True), "1f1b", dp_mesh, True)
    out["1f1b pp2 dp2 from ep"] = _resumed(pipe, dp_mesh, saved, after, last_loss)
    del pipe
    if dist.get_rank() == 0:
        plain = moe_model("mixtral", aux=True)
        whole = nn.Sequential(*pipeline_layers(plain))
        plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=0.01)
        model_state, optim_state = get_state_dict(whole, plain_optimizer, options=flat)
        loaded = {"model": model_state, "optim": optim_state}
        dcp.load(loaded, checkpoint_id=saved, no_dist=True)
        model_state, optim_state = loaded["model"], loaded["optim"]
        set_state_dict(
            whole, plain_optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=flat
        )
        out["unpipelined from ep"] = _distance(whole.state_dict(), at_save)
    dist.barrier()
    pipe = _pipeline(moe_model("mixtral", aux=True), "zb-v", ep_mesh, True)
    out["zb-v pp2 ep2 from unpipelined"] = _resumed(pipe, ep_mesh, saved_plain, after, last_loss)
    return out


def _train_steps(pipe: Any, optimizer: Any, mesh: Any, steps: range) -> tuple[list[float], list[str]]:
    """``steps`` clipped steps of ``pipe`` alone: its losses, the split guard's warnings."""
    from zerobubble.runtime.wgrad import SplitMismatchWarning

    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SplitMismatchWarning)
        for step in steps:
            tokens, targets, _ = batch("whole", seed=10 + step)
            loss = pipe.step(*_my_rows(pipe, tokens, targets))
            pipe.optimizer_step(optimizer, max_norm=MAX_NORM)
            optimizer.zero_grad()
            losses.append(None if loss is None else loss.item())
        pipe.synchronize()
    return losses, [str(w.message) for w in caught if issubclass(w.category, SplitMismatchWarning)]


# -- refusals ----------------------------------------------------------------------------------------


def refused_cases() -> dict[str, str]:
    """What a (pp 2, ep 2) mesh refuses, by case: the PipelineError's message on this rank."""
    from _hf_models import lm_loss, tiny_model

    from zerobubble import Pipeline
    from zerobubble.hf import pipeline_layers

    mesh = _mesh((2, 2), ("pp", "ep"))
    dense = pipeline_layers(tiny_model("llama", "sdpa").double())
    odd = pipeline_layers(tiny_model("mixtral", "sdpa", num_hidden_layers=2, num_local_experts=3).double())
    attempts = {
        "dense": lambda: Pipeline(dense, schedule="1f1b", loss_fn=lm_loss, mesh=mesh, timeout=60),
        "three experts": lambda: Pipeline(odd, schedule="1f1b", loss_fn=lm_loss, mesh=mesh, timeout=60),
    }
    return refusals(attempts)


def refusals(attempts: dict[str, Any]) -> dict[str, str]:
    """Each attempt's :class:`PipelineError` message, by name ("built" where none was raised)."""
    from zerobubble.runtime import PipelineError

    out = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            out[name] = "built"
        except PipelineError as error:
            out[name] = str(error)
    return out


def vocab_cases(schedules: list[str]) -> dict:
    """Qwen3-MoE cut with ``vocab_parallel=True`` (its head and embedding sharded over each replica's
    pipeline ranks) on (pp 2, ep 2), per schedule: three clipped AdamW steps against the model in one
    process on the whole batch; the loss errors and every parameter's (a vocabulary shard against
    its rows of the whole, an expert DTensor's full tensor)."""
    from zerobubble import Pipeline
    from zerobubble.hf import pipeline_layers

    mesh = _mesh((2, 2), ("pp", "ep"))
    out = {}
    for schedule in schedules:
        model = moe_model("qwen3_moe", aux=False)
        reference = copy.deepcopy(model)
        parts = pipeline_layers(model, vocab_parallel=True)
        expected = pipeline_layers(reference, vocab_parallel=True)  # the same names, the reference's values
        whole = dict(nn.Sequential(*expected.layers).named_parameters())
        rows = {"vocab_embedding": expected.embedding.weight, "vocab_head": expected.head.weight}
        pipe = Pipeline(
            parts.layers, schedule=schedule, microbatches=_microbatches(schedule), mesh=mesh, timeout=60,
            head=parts.head, embedding=parts.embedding,
        )  # fmt: skip
        optimizers = tuple(torch.optim.AdamW(m.parameters(), lr=0.01) for m in (pipe, reference))
        losses, mismatches = _train(pipe, reference, mesh, range(3), optimizers)
        errors = {}
        for name, param in pipe.named_parameters():
            layer = name.split(".")[0]
            if layer in rows:
                shard = getattr(pipe.module, layer)
                errors[name] = _relative(param, rows[layer][shard.vocab_start : shard.vocab_stop])
            else:  # an expert DTensor against the whole experts
                value = param.full_tensor() if hasattr(param, "full_tensor") else param
                errors[name] = _relative(value, whole[name])
        out[schedule] = {"losses": losses, "params": errors, "mismatches": mismatches}
        out[schedule]["replicas"] = pipe.data_parallel
    return out


def dp_ep_case() -> dict:
    """Mixtral without the aux loss on (pp 1, dp 2, ep 2): four replicas of 2 rows each, the experts
    sharded over ep and their gradients reduced over dp; three steps against the whole batch."""
    mesh = _mesh((1, 2, 2), ("pp", "dp", "ep"))
    model = moe_model("mixtral", aux=False)
    reference = copy.deepcopy(model)
    pipe = _pipeline(model, "1f1b", mesh, aux=False)
    optimizers = tuple(torch.optim.AdamW(m.parameters(), lr=0.01) for m in (pipe, reference))
    losses, _ = _train(pipe, reference, mesh, range(3), optimizers)
    return {"losses": losses, "params": _parameter_errors(pipe, reference), "replica": pipe.layout.dp_index}


def all_cases(root: str, trained: list[tuple[str, str, bool]]) -> dict:
    """Everything the test asks of one spawn of four ranks."""
    out = {"trained": trained_cases(trained), "refused": refused_cases(), "dp ep": dp_ep_case()}
    out["vocab"] = vocab_cases(VOCAB_SCHEDULES)
    out["checkpoints"] = checkpoint_cases(root)
    from _expert_fsdp import fsdp_cases  # it imports this module

    out["fsdp"] = fsdp_cases(str(Path(root) / "fsdp"))
    return out
