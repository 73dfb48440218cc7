"""Rank worker for the real-model tests of the B/W split: every model × schedule in one spawn."""

from __future__ import annotations

import torch

from zerobubble.runtime import PipelineError
from zerobubble.runtime.launch import init_distributed
from zerobubble.schedule import ScheduleError
from zerobubble_demo.split_models import split_model


def reference(name: str, microbatches: int) -> dict:
    """One process over the same microbatches: mean loss, gradients, floating and integer buffers."""
    model = split_model(name, batch=2 * microbatches)
    losses = []
    for inputs, targets in zip(model.inputs.chunk(microbatches), model.targets.chunk(microbatches)):
        values = inputs
        for layer in model.layers:
            values = layer(*values) if isinstance(values, tuple) else layer(values)
        loss = model.loss_fn(values, targets)
        (loss / microbatches).backward()
        losses.append(loss.item())
    whole = torch.nn.Sequential(*model.layers)
    return {
        "loss": sum(losses) / microbatches,
        "grads": {n: p.grad.clone() for n, p in whole.named_parameters()},
        "buffers": dict(whole.named_buffers()),
    }


def model_cases(models: list[str], schedules: list[str], microbatches: int) -> dict:
    """``{(model, schedule): errors}`` on this rank, or ``{"skipped": reason}`` for a size a builder rejects.

    Errors are ``(‖actual − expected‖, ‖expected‖)`` per parameter gradient and floating buffer
    held by this rank, ``"loss"`` (relative, last-stage rank only) and ``"int_buffers_equal"``.
    """
    init_distributed(backend="gloo", timeout=90)
    from zerobubble import Pipeline

    results: dict = {}
    for name in models:
        expected = reference(name, microbatches)
        for schedule in schedules:
            model = split_model(name, batch=2 * microbatches)
            try:
                pipe = Pipeline(
                    model.layers,
                    schedule=schedule,
                    microbatches=microbatches,
                    loss_fn=model.loss_fn,
                    timeout=90,
                )
            except PipelineError as error:
                if isinstance(error.__cause__, ScheduleError):
                    results[name, schedule] = {"skipped": str(error)}
                    continue
                raise
            touched = _watch_b_ops(pipe)
            loss = pipe.step(model.inputs, model.targets)
            grads = {
                n: ((p.grad - expected["grads"][n]).norm().item(), expected["grads"][n].norm().item())
                for n, p in pipe.named_parameters()
            }
            buffers = {
                n: ((b - expected["buffers"][n]).norm().item(), expected["buffers"][n].norm().item())
                for n, b in pipe.module.named_buffers()
                if b.is_floating_point()
            }
            results[name, schedule] = {
                "loss": None if loss is None else abs(loss.item() - expected["loss"]) / abs(expected["loss"]),
                "grads": grads,
                "buffers": buffers,
                "int_buffers_equal": all(
                    torch.equal(b, expected["buffers"][n])
                    for n, b in pipe.module.named_buffers()
                    if not b.is_floating_point()
                ),
                "parameters": len(expected["grads"]),
                "w_ops": sum(op.kind.name == "W" for op in pipe.schedule.programs[pipe.rank]),
                "b_ops": sum(op.kind.name == "B" for op in pipe.schedule.programs[pipe.rank]),
                "grads_touched_in_b": sorted(touched),
            }
    return results


def _watch_b_ops(pipe) -> set[str]:
    """Names of parameters whose ``.grad`` a B op created or changed (filled in during the step)."""
    from zerobubble.schedule.ir import Kind

    executor, touched = pipe._executor, set()
    names = {id(p): n for n, p in pipe.named_parameters()}
    original = executor.handlers[Kind.B]

    def state_of(params):
        return [None if p.grad is None else (p.grad.data_ptr(), p.grad._version) for p in params]

    def watched_b(state, j):
        params = list(state.module.parameters())
        before = state_of(params)
        original(state, j)
        touched.update(names[id(p)] for p, a, b in zip(params, before, state_of(params)) if a != b)

    executor.handlers[Kind.B] = watched_b
    executor.compile()
    return touched
