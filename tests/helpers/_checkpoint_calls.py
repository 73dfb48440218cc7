"""Rank worker for tests/runtime/state/test_checkpoint_calls.py: checkpoints of a tied model against
the unpipelined model, and calls whose arguments differ between ranks (issue 25, items 6 and 7).

Everything runs in one spawn of two ranks; the worker returns plain numbers, strings and lists.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _safety import tied_layers as safety_tied_layers
from torch import nn

from zerobubble.runtime import PipelineError
from zerobubble.runtime.launch import init_distributed

WIDTH, VOCAB, SEQ = 8, 13, 3
TIED = ("0.embed.weight", "5.weight")  # the embedding's weight and the head's alias of it


class Embed(nn.Module):
    """An embedding with a persistent and a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.register_buffer("scale", torch.ones(WIDTH))
        self.register_buffer("cache", torch.zeros(2), persistent=False)

    def forward(self, tokens):
        return self.embed(tokens) * self.scale


class Block(nn.Module):
    """A residual block with a float and an integer buffer."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("shift", torch.zeros(WIDTH))
        self.register_buffer("version", torch.tensor(1, dtype=torch.int64))

    def forward(self, hidden):
        return hidden + torch.tanh(self.fc(self.norm(hidden))) + self.shift


def tied_layers(seed: int) -> list[nn.Module]:
    """The tied model of ``_safety`` with this module's buffered embedding and blocks."""
    return safety_tied_layers(seed, Embed, Block)


def token_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randint(VOCAB, (size, SEQ), generator=generator),
        torch.randint(VOCAB, (size, SEQ), generator=generator),
    )


def randomize_buffers(model: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for buffer in model.buffers():
        if buffer.is_floating_point():
            buffer.copy_(torch.rand(buffer.shape, generator=generator) + 0.5)
        else:
            buffer.copy_(torch.randint(2, 100, buffer.shape, generator=generator))


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.double().norm().item()
    return (actual.double() - expected.double()).norm().item() / (scale if scale > 0 else 1.0)


def _identical(first: dict, second: dict) -> bool:
    """Same keys in the same order, every value equal exactly (dtype and shape too)."""
    return list(first) == list(second) and all(
        first[k].dtype == second[k].dtype and torch.equal(first[k], second[k]) for k in first
    )


def _cpu(state: dict) -> dict:
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def _rank() -> int:
    return int(os.environ["RANK"])


def cases(directory: str) -> dict:
    """Every case of both items on this rank; ``directory`` is shared by the ranks (torch.save files)."""
    init_distributed(backend="gloo", timeout=60)
    out: dict = {}
    for name in ("1f1b", "interleaved-1f1b", "zb-v"):
        started = time.monotonic()
        out[name] = _checkpoint_cases(name, os.path.join(directory, name))
        out[name]["seconds"] = time.monotonic() - started
    started = time.monotonic()
    out["calls"] = _call_cases()
    out["calls seconds"] = time.monotonic() - started
    return out


# -- item 6: checkpoints ---------------------------------------------------------------------------------


def _checkpoint_cases(name: str, directory: str) -> dict:
    from zerobubble import Pipeline

    rank, out = _rank(), {}
    os.makedirs(directory, exist_ok=True)
    batches = [batch(8, seed) for seed in range(2)]
    reference = nn.Sequential(*tied_layers(0))
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    pipe = Pipeline(tied_layers(0), schedule=name, microbatches=4, loss_fn=token_loss, timeout=30)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.05)
    for inputs, targets in batches:
        reference_optimizer.zero_grad()
        token_loss(reference(inputs), targets).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        reference_optimizer.step()
        pipe.step(inputs, targets)
        pipe.optimizer_step(optimizer, max_norm=0.5)  # left pending: state_dict settles it
        optimizer.zero_grad(set_to_none=True)

    # pipe -> unpipelined: the union of the ranks' dicts, and full_state_dict, are the model's
    own = _cpu(pipe.state_dict())
    full = pipe.full_state_dict()
    gathered: list = [None, None]
    dist.all_gather_object(gathered, own)
    union = {k: v for state in gathered for k, v in state.items()}
    wanted = reference.state_dict()
    out["own keys"] = list(own)
    out["disjoint"] = not set(gathered[0]) & set(gathered[1])
    out["full is the union"] = _identical(full, {k: union[k] for k in full}) and set(full) == set(union)
    out["full keys"] = list(full) == list(wanted)
    live = pipe.state_dict()
    out["full holds copies"] = all(
        full[k].untyped_storage().data_ptr() != v.untyped_storage().data_ptr() for k, v in live.items()
    )
    out["trained"] = max(_relative(full[k], wanted[k]) for k in wanted)
    out["tied copies"] = torch.equal(full[TIED[0]], full[TIED[1]])
    fresh = nn.Sequential(*tied_layers(1))
    result = fresh.load_state_dict(full, strict=True)
    out["unpipelined strict load"] = (list(result.missing_keys), list(result.unexpected_keys))
    out["unpipelined round trip"] = _identical(fresh.state_dict(), full)
    fresh = nn.Sequential(*tied_layers(1))
    fresh.load_state_dict(union, strict=True)
    out["union strict load"] = _identical(fresh.state_dict(), full)

    # torch.save: each rank saves its own dict; every rank merges both files and reloads its own
    torch.save(pipe.state_dict(), os.path.join(directory, f"rank{rank}.pt"))
    dist.barrier()
    files = [torch.load(os.path.join(directory, f"rank{r}.pt"), weights_only=True) for r in range(2)]
    merged = {k: v for state in files for k, v in state.items()}
    out["saved files merge"] = _identical({k: merged[k] for k in full}, full) and set(merged) == set(full)
    result = pipe.load_state_dict(files[rank], strict=True)
    out["own file reloads"] = (list(result.missing_keys), list(result.unexpected_keys))
    out["own file unchanged"] = _identical(_cpu(pipe.state_dict()), own)
    dist.barrier()

    # unpipelined -> pipe: the model's full state dict loads with strict=True on every rank
    other = nn.Sequential(*tied_layers(2))
    randomize_buffers(other, seed=2)
    result = pipe.load_state_dict(other.state_dict(), strict=True)
    out["pipe strict load"] = (list(result.missing_keys), list(result.unexpected_keys))
    out["pipe round trip"] = _identical(pipe.full_state_dict(), other.state_dict())
    inputs, targets = batch(8, 5)
    loss = pipe.evaluate(inputs, targets)
    with torch.no_grad():
        expected = token_loss(other.eval()(inputs), targets).item()
    out["evaluate after load"] = None if loss is None else abs(loss.item() - expected) / expected
    other.train()
    pipe.zero_grad()
    pipe.step(inputs, targets)
    token_loss(other(inputs), targets).backward()
    grads = {n: p.grad for n, p in other.named_parameters(remove_duplicate=False)}
    out["grads after load"] = max(_relative(p.grad, grads[n]) for n, p in pipe.named_parameters())
    out["errors"] = _load_errors(pipe, other.state_dict())
    return out


def _load_errors(pipe, state: dict) -> dict:
    """Each bad checkpoint's outcome on this rank, and whether anything was loaded."""
    out: dict = {}
    before = _cpu(pipe.state_dict())
    shifted = {k: v + 1 if v.is_floating_point() else v for k, v in state.items()}

    def attempt(case: str, candidate: dict, strict: bool = True) -> None:
        started = time.monotonic()
        try:
            result = pipe.load_state_dict(candidate, strict=strict)
            out[case] = ("loaded", list(result.missing_keys), list(result.unexpected_keys))
        except PipelineError as error:
            out[case] = ("error", str(error), time.monotonic() - started)
        out[f"{case} unchanged"] = _identical(_cpu(pipe.state_dict()), before)
        pipe.load_state_dict(state)  # back to the known state for the next case

    attempt("missing", {k: v for k, v in shifted.items() if k != "2.fc.bias"})
    attempt("missing lenient", {k: v for k, v in shifted.items() if k != "2.fc.bias"}, strict=False)
    attempt("unexpected", {**shifted, "9.bogus": torch.zeros(1)})
    attempt("unexpected lenient", {**shifted, "9.bogus": torch.zeros(1)}, strict=False)
    attempt("tie conflict", {**shifted, TIED[1]: shifted[TIED[1]] + 1})
    attempt("shape", {**shifted, "1.fc.weight": torch.zeros(3, 3)})
    attempt("no alias", {k: v for k, v in shifted.items() if k != TIED[1]})
    pipe.load_state_dict({k: v for k, v in shifted.items() if k != TIED[1]})
    full = pipe.full_state_dict()
    out["no alias sets both copies"] = torch.equal(full[TIED[1]], shifted[TIED[0]]) and torch.equal(
        full[TIED[0]], shifted[TIED[0]]
    )
    return out


# -- item 7: calls whose arguments differ between ranks -------------------------------------------------


def _call_cases() -> dict:
    from zerobubble import Pipeline

    rank, out = _rank(), {}
    inputs, targets = batch(8, 7)
    big_inputs, big_targets = batch(16, 8)

    def attempt(pipe, case: str, run) -> None:
        started = time.monotonic()
        try:
            result = run(pipe)
            out[case] = f"no error: {result}"
        except PipelineError as error:
            out[case] = f"error after {time.monotonic() - started:.3f}s: {error}"

    pipe = Pipeline(tied_layers(3), schedule="1f1b", microbatches=4, loss_fn=token_loss, timeout=30)
    attempt(pipe, "no targets on the last rank", lambda p: p.step(inputs, targets if rank == 0 else None))
    attempt(pipe, "batch size", lambda p: p.step(*(batch(8, 7) if rank == 0 else (big_inputs, big_targets))))
    attempt(pipe, "dtype", lambda p: p.step(inputs if rank == 0 else inputs.int(), targets))
    attempt(pipe, "shape", lambda p: p.step(*(batch(8, 7) if rank == 0 else (inputs[:, :2], targets[:, :2]))))
    attempt(
        pipe,
        "step and evaluate",
        lambda p: p.step(inputs, targets) if rank == 0 else p.evaluate(inputs, targets),
    )
    attempt(pipe, "loss scale", lambda p: p.step(inputs, targets, loss_scale=None if rank == 0 else 1024.0))

    def under_no_grad(p):
        if rank == 1:
            with torch.no_grad():
                return p.step(inputs, targets)
        return p.step(inputs, targets)

    attempt(pipe, "no_grad on one rank", under_no_grad)
    attempt(
        pipe,
        "batch that does not split on one rank",
        lambda p: p.step(*((inputs[:6], targets[:6]) if rank == 0 else (inputs, targets))),
    )
    attempt(pipe, "dict on one rank", lambda p: p.step({"tokens": inputs} if rank == 0 else inputs, targets))
    attempt(pipe, "evaluate without targets", lambda p: p.evaluate(inputs, targets if rank == 0 else None))
    # what each rank needs only: inputs on the first stage, targets on the last (no error)
    attempt(
        pipe,
        "each rank its part",
        lambda p: p.step(inputs if rank == 0 else None, targets if rank == 1 else None),
    )

    # after every refused call, a correct step computes the unpipelined gradients
    reference = nn.Sequential(*tied_layers(3))
    token_loss(reference(inputs), targets).backward()
    grads = {n: p.grad for n, p in reference.named_parameters(remove_duplicate=False)}
    pipe.zero_grad()
    loss = pipe.step(inputs, targets)
    out["correct step after"] = max(_relative(p.grad, grads[n]) for n, p in pipe.named_parameters())
    out["loss after"] = None if loss is None else loss.item()

    # zb-v on 2 ranks: rank 0 holds the first and the last stage; pipe.step(x) everywhere
    pipe = Pipeline(tied_layers(3), schedule="zb-v", microbatches=4, loss_fn=token_loss, timeout=30)
    attempt(pipe, "zb-v without targets", lambda p: p.step(inputs))
    attempt(pipe, "zb-v correct step", lambda p: p.step(inputs, targets) is not None)

    # data parallelism: two replicas of a one-rank pipeline, the second with another batch size
    pipe = Pipeline(
        tied_layers(3), schedule="1f1b", microbatches=4, loss_fn=token_loss, timeout=30, data_parallel=2
    )
    attempt(
        pipe,
        "replica batch size",
        lambda p: p.step(*(batch(8, 7) if rank == 0 else (big_inputs, big_targets))),
    )
    attempt(pipe, "replica correct step", lambda p: round(p.step(inputs, targets).item(), 6))

    # check_calls=False: no per-call exchange (steps still run); a setting that differs is refused
    attempt(
        None,
        "without the check",
        lambda _: (
            Pipeline(
                tied_layers(3),
                schedule="1f1b",
                microbatches=4,
                loss_fn=token_loss,
                timeout=30,
                check_calls=False,
            ).step(inputs, targets)
            is not None
        ),
    )
    attempt(
        None,
        "check_calls differs",
        lambda _: Pipeline(
            tied_layers(3),
            schedule="1f1b",
            microbatches=4,
            loss_fn=token_loss,
            timeout=30,
            check_calls=rank == 0,
        ),
    )
    return out


def three_rank_exchange() -> dict:
    """The call check on 3 ranks (not a power of two: rank 2 folds into rank 0), without a Pipeline."""
    init_distributed(backend="gloo", timeout=60)
    from zerobubble.runtime.failures import PeerMonitor
    from zerobubble.runtime.parallel.consistency import CallCheck, CallSignature

    rank = _rank()
    group = dist.new_group([0, 1, 2], backend="gloo")
    check = CallCheck(group, PeerMonitor("three", rank, 10.0), "rank {}".format)
    same = CallSignature("step", 1.0, (((8, 3), "int64"),), None)
    other = CallSignature("step", 1.0, (((4, 3), "int64"),), None)
    failed = CallSignature("step", problem="a local error")
    values = check._max_reduce(torch.tensor([rank, 10 - rank, -rank], dtype=torch.int64), "values")
    started = time.monotonic()
    out = {
        "max": values.tolist(),
        "same": check.exchange(same),
        "rank 2 differs": check.exchange(other if rank == 2 else same),
        "rank 1 fails": check.exchange(failed if rank == 1 else same),
        "only rank 2 passes inputs": check.exchange(same if rank == 2 else CallSignature("step", 1.0)),
        "again": check.exchange(same),
    }
    out["seconds"] = time.monotonic() - started
    return out
