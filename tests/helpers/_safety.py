"""Rank workers for tests/runtime/test_runtime_safety.py: mixed precision, tied weights, consistency checks,
evaluation, RNG streams, settled checkpoints, error propagation and the small input cases.

Each worker runs many cases in one spawn and returns plain numbers and strings.
"""

from __future__ import annotations

import copy
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from zerobubble.runtime import PipelineError
from zerobubble.runtime.launch import init_distributed

WIDTH, VOCAB, SEQ = 8, 13, 3


def _rank() -> int:
    return int(os.environ["RANK"])


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.float().norm().item()
    return (actual.float() - expected.float()).norm().item() / (scale if scale > 0 else 1.0)


def mlp_layers(seed: int, count: int = 4) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [
        nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        for _ in range(count)
    ]


def _run_reference(layers, inputs, targets, loss_fn, autocast: bool = False):
    model = nn.Sequential(*layers)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = loss_fn(model(inputs), targets)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _grad_errors(pipe, expected: dict[str, torch.Tensor]) -> float:
    return max((_relative(p.grad, expected[n]) for n, p in pipe.named_parameters()), default=0.0)


# -- mixed precision ---------------------------------------------------------------------------------


def precision_cases(schedules: list[str]) -> dict:
    """Gradient errors under CPU bf16 autocast and with bf16 weights; loss scaling; overflow skips."""
    init_distributed(backend="gloo", timeout=60)
    from zerobubble import Pipeline

    generator = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(16, WIDTH, generator=generator), torch.randn(16, WIDTH, generator=generator)
    out: dict = {}
    for name in schedules:
        _, expected = _run_reference(mlp_layers(0), inputs, targets, F.mse_loss, autocast=True)
        pipe = Pipeline(mlp_layers(0), schedule=name, microbatches=4, loss_fn=F.mse_loss, timeout=30)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pipe.step(inputs, targets)
        dtypes = {str(p.grad.dtype) for p in pipe.parameters()}
        out[f"autocast {name}"] = (_grad_errors(pipe, expected), sorted(dtypes))

        layers = [layer.to(torch.bfloat16) for layer in mlp_layers(0)]
        _, expected = _run_reference(copy.deepcopy(layers), inputs.bfloat16(), targets.bfloat16(), F.mse_loss)
        pipe = Pipeline(layers, schedule=name, microbatches=4, loss_fn=F.mse_loss, timeout=30)
        pipe.step(inputs.bfloat16(), targets.bfloat16())
        out[f"bf16 {name}"] = _grad_errors(pipe, expected)
    out["loss scaling"] = _loss_scaling(inputs, targets)
    return out


def _loss_scaling(inputs, targets) -> dict:
    """A scaled loss + unscale gives the unscaled run's parameters; an overflow skips everywhere."""
    from zerobubble import Pipeline

    params = []
    for scale in (None, 1024.0):
        pipe = Pipeline(mlp_layers(0), schedule="zb-h1", microbatches=4, loss_fn=F.mse_loss, timeout=30)
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pipe.step(inputs, targets, loss_scale=scale)
        pipe.optimizer_step(optimizer, max_norm=10.0, unscale=scale)
        pipe.synchronize()
        params.append([p.detach().clone() for p in pipe.parameters()])
    overflow = Pipeline(mlp_layers(0), schedule="zb-h1", microbatches=4, loss_fn=F.mse_loss, timeout=30)
    optimizer = torch.optim.SGD(overflow.parameters(), lr=0.1)
    before = [p.detach().clone() for p in overflow.parameters()]
    overflow.step(inputs, targets, loss_scale=1e40)  # 1e40 / m overflows float32
    overflow.optimizer_step(optimizer, max_norm=10.0, unscale=1e40)
    overflow.synchronize()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, overflow.parameters()))
    return {
        "scaled vs unscaled": max(_relative(a, b) for a, b in zip(params[1], params[0])),
        "overflow skipped": overflow.optimizer_stats.skipped,
        "overflow unchanged": unchanged,
    }


# -- tied weights ------------------------------------------------------------------------------------


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)

    def forward(self, tokens):
        return self.embed(tokens)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, hidden):
        return hidden + torch.tanh(self.fc(hidden))


class TiedHead(nn.Module):
    """Projects to the vocabulary with the embedding's weight (tied, as GPT-2 does)."""

    def __init__(self, embed: nn.Module):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.weight = embed.embed.weight

    def forward(self, hidden):
        return F.linear(self.norm(hidden), self.weight)


def tied_layers(
    seed: int, embed_type: type[nn.Module] = Embed, block_type: type[nn.Module] = Block
) -> list[nn.Module]:
    """An embedding, four blocks and a head tied to the embedding (``embed_type`` has ``.embed``)."""
    torch.manual_seed(seed)
    embed = embed_type()
    return [embed, *(block_type() for _ in range(4)), TiedHead(embed)]


TIED_NAMES = ("0.embed.weight", "5.weight")


def token_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tied_cases(schedules: list[str]) -> dict:
    """Gradients and parameters after 3 AdamW steps against the unpipelined tied model."""
    init_distributed(backend="gloo", timeout=60)
    from zerobubble import Pipeline

    generator = torch.Generator().manual_seed(2)
    batches = [
        (
            torch.randint(VOCAB, (8, SEQ), generator=generator),
            torch.randint(VOCAB, (8, SEQ), generator=generator),
        )
        for _ in range(3)
    ]
    out: dict = {}
    for name in schedules:
        reference = nn.Sequential(*tied_layers(0))
        ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
        pipe = Pipeline(tied_layers(0), schedule=name, microbatches=4, loss_fn=token_loss, timeout=30)
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.05)
        first_grads = None
        for inputs, targets in batches:
            ref_optimizer.zero_grad()
            token_loss(reference(inputs), targets).backward()
            pipe.step(inputs, targets)
            if first_grads is None:
                grads = dict(reference.named_parameters(remove_duplicate=False))
                first_grads = max(_relative(p.grad, grads[n].grad) for n, p in pipe.named_parameters())
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)  # counts the tied weight once
            ref_optimizer.step()
            pipe.optimizer_step(optimizer, max_norm=0.5)
            optimizer.zero_grad(set_to_none=True)
        state = pipe.state_dict()
        wanted = reference.state_dict()
        out[name] = {
            "grads": first_grads,
            "params": max(_relative(v, wanted[k]) for k, v in state.items()),
            "state_keys": sorted(state),
            "clipped": pipe.optimizer_stats.clipped,
            "tied_copy": next(
                (float(p.detach().double().sum()) for n, p in pipe.named_parameters() if n in TIED_NAMES),
                None,
            ),
        }
    return out


# -- construction checks, data-parallel broadcast -----------------------------------------------------


def construction_cases(cases: list[str]) -> dict:
    """Each case's PipelineError message (or the measured outcome) on this rank."""
    init_distributed(backend="gloo", timeout=60)
    from zerobubble import Pipeline

    rank, out = _rank(), {}
    for case in cases:
        started = time.monotonic()
        try:
            if case == "layer count":
                Pipeline(
                    mlp_layers(0, 4 + rank), schedule="1f1b", microbatches=2, loss_fn=F.mse_loss, timeout=5
                )
            elif case == "parameter shape":
                layers = mlp_layers(0)
                if rank == 1:
                    layers[2] = nn.Sequential(
                        nn.Linear(WIDTH, 3 * WIDTH), nn.GELU(), nn.Linear(3 * WIDTH, WIDTH)
                    )
                Pipeline(layers, schedule="1f1b", microbatches=2, loss_fn=F.mse_loss, timeout=5)
            elif case == "microbatches":
                Pipeline(
                    mlp_layers(0), schedule="zb-h1", microbatches=4 + 2 * rank, loss_fn=F.mse_loss, timeout=5
                )
            elif case == "bad argument on one rank":
                Pipeline(
                    mlp_layers(0),
                    schedule="1f1b" if rank == 0 else "nope",
                    microbatches=2,
                    loss_fn=F.mse_loss,
                )
            elif case == "data-parallel broadcast":
                torch.manual_seed(100 + rank)  # per-rank seeding: different initial weights
                layers = [nn.Linear(WIDTH, WIDTH) for _ in range(2)]
                pipe = Pipeline(layers, schedule="1f1b", microbatches=2, loss_fn=F.mse_loss, data_parallel=2)
                out[case] = [float(p.detach().double().sum()) for p in pipe.parameters()]
                continue
            else:
                raise ValueError(case)
            out[case] = "no error"
        except PipelineError as error:
            out[case] = f"after {time.monotonic() - started:.1f}s: {error}"
    return out


# -- evaluation, RNG streams, settled checkpoints, small cases ----------------------------------------


class Noise(nn.Module):
    """Dropout whose masks are recorded, to compare the streams of two stages."""

    def __init__(self):
        super().__init__()
        self.dropout = nn.Dropout(0.5)
        self.masks: list[torch.Tensor] = []

    def forward(self, hidden):
        out = self.dropout(hidden)
        if self.training and torch.is_grad_enabled():
            self.masks.append((out != 0).flatten())
        return out


def noisy_layers(seed: int) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Linear(WIDTH, WIDTH), Noise(), nn.Linear(WIDTH, WIDTH), Noise()]


def behaviour_cases() -> dict:
    init_distributed(backend="gloo", timeout=60)
    from zerobubble import Pipeline

    out: dict = {}
    generator = torch.Generator().manual_seed(3)
    inputs, targets = torch.ones(16, WIDTH), torch.randn(16, WIDTH, generator=generator)

    # RNG: the masks of stage 0 (rank 0) and stage 1 (rank 1) for the first microbatch, and the
    # gradients of two schedules of the same placement
    masks, grads = {}, {}
    for name in ("1f1b", "zb-h1", "zb-v", "v-half"):
        torch.manual_seed(7)
        layers = noisy_layers(0)
        pipe = Pipeline(layers, schedule=name, microbatches=4, loss_fn=F.mse_loss, timeout=30)
        pipe.step(inputs, targets)
        held = [layer for layer in layers if isinstance(layer, Noise) and layer.masks]
        masks[name] = held[0].masks[0].tolist()
        grads[name] = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    out["masks"] = masks
    out["same placement"] = {
        pair: max((grads[pair[0]][n] - grads[pair[1]][n]).abs().max().item() for n in grads[pair[0]])
        for pair in (("1f1b", "zb-h1"), ("zb-v", "v-half"))
    }

    # evaluate(): forward only, in eval mode, no .grad change, works under no_grad
    layers = noisy_layers(0)
    reference = copy.deepcopy(nn.Sequential(*layers)).eval()
    pipe = Pipeline(layers, schedule="zb-v", microbatches=4, loss_fn=F.mse_loss, timeout=30)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    pipe.step(inputs, targets)
    pipe.optimizer_step(optimizer, max_norm=1e-3)
    pipe.synchronize()  # clipping scales .grad in place when the step settles
    grads_before = [p.grad.clone() for p in pipe.parameters()]
    with torch.no_grad():
        loss = pipe.evaluate(inputs[:8], targets[:8])  # another batch size than training's
    grads_after = [p.grad for p in pipe.parameters()]
    states: list = [None, None]
    torch.distributed.all_gather_object(states, pipe.state_dict())
    reference.load_state_dict({k: v for state in states for k, v in state.items()})
    with torch.no_grad():
        expected = F.mse_loss(reference(inputs[:8]), targets[:8]).item()
    out["evaluate"] = {
        "loss error": None if loss is None else abs(float(loss) - expected) / expected,
        "grads unchanged": all(torch.equal(a, b) for a, b in zip(grads_before, grads_after)),
        "training restored": all(m.training for m in pipe.module.modules()),
    }
    pipe.step(inputs, targets)  # training goes on after an evaluation (shapes of training kept)
    try:
        with torch.no_grad():
            pipe.step(inputs, targets)
        out["step under no_grad"] = "no error"
    except PipelineError as error:
        out["step under no_grad"] = str(error)
    out["state after clipped step"] = _settled_state_dict()
    out["small cases"] = _small_cases()
    return out


def _settled_state_dict() -> dict:
    """state_dict() right after a clipped (deferred) optimizer_step: the stepped weights."""
    from zerobubble import Pipeline

    generator = torch.Generator().manual_seed(4)
    inputs, targets = torch.randn(8, WIDTH, generator=generator), torch.randn(8, WIDTH, generator=generator)
    reference = nn.Sequential(*mlp_layers(5))
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1)
    F.mse_loss(reference(inputs), targets).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e-3)
    reference_optimizer.step()
    pipe = Pipeline(mlp_layers(5), schedule="zb-h1", microbatches=4, loss_fn=F.mse_loss, timeout=30)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.1)
    pipe.step(inputs, targets)
    pipe.optimizer_step(optimizer, max_norm=1e-3)
    state = pipe.state_dict()  # no synchronize() before it
    wanted = reference.state_dict()
    return {"error": max(_relative(v, wanted[k]) for k, v in state.items())}


class Raises(nn.Module):
    def forward(self, hidden):
        raise ValueError("boom from a layer")


class Tagged(nn.Module):
    def forward(self, hidden):
        return hidden, "a tag"


class Untag(nn.Module):
    def forward(self, hidden, tag):
        return hidden


class Scale(nn.Module):
    def forward(self, hidden):
        return hidden * 2.0


def _small_cases() -> dict:
    from zerobubble import Pipeline

    rank, out = _rank(), {}
    inputs, targets = torch.randn(8, WIDTH), torch.randn(8, WIDTH)

    def attempt(case, make, run):
        try:
            pipe = make()
            out[case] = run(pipe)
        except PipelineError as error:
            out[case] = str(error)

    options = {"microbatches": 4, "loss_fn": F.mse_loss, "timeout": 10}
    attempt(
        "dict inputs",
        lambda: Pipeline(mlp_layers(0), schedule="1f1b", **options),
        lambda pipe: pipe.step({"x": inputs} if rank == 0 else None, targets),
    )
    attempt(
        "empty batch",
        lambda: Pipeline(mlp_layers(0), schedule="1f1b", **options),
        lambda pipe: pipe.step(inputs[:0], targets[:0]),
    )
    attempt(
        "non-tensor output",
        lambda: Pipeline(
            [nn.Linear(WIDTH, WIDTH), Tagged(), Untag(), nn.Linear(WIDTH, WIDTH)], schedule="1f1b", **options
        ),
        lambda pipe: pipe.step(inputs, targets),
    )

    def no_parameters(pipe):
        optimizer = torch.optim.SGD(list(pipe.parameters()), lr=0.1) if list(pipe.parameters()) else None
        pipe.step(inputs, targets)
        pipe.optimizer_step(optimizer, max_norm=1.0)
        pipe.synchronize()
        return f"stepped {pipe.optimizer_stats.steps}"

    attempt(
        "rank without parameters",
        lambda: Pipeline([nn.Linear(WIDTH, WIDTH), Scale()], schedule="1f1b", partition=[1], **options),
        no_parameters,
    )
    attempt(
        "layer error",
        lambda: Pipeline([nn.Linear(WIDTH, WIDTH), Raises()], schedule="1f1b", partition=[1], **options),
        lambda pipe: pipe.step(inputs, targets),
    )
    return out


# -- errors travel -------------------------------------------------------------------------------------


class FailsOnRankOne(nn.Module):
    """Raises in its forward on the given step (the process lives on, as a script that logs would)."""

    def __init__(self, step: int):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.calls = 0
        self.step = step

    def forward(self, hidden):
        self.calls += 1
        if self.calls > 4 * self.step:
            raise RuntimeError("CUDA out of memory (simulated) in the middle layer")
        return self.fc(hidden)


def failure_cases(world: int) -> dict:
    """A rank that fails and stays alive; an optimizer that raises; waits that honour ``timeout``."""
    init_distributed(backend="gloo", timeout=60)
    from zerobubble import Pipeline

    rank, out = _rank(), {}
    inputs, targets = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    timeout = 30.0  # far above the few seconds the failure may take to reach the peers

    # 1. a forward error on the last rank, in the second step; every process lives on
    layers = [nn.Linear(WIDTH, WIDTH) for _ in range(world - 1)] + [FailsOnRankOne(step=1)]
    # the layer counts its forwards: no split guard, whose check would add two
    options = {"loss_fn": F.mse_loss, "timeout": timeout, "verify": False}
    pipe = Pipeline(layers, schedule="1f1b", microbatches=4, **options)
    pipe.step(inputs, targets)
    started = time.monotonic()
    try:
        pipe.step(inputs, targets)
        out["step"] = "no error"
    except (PipelineError, RuntimeError) as error:
        out["step"] = f"after {time.monotonic() - started:.1f}s: {error}"
    try:
        pipe.step(inputs, targets)
        out["again"] = "no error"
    except PipelineError as error:
        out["again"] = str(error)

    # 2. the optimizer of the last rank raises
    pipe = Pipeline(
        mlp_layers(0, world), schedule="zb-h1", microbatches=4, loss_fn=F.mse_loss, timeout=timeout
    )
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    if rank == world - 1:

        def broken_step(*args, **kwargs):
            raise RuntimeError("optimizer state corrupted (simulated)")

        optimizer.step = broken_step  # type: ignore[method-assign]
    pipe.step(inputs, targets)
    started = time.monotonic()
    try:
        pipe.optimizer_step(optimizer, max_norm=1.0)
        pipe.synchronize()
        pipe.step(inputs, targets)
        out["optimizer"] = "no error"
    except (PipelineError, RuntimeError) as error:
        out["optimizer"] = f"after {time.monotonic() - started:.1f}s: {error}"

    # 3. synchronize() waits no longer than timeout= (rank 0 waits for a rank that stalls)
    pipe = Pipeline(mlp_layers(0, world), schedule="zb-h1", microbatches=4, loss_fn=F.mse_loss, timeout=1.5)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    pipe.step(inputs, targets)
    started = time.monotonic()
    try:
        if rank == 0:
            pipe.optimizer_step(optimizer, max_norm=1.0)
            pipe.synchronize()
        else:
            time.sleep(4)
        out["stalled optimizer"] = "no error"
    except PipelineError as error:
        out["stalled optimizer"] = f"after {time.monotonic() - started:.1f}s: {error}"
    return out
