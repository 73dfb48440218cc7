"""Models whose first stage meets a parameter with an input that needs no gradient (issue 25's
reports), and a rank worker training them on every split schedule against one process."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from zerobubble.runtime.launch import init_distributed

VOCAB, WIDTH, SEQ = 17, 8, 5


class TokenAndPositions(nn.Module):
    """``tok(ids) + pos[:T]``: a position table sliced from a parameter."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(2 * SEQ, WIDTH) * 0.1)

    def forward(self, ids):
        return self.tok(ids) + self.pos[: ids.shape[1]]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, h):
        return h + torch.tanh(self.fc(self.norm(h)))


class TiedHead(nn.Module):
    """The vocabulary projection on the token embedding's weight (tied across ranks)."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.weight = embedding.weight

    def forward(self, h):
        return F.linear(self.norm(h), self.weight)


class LinearShift(nn.Module):
    """``linear(x) + p`` on a float input that needs no gradient."""

    def __init__(self, product: bool = False):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.p = nn.Parameter(torch.rand(WIDTH) + 0.5)
        self.product = product

    def forward(self, x):
        return self.linear(x) * self.p if self.product else self.linear(x) + self.p


class PatchEmbedding(nn.Module):
    """A ViT patch embedding: ``conv(img)`` flattened, a class token, a position table."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, WIDTH, 2, 2)
        self.cls = nn.Parameter(torch.randn(1, 1, WIDTH) * 0.1)
        self.pos = nn.Parameter(torch.randn(1, 5, WIDTH) * 0.1)

    def forward(self, img):
        x = self.conv(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1)
        return x + self.pos


class Pool(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(WIDTH, 3)

    def forward(self, h):
        return self.out(h.mean(1))


def build(name: str, seed: int) -> list[nn.Module]:
    """The layers of model ``name``: ``"gpt"``, ``"shift"``, ``"scale"`` or ``"vit"``."""
    torch.manual_seed(seed)
    if name == "gpt":
        embed = TokenAndPositions()
        return [embed, Block(), Block(), TiedHead(embed.tok)]
    if name in ("shift", "scale"):
        return [LinearShift(product=name == "scale"), Block(), Block(), Pool()]
    if name == "vit":
        return [PatchEmbedding(), Block(), Block(), Pool()]
    raise ValueError(name)


def batch(name: str, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    if name == "gpt":
        ids = torch.randint(0, VOCAB, (size, SEQ), generator=generator)
        return ids, torch.randint(0, VOCAB, (size, SEQ), generator=generator)
    if name == "vit":
        inputs = torch.randn(size, 3, 4, 4, generator=generator)
    else:
        inputs = torch.randn(size, SEQ, WIDTH, generator=generator)
    return inputs, torch.randint(0, 3, (size,), generator=generator)


def loss_fn(output, targets):
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))


def reference(name: str, seed: int, inputs, targets, microbatches: int) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of the mean microbatch loss in one process."""
    model = nn.Sequential(*build(name, seed))
    losses = [loss_fn(model(x), y) for x, y in zip(inputs.chunk(microbatches), targets.chunk(microbatches))]
    (sum(losses) / microbatches).backward()
    return {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}


def split_schedule_cases(cases: list[tuple[str, str, bool]]) -> dict:
    """Rank worker: for each ``(model, schedule, verify)``, one step against one process.

    Returns, per case, every parameter's relative gradient error (``None``: no gradient) and the
    split guard's warnings.
    """
    init_distributed(backend="gloo", timeout=60)
    from zerobubble import Pipeline

    results = {}
    for index, (name, schedule, verify) in enumerate(cases):
        microbatches = 4
        inputs, targets = batch(name, 2 * microbatches, seed=index)
        expected = reference(name, index, inputs, targets, microbatches)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipe = Pipeline(
                build(name, index), schedule=schedule, microbatches=microbatches, loss_fn=loss_fn,
                timeout=60, verify=verify,
            )  # fmt: skip
            pipe.step(inputs, targets)
        errors = {}
        for param_name, param in pipe.named_parameters():
            want = expected[param_name]
            errors[param_name] = (
                None
                if param.grad is None
                else float((param.grad - want).norm() / want.norm().clamp_min(1e-12))
            )
        results[index] = {
            "errors": errors,
            "warnings": [str(w.message) for w in caught if "zerobubble" in str(w.message)],
            "fallen": [r.module for r in pipe.split_report() if r.path.startswith("plain")],
        }
    return results
