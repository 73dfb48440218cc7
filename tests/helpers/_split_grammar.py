"""A grammar of stage modules for the split fuzzer (``test_split_fuzz.py``).

A generated stage is an ``nn.Sequential`` of :class:`Block` modules.  Each block applies a list of
ops to hidden states ``h`` of shape ``(batch, SEQ, WIDTH)`` and passes the integer ids along:
``(h, ids) -> (h, ids)``; a first stage's first block starts from the ids (an embedding, a raw
table lookup, a gather) or from a float input that needs no gradient.  The ops cover the ways a
user's layer meets a parameter: as a module (fast paths), through ``F.linear``/``matmul``/
``einsum``/``bmm``/``addmm`` with the parameter on either side, indexed, sliced, viewed, expanded,
transposed, concatenated, used twice, added or multiplied onto an activation, in norms, convolutions,
frozen beside trainable ones (LoRA), through a parametrization, in checkpointed sub-blocks, next to
buffers and in-place activations.  Each op kind registers its parameters either on the block
itself (the block is then split generically, the op's calls routed) or on a child module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

WIDTH, SEQ, VOCAB = 8, 4, 13


def _param(*shape: int, scale: float = 0.5) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape) * scale)


class Op(nn.Module):
    """One op of a block: ``forward(h, ids) -> h``; its parameters are its own (a child module)."""

    def forward(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


# -- entries: ids (or a float input needing no gradient) to hidden states ------------------------------


def _entry_embedding(owner: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    owner.embedding = nn.Embedding(VOCAB, WIDTH, padding_idx=0)
    return owner.embedding


def _entry_functional_embedding(owner: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    owner.table = _param(VOCAB, WIDTH)
    return lambda ids: F.embedding(ids, owner.table)


def _entry_indexing(owner: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    owner.table = _param(VOCAB, WIDTH)
    return lambda ids: owner.table[ids]


def _entry_gather(owner: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    owner.table = _param(VOCAB, WIDTH)

    def lookup(ids: torch.Tensor) -> torch.Tensor:
        index = ids.reshape(-1, 1).expand(-1, WIDTH)
        return owner.table.gather(0, index).view(*ids.shape, WIDTH)

    return lookup


def _entry_index_select(owner: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    owner.table = _param(VOCAB, WIDTH)
    return lambda ids: torch.index_select(owner.table, 0, ids.reshape(-1)).view(*ids.shape, WIDTH)


def _entry_embedding_and_positions(owner: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    owner.embedding = nn.Embedding(VOCAB, WIDTH)
    owner.positions = _param(2 * SEQ, WIDTH)
    return lambda ids: owner.embedding(ids) + owner.positions[: ids.shape[-1]]


ENTRIES: dict[str, Callable[[nn.Module], Callable[[torch.Tensor], torch.Tensor]]] = {
    "embedding": _entry_embedding,
    "functional embedding": _entry_functional_embedding,
    "indexing": _entry_indexing,
    "gather": _entry_gather,
    "index_select": _entry_index_select,
    "embedding + position slice": _entry_embedding_and_positions,
}


# -- ops on hidden states --------------------------------------------------------------------------
# Each builder takes the module that owns the op's parameters and returns ``f(h, ids) -> h``.

Builder = Callable[[nn.Module, str], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]


def _linear_module(owner: nn.Module, name: str):
    setattr(owner, name, nn.Linear(WIDTH, WIDTH, bias=len(name) % 2 == 0))
    return lambda h, ids: getattr(owner, name)(h)


def _functional_linear(owner: nn.Module, name: str):
    setattr(owner, name + "_w", _param(WIDTH, WIDTH))
    setattr(owner, name + "_b", _param(WIDTH))
    return lambda h, ids: F.linear(h, getattr(owner, name + "_w"), getattr(owner, name + "_b"))


def _addmm(owner: nn.Module, name: str):
    setattr(owner, name + "_w", _param(WIDTH, WIDTH))
    setattr(owner, name + "_b", _param(WIDTH))

    def f(h, ids):
        flat = torch.addmm(getattr(owner, name + "_b"), h.reshape(-1, WIDTH), getattr(owner, name + "_w"))
        return flat.view_as(h)

    return f


def _matmul_right(owner: nn.Module, name: str):
    setattr(owner, name, _param(WIDTH, WIDTH))
    return lambda h, ids: h @ getattr(owner, name)


def _matmul_left(owner: nn.Module, name: str):
    setattr(owner, name, _param(WIDTH, WIDTH))
    return lambda h, ids: (getattr(owner, name) @ h.transpose(-1, -2)).transpose(-1, -2)


def _einsum(owner: nn.Module, name: str):
    setattr(owner, name, _param(WIDTH, WIDTH))
    return lambda h, ids: torch.einsum("btd,de->bte", h, getattr(owner, name))


def _bmm(owner: nn.Module, name: str):
    setattr(owner, name, _param(WIDTH, WIDTH))
    return lambda h, ids: torch.bmm(h, getattr(owner, name).expand(h.shape[0], WIDTH, WIDTH))


def _linear_transposed_weight(owner: nn.Module, name: str):
    setattr(owner, name, _param(WIDTH, WIDTH))
    return lambda h, ids: F.linear(h, getattr(owner, name).t())


def _add_parameter(owner: nn.Module, name: str):
    setattr(owner, name, _param(WIDTH))
    return lambda h, ids: h + getattr(owner, name)


def _add_parameter_first(owner: nn.Module, name: str):
    setattr(owner, name, _param(WIDTH))
    return lambda h, ids: torch.add(getattr(owner, name), h)


def _mul_parameter(owner: nn.Module, name: str):
    setattr(owner, name, nn.Parameter(torch.rand(WIDTH) + 0.5))
    return lambda h, ids: h * getattr(owner, name)


def _parameter_view(owner: nn.Module, name: str):
    setattr(owner, name, _param(WIDTH))
    return lambda h, ids: h + getattr(owner, name).view(1, 1, WIDTH)


def _parameter_slice(owner: nn.Module, name: str):
    setattr(owner, name, _param(WIDTH + 3))
    return lambda h, ids: h * getattr(owner, name)[1 : WIDTH + 1]


def _parameter_expand(owner: nn.Module, name: str):
    setattr(owner, name, _param(1, 1, WIDTH))
    return lambda h, ids: h + getattr(owner, name).expand_as(h)


def _parameter_cat(owner: nn.Module, name: str):
    setattr(owner, name + "_a", _param(WIDTH // 2))
    setattr(owner, name + "_c", _param(WIDTH - WIDTH // 2))
    return lambda h, ids: h * torch.cat([getattr(owner, name + "_a"), getattr(owner, name + "_c")])


def _parameter_twice(owner: nn.Module, name: str):
    setattr(owner, name, _param(WIDTH, WIDTH))

    def f(h, ids):
        weight = getattr(owner, name)
        return F.linear(torch.tanh(F.linear(h, weight)), weight)

    return f


def _scale_and_shift_by_one_parameter(owner: nn.Module, name: str):
    setattr(owner, name, _param(WIDTH))
    return lambda h, ids: h * getattr(owner, name) + getattr(owner, name)


def _layer_norm_module(owner: nn.Module, name: str):
    setattr(owner, name, nn.LayerNorm(WIDTH, elementwise_affine=len(name) % 3 != 0))
    return lambda h, ids: getattr(owner, name)(h)


def _layer_norm_functional(owner: nn.Module, name: str):
    setattr(owner, name + "_w", nn.Parameter(torch.rand(WIDTH) + 0.5))
    setattr(owner, name + "_b", _param(WIDTH))
    return lambda h, ids: F.layer_norm(h, (WIDTH,), getattr(owner, name + "_w"), getattr(owner, name + "_b"))


def _group_norm(owner: nn.Module, name: str):
    setattr(owner, name, nn.GroupNorm(2, WIDTH))
    return lambda h, ids: getattr(owner, name)(h.transpose(1, 2)).transpose(1, 2)


def _batch_norm(owner: nn.Module, name: str):
    setattr(owner, name, nn.BatchNorm1d(WIDTH))
    return lambda h, ids: getattr(owner, name)(h.transpose(1, 2)).transpose(1, 2)


def _rms_norm_module(owner: nn.Module, name: str):
    setattr(owner, name, nn.RMSNorm(WIDTH, eps=1e-5))
    return lambda h, ids: getattr(owner, name)(h)


def _rms_norm_functional(owner: nn.Module, name: str):
    setattr(owner, name, nn.Parameter(torch.rand(WIDTH) + 0.5))
    return lambda h, ids: F.rms_norm(h, (WIDTH,), getattr(owner, name), 1e-5)


def _rms_norm_by_hand(owner: nn.Module, name: str):
    setattr(owner, name, nn.Parameter(torch.rand(WIDTH) + 0.5))

    def f(h, ids):
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * getattr(owner, name)

    return f


def _conv1d(owner: nn.Module, name: str):
    setattr(owner, name, nn.Conv1d(WIDTH, WIDTH, 3, padding=1))
    return lambda h, ids: getattr(owner, name)(h.transpose(1, 2)).transpose(1, 2)


def _conv2d(owner: nn.Module, name: str):
    setattr(owner, name, nn.Conv2d(WIDTH, WIDTH, (3, 1), padding=(1, 0)))

    def f(h, ids):
        return getattr(owner, name)(h.transpose(1, 2).unsqueeze(-1)).squeeze(-1).transpose(1, 2)

    return f


def _activation(owner: nn.Module, name: str):
    functions = (F.gelu, torch.tanh, F.silu, F.relu)
    function = functions[len(name) % len(functions)]
    return lambda h, ids: function(h)


def _dropout(owner: nn.Module, name: str):
    setattr(owner, name, nn.Dropout(0.25))
    return lambda h, ids: getattr(owner, name)(h)


def _lora(owner: nn.Module, name: str):
    base = nn.Linear(WIDTH, WIDTH)
    base.requires_grad_(False)
    setattr(owner, name + "_base", base)
    setattr(owner, name + "_a", _param(WIDTH, 2))
    setattr(owner, name + "_b", _param(2, WIDTH))
    return lambda h, ids: base(h) + h @ getattr(owner, name + "_a") @ getattr(owner, name + "_b")


def _frozen_weight_trainable_bias(owner: nn.Module, name: str):
    layer = nn.Linear(WIDTH, WIDTH)
    layer.weight.requires_grad_(False)
    setattr(owner, name, layer)
    return lambda h, ids: layer(h)


def _weight_norm(owner: nn.Module, name: str):
    setattr(owner, name, nn.utils.parametrizations.weight_norm(nn.Linear(WIDTH, WIDTH)))
    return lambda h, ids: getattr(owner, name)(h)


def _buffer(owner: nn.Module, name: str):
    owner.register_buffer(name + "_scale", torch.rand(WIDTH) + 0.5)
    owner.register_buffer(name + "_calls", torch.zeros((), dtype=torch.long))

    def f(h, ids):
        getattr(owner, name + "_calls").add_(1)  # a buffer changed in place by every forward
        return h * getattr(owner, name + "_scale")

    return f


def _in_place_activation(owner: nn.Module, name: str):
    setattr(owner, name, nn.Linear(WIDTH, WIDTH))

    def f(h, ids):
        out = getattr(owner, name)(h)
        out.mul_(0.5)  # the product's node saved no output: allowed in place
        return F.relu(out, inplace=True)

    return f


class _Sub(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.gain = nn.Parameter(torch.rand(WIDTH) + 0.5)

    def forward(self, h):
        return torch.tanh(self.fc(h)) * self.gain


def _checkpointed(owner: nn.Module, name: str):
    setattr(owner, name, _Sub())
    reentrant = len(name) % 2 == 0
    return lambda h, ids: checkpoint(getattr(owner, name), h, use_reentrant=reentrant)


def _embedding_beside(owner: nn.Module, name: str):
    setattr(owner, name, nn.Embedding(VOCAB, WIDTH))
    return lambda h, ids: h + getattr(owner, name)(ids)


def _table_beside(owner: nn.Module, name: str):
    setattr(owner, name, _param(VOCAB, WIDTH))
    return lambda h, ids: h * torch.sigmoid(getattr(owner, name)[ids])


def _attention(owner: nn.Module, name: str):
    setattr(owner, name, nn.MultiheadAttention(WIDTH, 2, batch_first=True))
    return lambda h, ids: getattr(owner, name)(h, h, h, need_weights=False)[0]


def _hidden_gather(owner: nn.Module, name: str):
    setattr(owner, name, _param(WIDTH, WIDTH))

    def f(h, ids):
        index = (ids % WIDTH).unsqueeze(-1).expand(*ids.shape, WIDTH)
        return h + torch.gather(h @ getattr(owner, name), -1, index)

    return f


OPS: dict[str, Builder] = {
    "nn.Linear": _linear_module,
    "F.linear": _functional_linear,
    "addmm": _addmm,
    "x @ w": _matmul_right,
    "w @ x": _matmul_left,
    "einsum": _einsum,
    "bmm": _bmm,
    "F.linear(x, w.t())": _linear_transposed_weight,
    "x + p": _add_parameter,
    "p + x": _add_parameter_first,
    "x * p": _mul_parameter,
    "x + p.view": _parameter_view,
    "x * p[slice]": _parameter_slice,
    "x + p.expand": _parameter_expand,
    "x * cat(p, q)": _parameter_cat,
    "w used twice": _parameter_twice,
    "x * p + p": _scale_and_shift_by_one_parameter,
    "nn.LayerNorm": _layer_norm_module,
    "F.layer_norm": _layer_norm_functional,
    "nn.GroupNorm": _group_norm,
    "nn.BatchNorm1d": _batch_norm,
    "nn.RMSNorm": _rms_norm_module,
    "F.rms_norm": _rms_norm_functional,
    "RMS norm by hand": _rms_norm_by_hand,
    "nn.Conv1d": _conv1d,
    "nn.Conv2d": _conv2d,
    "activation": _activation,
    "dropout": _dropout,
    "LoRA": _lora,
    "frozen weight": _frozen_weight_trainable_bias,
    "weight_norm": _weight_norm,
    "buffer": _buffer,
    "in-place activation": _in_place_activation,
    "checkpoint": _checkpointed,
    "embedding of ids": _embedding_beside,
    "table[ids]": _table_beside,
    "MultiheadAttention": _attention,
    "gather": _hidden_gather,
}


@dataclass(frozen=True)
class OpChoice:
    """One op of a generated block: its kind, where its parameters live, whether it is residual."""

    kind: str
    on_child: bool  # the parameters on a child module of the block (else on the block itself)
    residual: bool


@dataclass(frozen=True)
class BlockChoice:
    """One generated block: an optional entry (first stage only) and its ops."""

    entry: str | None
    ops: tuple[OpChoice, ...]


class _Holder(nn.Module):
    """A child module holding one op's parameters (it has no forward: the block calls its op)."""


class Block(nn.Module):
    """``(x, ids) -> (h, ids)``: an optional entry from the ids, then the ops in order."""

    def __init__(self, choice: BlockChoice):
        super().__init__()
        self.entry = None if choice.entry is None else ENTRIES[choice.entry](self)
        self.steps = []
        for index, op in enumerate(choice.ops):
            owner: nn.Module = self
            if op.on_child:
                owner = _Holder()
                setattr(self, f"holder{index}", owner)
            self.steps.append((OPS[op.kind](owner, f"op{index}"), op.residual))

    def forward(self, h: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.entry is not None:
            h = self.entry(ids) if h is None or not h.is_floating_point() else h + self.entry(ids)
        for step, residual in self.steps:
            out = step(h, ids)
            h = h + out if residual else out
        return h, ids


class FirstBlock(Block):
    """A first stage's first block: ``ids -> (h, ids)`` or ``(x, ids) -> (h, ids)``."""

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        if len(inputs) == 1:
            return super().forward(None, inputs[0])  # type: ignore[arg-type]
        return super().forward(*inputs)


class Stage(nn.Module):
    """The generated blocks in order, each called with the previous one's outputs unpacked."""

    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for block in self.blocks:
            inputs = block(*inputs)
        return inputs


def build_stage(
    blocks: list[BlockChoice], first: bool, tie: bool, dtype: torch.dtype, seed: int
) -> nn.Module:
    """The stage of ``blocks``; ``tie``: the last block's last parameter is the first block's first."""
    torch.manual_seed(seed)
    modules = [FirstBlock(blocks[0]) if first else Block(blocks[0])]
    modules += [Block(choice) for choice in blocks[1:]]
    if tie and len(modules) > 1:
        _tie(modules[0], modules[-1])
    return Stage(modules).to(dtype)


def _tie(source: nn.Module, target: nn.Module) -> None:
    """Make one parameter of ``target`` the same tensor as one of ``source`` of the same shape."""
    sources = [(name, p) for name, p in source.named_parameters() if p.requires_grad]
    for name, param in target.named_parameters():
        if "parametrizations" in name or not param.requires_grad:
            continue
        match = next((p for _, p in sources if p.shape == param.shape), None)
        if match is not None:
            module_name, _, attr = name.rpartition(".")
            owner = target.get_submodule(module_name) if module_name else target
            owner._parameters[attr] = match
            return
