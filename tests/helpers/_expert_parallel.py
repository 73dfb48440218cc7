"""The 4-rank worker of tests/runtime/parallel/test_expert_parallel.py: mixture-of-experts models on a
(pp 2, ep 2) mesh trained against the model in one process on the whole batch, in float64; their
checkpoints saved with DCP and loaded into other layouts; the refusals.

Each ``ep`` rank runs its half of the batch (2 microbatches of 2 rows); the reference runs the same
4 microbatches in one process.  Module-level so that spawned ranks can import it.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from _hf_moe import batch, moe_model, reference_loss
from torch import nn

EP_MICROBATCHES = 2  # per ep rank: the reference's 4 microbatches of 2 rows, split over the ep ranks
MAX_NORM = 0.05  # small enough to clip every step


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    with torch.no_grad():
        return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-300))


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _pipeline(model: nn.Module, schedule: str, mesh: Any, aux: bool) -> Any:
    from _hf_models import lm_loss

    from zerobubble import Pipeline
    from zerobubble.hf import pipeline_layers, with_router_aux_loss

    loss = with_router_aux_loss(lm_loss) if aux else lm_loss
    return Pipeline(
        pipeline_layers(model), schedule=schedule, microbatches=EP_MICROBATCHES, loss_fn=loss,
        timeout=60, mesh=mesh,
    )  # fmt: skip


def _my_rows(mesh: Any, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This ep rank's half of the batch."""
    names = list(mesh.mesh_dim_names)
    if "ep" not in names:
        return tokens, targets
    index, size = mesh.get_coordinate()[names.index("ep")], mesh.size(names.index("ep"))
    rows = len(tokens) // size
    return tokens[index * rows : (index + 1) * rows], targets[index * rows : (index + 1) * rows]


def _train(pipe: Any, reference: nn.Module, mesh: Any, steps: range) -> tuple[list[float], list[str]]:
    """``steps`` clipped AdamW steps of ``pipe`` and ``reference``: the loss errors, the split
    guard's warnings."""
    from zerobubble.runtime.wgrad import SplitMismatchWarning

    optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    expected_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    losses: list[float] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SplitMismatchWarning)
        for step in steps:
            tokens, targets, _ = batch("whole", seed=10 + step)
            expected = reference_loss(reference, tokens, targets, {})
            expected.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
            expected_optimizer.step()
            expected_optimizer.zero_grad()
            loss = pipe.step(*_my_rows(mesh, tokens, targets))
            pipe.optimizer_step(optimizer, max_norm=MAX_NORM)
            optimizer.zero_grad()
            if loss is not None:
                losses.append(abs(loss.item() - expected.item()) / expected.item())
        pipe.synchronize()
    mismatches = [str(w.message) for w in caught if issubclass(w.category, SplitMismatchWarning)]
    return losses, mismatches


def _parameter_errors(pipe: Any, reference: nn.Module) -> dict[str, float]:
    """Each of this rank's parameters against the reference's (an expert DTensor's full tensor)."""
    from zerobubble.hf import pipeline_layers

    params = dict(nn.Sequential(*pipeline_layers(reference)).named_parameters())  # the Pipeline's names
    errors = {}
    for name, param in pipe.named_parameters():
        value = param.full_tensor() if hasattr(param, "full_tensor") else param
        errors[name] = _relative(value, params[name])
    return errors


def trained_cases(cases: list[tuple[str, str, bool]]) -> dict:
    """For each ``(family, schedule, aux)``: three clipped AdamW steps on the (pp 2, ep 2) mesh."""
    from zerobubble.runtime.launch import init_distributed

    init_distributed(backend="gloo", timeout=60)
    torch.set_num_threads(1)
    mesh = _mesh((2, 2), ("pp", "ep"))
    out: dict = {}
    for family, schedule, aux in cases:
        model = moe_model(family, aux)
        reference = copy.deepcopy(model)
        pipe = _pipeline(model, schedule, mesh, aux)
        losses, mismatches = _train(pipe, reference, mesh, range(3))
        experts = [name for name, p in pipe.named_parameters() if hasattr(p, "full_tensor")]
        out[f"{family} {schedule} {'aux' if aux else 'no-aux'}"] = {
            "losses": losses,
            "params": _parameter_errors(pipe, reference),
            "mismatches": mismatches,
            "experts": experts,
            "report": [(r.type, r.path, r.verified) for r in pipe.split_report() if "Experts" in r.type],
        }
    return out
