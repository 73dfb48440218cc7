"""The check of the routed split (``F.linear`` and other calls on leaf weights inside generically
split modules), and the models several of its test modules share.

:func:`check_split` runs B per microbatch (no parameter may get a gradient), then the W ops, and
compares the loss, the input gradients and every parameter gradient with plain autograd on a copy.
That the routed path was taken is read off the autograd graph: the bridge joining a module's local
graph to the stage's has an edge for every leaf W must walk, so a module whose projections were all
routed has no edge to a parameter (W then runs no engine), and ``Deferral.summary`` says
``generic+linear``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from zerobubble.runtime.wgrad import FastPaths, WeightGradStore, install_deferral

WIDTH = 8


GENERIC_ROUTED = FastPaths(route_linear=True)  # no rules: nn.Linear children run inside generic modules


def local_graph(output: Any) -> Any:
    """The LocalGraph behind ``output`` (its first tensor), or None if no bridge produced it."""
    first = next(t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor))
    if first.grad_fn is None or type(first.grad_fn).__name__ != "BridgeBackward":
        return None
    return first.grad_fn.local  # the bridge's context holds the LocalGraph


def local_leaves(output: Any, model: nn.Module) -> set[str] | None:
    """Names of ``model``'s parameters the local graph behind ``output`` (its first tensor) gets
    gradients for from autograd (in W, or in B's kernel call for norms) rather than from a routed
    closed form; None if no bridge produced it.  Read before B, which lets go of the local graph."""
    local = local_graph(output)
    if local is None:
        return None
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(leaf)] for leaf in (*local.leaves, *local.in_b) if id(leaf) in names}


def check_split(
    model: nn.Module,
    batches: list[tuple],
    loss_fn: Callable[..., torch.Tensor],
    paths: FastPaths | None = None,
    defer: bool = True,
    autocast: bool = False,
    tolerance: float = 1e-5,
    keyed: bool = False,
):
    """B then W (``defer``) or fused BW per microbatch against plain autograd; returns the deferral,
    the outputs of the split model's last forward and :func:`local_leaves` of the first forward's.
    ``keyed``: each forward runs between ``begin_forward`` and ``end_forward``, as the executor's.

    A module whose first forward routed a call and left no leaves for W (norm-only parameters
    aside) may run its later forwards without a local graph (no bridge); otherwise every forward
    has the first one's leaves."""
    reference = copy.deepcopy(model)
    reference_batches = [_clone_inputs(batch) for batch in batches]
    expected_losses = []
    for batch in reference_batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = reference(*batch)
        loss = loss_fn(out)
        loss.backward()
        expected_losses.append(loss.detach())
    store = WeightGradStore()
    deferral = install_deferral([model], store, paths)
    losses, out, leaves_per_call, first_local = [], None, [], None
    for j, batch in enumerate(batches):
        if keyed:
            store.begin_forward((0, j))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(*batch)
        store.end_forward()
        loss = loss_fn(out)
        leaves_per_call.append(local_leaves(out, model))
        first_local = local_graph(out) if j == 0 else first_local
        store.begin((0, j), defer=defer)
        loss.backward()
        store.end()
        losses.append(loss.detach())
    if defer:
        early = [name for name, p in model.named_parameters() if p.grad is not None]
        assert early == [], f"gradients computed in B: {early}"
        for key in reversed(store.pending_keys()):
            store.flush(key)
    assert store.pending_keys() == []
    rtol, atol = (1.6e-2, 1e-3) if autocast else (tolerance, 1e-7)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected_losses), rtol=rtol, atol=atol)
    for batch, expected in zip(batches, reference_batches):
        for x, x_ref in zip(batch, expected):
            if isinstance(x, torch.Tensor) and x.requires_grad:
                torch.testing.assert_close(x.grad, x_ref.grad, rtol=rtol, atol=atol)
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{name} got no gradient"
        assert param.grad.dtype == param.dtype and not param.grad.requires_grad
        torch.testing.assert_close(param.grad, reference_params[name].grad, rtol=rtol, atol=atol, msg=name)
    leaves = leaves_per_call[0]
    direct_allowed = first_local is not None and not first_local.leaves
    later = [leaves, None] if direct_allowed else [leaves]
    assert all(each in later for each in leaves_per_call[1:]), leaves_per_call
    return deferral, out, leaves


def _clone_inputs(batch: tuple) -> tuple:
    return tuple(
        x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
        for x in batch
    )


def hidden(count: int = 2, shape: tuple[int, ...] = (3, 5, WIDTH), requires_grad: bool = True) -> list[tuple]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(*shape, generator=generator).requires_grad_(requires_grad),) for _ in range(count)]


class SelfAttention(nn.Module):
    """``nn.MultiheadAttention`` called as self-attention, returning the output and the weights."""

    def __init__(self, bias: bool, batch_first: bool):
        super().__init__()
        self.attention = nn.MultiheadAttention(WIDTH, 2, bias=bias, batch_first=batch_first)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        out, weights = self.attention(x, x, x)
        return out, weights


def attention_loss(out):
    values, weights = out
    return values.square().mean() + weights.square().sum()
