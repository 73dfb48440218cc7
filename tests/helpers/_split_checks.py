"""The checks of the B/W split shared by its test modules, and a user layer with a rule of its own.

:func:`split_backward` runs B of each microbatch's loss; :func:`w_after_b` checks that B wrote no
``.grad``, runs the W ops and compares every gradient with plain autograd on a copy
(:func:`assert_grads_equal`).  :class:`Gate` and :class:`GateRule` are the user's layer and its
closed form.
"""

from __future__ import annotations

import torch
from torch import nn

from zerobubble.runtime.wgrad import SplitRule, WeightGradStore

WIDTH = 8


def assert_grads_equal(model: nn.Module, reference: nn.Module) -> None:
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{name} got no gradient"
        assert param.grad.dtype == param.dtype
        assert not param.grad.requires_grad, f"W built an autograd graph into {name}.grad"
        torch.testing.assert_close(param.grad, expected[name].grad, rtol=1e-5, atol=1e-7, msg=name)


def w_after_b(model: nn.Module, store: WeightGradStore, reference: nn.Module) -> None:
    """Checks that B wrote no ``.grad``, runs W of every pending key (last first), compares."""
    assert all(p.grad is None for p in model.parameters()), "no .grad may be written in B"
    for key in reversed(store.pending_keys()):
        store.flush(key)
    assert store.pending_keys() == []
    assert_grads_equal(model, reference)


def split_backward(model, store, losses, stage=0):
    for j, loss in enumerate(losses):
        store.begin((stage, j), defer=True)
        loss.backward()
        store.end()


class Gate(nn.Module):
    """A user layer: ``x * sigmoid(gate)`` with a vector parameter."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Parameter(torch.randn(WIDTH))

    def forward(self, x):
        return x * torch.sigmoid(self.gate)


class GateRule(SplitRule):
    """The user's closed form for Gate."""

    def param_names(self, module):
        return ("gate",)

    def forward(self, module, x, params):
        return x * torch.sigmoid(params[0]), (x, params[0])

    def input_grad(self, module, saved, grad_output):
        return grad_output * torch.sigmoid(saved[1])

    def weight_grads(self, module, saved, grad_output, needed):
        x, gate = saved
        s = torch.sigmoid(gate)
        return [(grad_output * x).reshape(-1, WIDTH).sum(0) * s * (1 - s)]
