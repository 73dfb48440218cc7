"""Helpers for the runtime tests: test models, a reference backward, rank workers, a one-rank comm.

Workers are module-level functions so spawned ranks can import them; each runs many cases in one
spawn (the machine has two cores) and returns plain Python numbers to the parent.
"""

from __future__ import annotations

import functools
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zerobubble.runtime import PipelineError
from zerobubble.runtime.failures import PeerMonitor
from zerobubble.runtime.launch import init_distributed, launch
from zerobubble.schedule import REGISTRY, build_schedule

VOCAB, WIDTH, SEQ = 11, 8, 3


#: Every registry schedule the runtime tests run; zb-ilp is left out because solving its integer program
#: on every rank of every case would dominate the suite (its schedules are validated in test_ilp.py).
RUNTIME_SCHEDULES = [name for name in REGISTRY if name != "zb-ilp"]


class LocalComm:
    """What a one-rank executor needs of its channels: its device; nothing crosses a rank."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.monitor = PeerMonitor(None, 0, 1.0)

    def start_step(self, first: bool, forward_only: bool = False) -> None:
        pass

    def finish_step(self) -> None:
        pass

    def abort_step(self) -> None:
        pass


class DistSpy:
    """Wraps the named ``torch.distributed`` functions inside a ``with`` block: :meth:`seen` is told
    of every call (name, args, kwargs) before the call itself runs."""

    def __init__(self, names):
        self._originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

    def seen(self, name: str, args: tuple, kwargs: dict) -> None:
        raise NotImplementedError

    def __enter__(self):
        for name, function in self._originals.items():
            setattr(dist, name, self._wrap(name, function))
        return self

    def __exit__(self, *exc):
        for name, function in self._originals.items():
            setattr(dist, name, function)

    def _wrap(self, name, function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            self.seen(name, args, kwargs)
            return function(*args, **kwargs)

        return wrapper


def run_ranks(fn, world_size: int, *args, timeout: float = 170.0, start_method: str | None = None) -> list:
    """``fn(*args)`` on ``world_size`` new gloo ranks (one thread each); per-rank results.  They
    fork from a server that imported torch once (``conftest.py``), unless ``start_method="spawn"``."""
    return launch(fn, world_size, args, threads=1, timeout=timeout, start_method=start_method)


# -- test models ------------------------------------------------------------------------------------


class TokenEmbed(nn.Module):
    """int tokens -> (hidden, skip, tokens): a tuple with a float skip path and an int tensor."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)

    def forward(self, tokens):
        hidden = self.embed(tokens)
        return hidden, hidden * 0.5, tokens


class LinearNorm(nn.Module):
    """Linear + LayerNorm on the hidden path; the skip path picks up a scaled copy."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, hidden, skip, tokens):
        hidden = self.norm(torch.tanh(self.fc(hidden))) + skip
        return hidden, skip + 0.1 * hidden, tokens


class AddmmProjection(nn.Module):
    """A projection whose weight is used through torch.addmm (not nn.Linear)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)
        self.bias = nn.Parameter(torch.randn(WIDTH) * 0.1)

    def forward(self, hidden, skip, tokens):
        flat = torch.addmm(self.bias, hidden.reshape(-1, WIDTH), self.weight)
        return flat.view_as(hidden) + skip, skip, tokens


class OutputHead(nn.Module):
    """Merges the tuple and projects to logits (a Linear without bias)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, hidden, skip, tokens):
        return self.head(self.norm(hidden + skip)) + 0.01 * tokens.unsqueeze(-1).float()


def rich_layers(seed: int) -> list[nn.Module]:
    """Eight layers passing tuples, with Embedding, LayerNorm, Linear and addmm parameters."""
    torch.manual_seed(seed)
    middle = [LinearNorm() if i % 3 != 1 else AddmmProjection() for i in range(6)]
    return [TokenEmbed(), *middle, OutputHead()]


def token_loss(logits, targets):
    """Mean cross-entropy over all positions."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def rich_batch(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens and targets for :func:`rich_layers`."""
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randint(VOCAB, (batch, SEQ), generator=generator),
        torch.randint(VOCAB, (batch, SEQ), generator=generator),
    )


def reference(layers: list[nn.Module], inputs, targets) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of the whole model on the whole batch, plain autograd."""
    values = inputs
    for layer in layers:
        values = layer(*values) if isinstance(values, tuple) else layer(values)
    loss = token_loss(values, targets)
    loss.backward()
    model = nn.Sequential(*layers)
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``‖actual − expected‖ / ‖expected‖`` (absolute when the expectation is zero)."""
    scale = expected.norm().item()
    return (actual - expected).norm().item() / (scale if scale > 0 else 1.0)


# -- rank workers ----------------------------------------------------------------------------------


def gradient_cases(cases: list[tuple]) -> dict:
    """Errors of loss and gradients for each ``(schedule, microbatches, chunks, partition[, static_shapes])``.

    Returns ``{case index: {"loss": rel error or None, "grads": {name: rel error}}}``; a case the
    builder refuses raises, so a planned case can never pass by being skipped.
    """
    init_distributed(backend="gloo", timeout=60)
    from zerobubble import Pipeline

    results = {}
    for index, (name, microbatches, chunks, partition, *static) in enumerate(cases):
        inputs, targets = rich_batch(2 * microbatches, seed=index)
        expected_loss, expected_grads = reference(rich_layers(seed=index), inputs, targets)
        schedule = name
        if name.startswith("object:"):  # a Schedule object instead of a registry name
            schedule = build_schedule(name.split(":", 1)[1], int(os.environ["WORLD_SIZE"]), microbatches)
        pipe = Pipeline(
            rich_layers(seed=index),
            schedule=schedule,
            microbatches=microbatches,
            loss_fn=token_loss,
            chunks=chunks,
            partition=partition,
            timeout=60,
            static_shapes=static[0] if static else True,
        )
        loss = pipe.step(inputs, targets)
        grads = {n: relative_error(p.grad, expected_grads[n]) for n, p in pipe.named_parameters()}
        results[index] = {
            "loss": None if loss is None else abs(loss.item() - expected_loss) / abs(expected_loss),
            "grads": grads,
            "second_step": _second_step_error(pipe, inputs, targets, expected_grads),
            "recorded": pipe.recorder.counts,
            "leftover": sum(
                len(state.saved) + len(state.store.pending_keys()) for state in pipe._executor.stages.values()
            ),
            "program_length": len(pipe.schedule.programs[pipe.rank]),
            "state_keys": list(pipe.state_dict()),
            "loaded": _load_error(pipe, index),
            "expected_state_keys": [
                k
                for k in nn.Sequential(*rich_layers(index)).state_dict()
                if k.split(".")[0] in {n.split(".")[0] for n, _ in pipe.named_parameters()}
            ],
        }
    return results


def _load_error(pipe, seed: int) -> float:
    """Loading a whole-model checkpoint sets exactly this rank's parameters (largest difference)."""
    other = nn.Sequential(*rich_layers(seed + 1000))
    pipe.load_state_dict(other.state_dict())
    wanted = dict(other.named_parameters())
    return max((float((p - wanted[n]).abs().max()) for n, p in pipe.named_parameters()), default=0.0)


class CountingRecorder:
    """Counts the ops and transfer waits the executor reports."""

    def __init__(self):
        self.counts = {"ops": 0, "waits": 0, "negative": 0}

    def op(self, op, start: float, end: float) -> None:
        self.counts["ops"] += 1
        self.counts["negative"] += end < start

    def wait(self, key, start: float, end: float) -> None:
        self.counts["waits"] += 1
        self.counts["negative"] += end < start


def _second_step_error(pipe, inputs, targets, expected_grads) -> float:
    """A second step (cached shapes, prefetched receives, a recorder) on zeroed grads: same gradients."""
    pipe.zero_grad()
    pipe.recorder = CountingRecorder()
    pipe.step(inputs, targets)
    return max((relative_error(p.grad, expected_grads[n]) for n, p in pipe.named_parameters()), default=0.0)


def error_cases(cases: list[str]) -> dict[str, str]:
    """Provoke each user error in turn; return each case's PipelineError message (or 'no error').

    Cases where only one rank fails leave the others waiting: they give up after the short
    pipeline timeout and go on with the next case on fresh channels.
    """
    init_distributed(backend="gloo", timeout=30)
    return {case: _error_case(case) for case in cases}


def _error_case(case: str) -> str:
    from zerobubble import Pipeline

    rank = int(os.environ["RANK"])
    inputs, targets = rich_batch(8, seed=0)
    # no split guard: its check before a stage's first forward would count against the 2 s waits
    options = {"loss_fn": token_loss, "timeout": 2, "verify": False}
    try:
        if case == "world_size":
            Pipeline(rich_layers(0), schedule=build_schedule("1f1b", 4, 4), **options)
        elif case == "batch_split":
            Pipeline(rich_layers(0), schedule="1f1b", microbatches=3, **options).step(inputs, targets)
        elif case == "invalid_schedule":
            good = build_schedule("1f1b", 2, 4)
            bad = type(good)(
                good.name, good.placement, good.microbatches, (good.programs[0], good.programs[1][1:])
            )
            Pipeline(rich_layers(0), schedule=bad, **options)
        elif case == "loss_not_scalar":
            options["loss_fn"] = lambda out, tgt: F.cross_entropy(
                out.flatten(0, 1), tgt.flatten(), reduction="none"
            )
            Pipeline(rich_layers(0), schedule="1f1b", microbatches=4, **options).step(inputs, targets)
        elif case == "shape_mismatch":
            layers = [nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(2 * WIDTH, VOCAB)]
            Pipeline(layers, schedule="1f1b", microbatches=4, partition=[2], **options).step(inputs, targets)
        elif case == "dtype_mismatch":
            layers = [nn.Embedding(VOCAB, WIDTH).double(), nn.Linear(WIDTH, VOCAB)]
            Pipeline(layers, schedule="zb-h1", microbatches=4, **options).step(inputs, targets)
        elif case == "shape_changed":
            pipe = Pipeline(rich_layers(0), schedule="1f1b", microbatches=4, **options)
            pipe.step(inputs, targets)
            pipe.step(*rich_batch(16, seed=1))
        elif case == "ddp_layer":  # only rank 1 wraps a layer: every rank must still raise
            layers = rich_layers(0)
            alone = torch.distributed.new_group([1])  # collective: every rank makes it
            if rank == 1:
                layers[1] = nn.parallel.DistributedDataParallel(layers[1], process_group=alone)
            Pipeline(layers, schedule="zb-h1", microbatches=4, **options)
        elif case == "dtensor_layer":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import distribute_module

            layers = rich_layers(0)
            mesh = init_device_mesh("cpu", (2,))
            layers[1] = distribute_module(layers[1], mesh)  # replicated DTensor parameters
            Pipeline(layers, schedule="zb-h1", microbatches=4, **options)
        elif case in ("stalled_rank", "killed_rank"):
            pipe = Pipeline(rich_layers(0), schedule="1f1b", microbatches=4, **options)
            pipe.step(inputs, targets)
            if rank == 1:
                if case == "killed_rank":  # dies while rank 0 waits (within its 2 s timeout)
                    time.sleep(0.5)
                    os._exit(3)
                time.sleep(5)
            started = time.monotonic()
            try:
                pipe.step(inputs, targets)
            except PipelineError as error:
                return f"after {time.monotonic() - started:.1f}s: {error}"
        else:
            raise ValueError(f"unknown error case {case!r}")
    except PipelineError as error:
        return str(error)
    return "no error"


def held_sends(cases: list[tuple[str, int]]) -> dict:
    """Rank worker: per ``(schedule, m)``, the most sends the channels hold after any op of a step
    (the second: no headers), and the storage bytes behind each loss the step returns."""
    import torch.nn.functional as F
    from _memory import mlp_blocks

    from zerobubble.runtime.pipeline import Pipeline

    init_distributed(backend="gloo", timeout=60)
    results = {}
    for name, m in cases:
        pipe = Pipeline(mlp_blocks(0), schedule=name, microbatches=m, loss_fn=F.mse_loss, timeout=60)
        inputs, targets = torch.randn(4 * m, 16), torch.randn(4 * m, 16)
        pipe.step(inputs, targets)
        counter = _SendCounter(pipe._executor.comm)
        pipe.recorder = counter
        pipe.step(inputs, targets)
        losses = pipe._executor._losses  # the step's per-microbatch losses (the last stage's rank)
        sizes = [t.untyped_storage().nbytes() for t in losses]
        results[(name, m)] = {"held": max(counter.counts), "loss bytes": sizes}
    return results


class _SendCounter:
    """A recorder noting after every op how many sends ``comm`` still holds."""

    def __init__(self, comm):
        self.comm, self.counts = comm, []

    def op(self, op, start, end):
        self.counts.append(len(self.comm._sends))

    def wait(self, key, start, end):
        pass
