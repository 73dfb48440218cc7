"""Rank worker of tests/runtime/construct/test_auto_pipeline.py (module-level: spawned ranks import it)."""

from __future__ import annotations

from _dist import reference, relative_error, rich_batch, rich_layers, token_loss

from zerobubble.runtime import PipelineError
from zerobubble.runtime.launch import init_distributed


def auto_cases() -> dict:
    """schedule="auto" on this rank: gradient errors against one process, the plan, and the errors."""
    init_distributed(backend="gloo", timeout=60)
    from zerobubble import Pipeline

    inputs, targets = rich_batch(8, seed=3)
    expected_loss, expected_grads = reference(rich_layers(seed=3), inputs, targets)
    pipe = Pipeline(
        rich_layers(seed=3),
        schedule="auto",
        microbatches=4,
        loss_fn=token_loss,
        memory_limit="1GiB",
        example=(inputs, targets),
        timeout=60,
        calibrate=1,
    )
    loss = pipe.step(inputs, targets)
    result = {
        "loss": None if loss is None else abs(loss.item() - expected_loss) / abs(expected_loss),
        "grads": {n: relative_error(p.grad, expected_grads[n]) for n, p in pipe.named_parameters()},
        "schedule": pipe.schedule.name,
        "partition": list(pipe.plan.partition),
        "plan_schedule": pipe.plan.winner.schedule,
        "reason": pipe.plan.reason,
        "layers": len(pipe.profile.layers),
        "calibrated_after_first_step": pipe.plan.calibration is not None,
    }
    # the second step is recorded and calibrates the plan; its gradients must be exact too
    pipe.zero_grad()
    loss = pipe.step(inputs, targets)
    calibration = pipe.plan.calibration
    result.update(
        {
            "loss_after_calibration": None
            if loss is None
            else abs(loss.item() - expected_loss) / abs(expected_loss),
            "grads_after_calibration": {
                n: relative_error(p.grad, expected_grads[n]) for n, p in pipe.named_parameters()
            },
            "calibration": None if calibration is None else calibration.to_dict(),
            "recorder_detached": pipe.recorder is None,
            "schedule_after_calibration": pipe.schedule.name,
        }
    )
    # a named schedule cut where the profile says: the planner restricted to that schedule
    named = Pipeline(
        rich_layers(seed=3),
        schedule="zb-v",
        partition="profile",
        microbatches=4,
        loss_fn=token_loss,
        example=(inputs, targets),
        timeout=60,
        calibrate=0,
    )
    loss = named.step(inputs, targets)
    result["profiled"] = {
        "schedule": named.schedule.name,
        "partition": list(named.plan.partition),
        "bounds": list(named.layer_bounds[1:-1]),
        "candidates": sorted({candidate.schedule for candidate in named.plan.candidates}),
        "loss": None if loss is None else abs(loss.item() - expected_loss) / abs(expected_loss),
        "grads": {n: relative_error(p.grad, expected_grads[n]) for n, p in named.named_parameters()},
    }
    for case, options in {
        "partition_word": {"schedule": "zb-v", "partition": "even", "example": (inputs, targets)},
        "profile_with_auto": {"schedule": "auto", "partition": "profile", "example": (inputs, targets)},
    }.items():
        try:
            Pipeline(rich_layers(0), microbatches=4, loss_fn=token_loss, timeout=30, **options)
            result[case] = "no error"
        except PipelineError as error:
            result[case] = str(error)
    for case, options in {
        "too_small": {"memory_limit": "2KiB", "example": (inputs, targets)},
        "no_example": {"memory_limit": None, "example": None},
    }.items():
        try:
            Pipeline(
                rich_layers(0), schedule="auto", microbatches=4, loss_fn=token_loss, timeout=30, **options
            )
            result[case] = "no error"
        except PipelineError as error:
            result[case] = str(error)
    return result
