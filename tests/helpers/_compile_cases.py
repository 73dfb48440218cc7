"""Rank worker of ``test_compile.py``: compiled layers in a Pipeline, float64, one spawn for all cases."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _wgrad_models import _watch_b_ops
from torch import nn

from zerobubble.runtime.launch import init_distributed

WIDTH = 8


class Block(nn.Module):
    """A pre-norm MLP block: LayerNorm, two Linears, GELU and a residual (pointwise ops to fuse)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def blocks(seed: int) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [Block().double() for _ in range(4)]


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def _compiled(how: str, layers: list[nn.Module], options: dict) -> tuple[list[nn.Module], dict]:
    """The layers as the case compiles them, and the Pipeline keywords."""
    if how == "inplace":  # the user's layer.compile(), on layers 1 and 2 only: the others stay split
        for layer in layers[1:3]:
            layer.compile(**options)
        return layers, {}
    if how == "optimized":  # torch.compile(layer): OptimizedModules, names with _orig_mod.
        return [torch.compile(layer, **options) for layer in layers], {}
    return layers, {"compile": options or True}  # Pipeline(compile=...)


def compile_cases(cases: list[tuple[str, str, dict]], steady_steps: int = 3) -> dict[int, dict]:
    """Per case ``(how, schedule, torch.compile options)``: gradient errors against plain autograd,
    dynamo's graph-break and graph counts, recompiles over the steady-state steps, names, paths."""
    init_distributed(backend="gloo", timeout=60)
    from torch._dynamo.utils import counters

    from zerobubble import Pipeline

    results = {}
    for index, (how, schedule, options) in enumerate(cases):
        generator = torch.Generator().manual_seed(index)
        inputs = torch.randn(8, 3, WIDTH, generator=generator, dtype=torch.float64)
        targets = torch.randn(8, 3, WIDTH, generator=generator, dtype=torch.float64)
        reference = nn.Sequential(*blocks(seed=index))
        mse(reference(inputs), targets).backward()
        expected = {name: p.grad for name, p in reference.named_parameters()}

        counters.clear()
        layers, keywords = _compiled(how, blocks(seed=index), options)
        pipe = Pipeline(layers, schedule=schedule, microbatches=4, loss_fn=mse, timeout=60, **keywords)
        pipe.step(inputs, targets)
        errors = _errors(pipe, expected)
        warm = {"breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"]}
        recompiled = None
        touched_in_b = _watch_b_ops(pipe)  # parameters whose .grad a B op wrote, over the steady steps
        torch._dynamo.config.error_on_recompile = True
        try:
            for _ in range(steady_steps):
                for _, p in pipe.named_parameters():
                    p.grad = None
                pipe.step(inputs, targets)
        except Exception as error:  # a recompile raises here
            recompiled = repr(error)
        finally:
            torch._dynamo.config.error_on_recompile = False
        steady = _errors(pipe, expected)
        state = pipe.state_dict()
        other = nn.Sequential(*blocks(seed=index + 100))
        pipe.load_state_dict(other.state_dict())  # an uncompiled model's checkpoint loads as it is
        wanted = dict(other.named_parameters())
        results[index] = {
            "errors": errors,
            "steady_errors": steady,
            "warm": warm,
            "steady_breaks": sum(counters["graph_break"].values()) - warm["breaks"],
            "steady_graphs": counters["stats"]["unique_graphs"] - warm["graphs"],
            "frames": counters["stats"]["calls_captured"],
            "recompiled": recompiled,
            "names": [n for n, _ in pipe.named_parameters()],
            "state_keys": list(state),
            "expected_keys": list(reference.state_dict()),
            "loaded": max(float((p - wanted[n]).abs().max()) for n, p in pipe.named_parameters()),
            "paths": {r.module: r.path for r in pipe.split_report()},
            "verified": all(r.verified for r in pipe.split_report()),
            "grads_touched_in_b": sorted(touched_in_b),
        }
    return results


def _errors(pipe, expected: dict[str, torch.Tensor]) -> dict[str, float]:
    grads = dict(pipe.named_parameters())
    return {n: ((p.grad - expected[n]).norm() / expected[n].norm()).item() for n, p in grads.items()}
