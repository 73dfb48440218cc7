"""The vocabulary-parallel layers' checkpoints: every rank's own rows, as DCP shards of the full weight.

Each pipeline rank holds rows ``[vocab_start, vocab_stop)`` of the ``(V, d)`` embedding and head
(:func:`~.layers.shard_bounds`).  In :meth:`Pipeline.state_dict` and ``optimizer_state_dict``
every per-row tensor — a weight, AdamW's ``exp_avg`` / ``exp_avg_sq``, SGD's momentum — is a
``DTensor`` of the full shape ``(V, d)`` on a 1-D mesh over the pipeline's ranks, whose local tensor is
torch's ``LocalShardsWrapper`` holding this rank's rows at their row offset (:func:`row_shard`).  So
``dcp.save`` writes each row once, from the rank that holds it, under the unpipelined model's key
(nothing is gathered), and ``dcp.load`` fills the same dicts of any other layout — another number of
ranks cuts the rows elsewhere — or the unpipelined model's full tensors.

Loading (:meth:`VocabCheckpoint.select_rows`, :meth:`VocabCheckpoint.sliced_optimizer_state`) takes
such shards back when they are this rank's rows, or full ``(V, d)`` tensors (the unpipelined model's
``state_dict()``), of which each rank keeps its rows.
:meth:`~..state.pipeline_state.PipelineState.full_state_dict` joins the ranks' rows (:func:`join_rows`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from .. import PipelineError
from .layers import VocabParallelEmbedding, VocabParallelHead
from .runner import VocabRunner

#: The names the Pipeline registers its vocabulary-parallel layers under (the embedding first, so a
#: tied weight's first name — the one its optimizer state is keyed by — is the embedding's, as in a
#: model that embeds before it projects).
VOCAB_LAYER_NAMES = ("vocab_embedding", "vocab_head")

_Layer = VocabParallelEmbedding | VocabParallelHead


class VocabRows(NamedTuple):
    """Rows ``[start, start + len(rows))`` of a full per-row tensor (what one rank sends for
    ``full_state_dict``; picklable, unlike the DTensor shards)."""

    start: int
    rows: torch.Tensor


def row_shard(rows: torch.Tensor, start: int, vocab: int, mesh: Any) -> Any:
    """A ``DTensor`` of shape ``(vocab, *rows.shape[1:])`` whose only local data is ``rows`` (shared,
    not copied) at row ``start``, for DCP.

    Why not ``DTensor.from_local(rows, mesh, [Shard(0)])``: ``Shard(0)`` places the rows as
    ``torch.chunk`` would (``ceil(V/p)`` a rank: 4, 4, 4, 1 for V=13 over 4 ranks, and some ranks
    none for V=5 over 4), and DCP would write and read them at those offsets.  The wrapper's
    ``__create_write_items__`` / ``__create_chunk_list__`` / ``__get_tensor_shard__`` (the protocol
    torchrec's row-wise sharding uses, to which ``DTensor`` defers) give DCP the true offset and size
    instead; the ``DTensor`` around it carries the global shape and the mesh whose ranks take part.
    It serves DCP only: DTensor operations on it (``full_tensor()``) raise in the wrapper.
    """
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    offsets = (start,) + (0,) * (rows.dim() - 1)
    shape = torch.Size((vocab, *rows.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    local = LocalShardsWrapper([rows], [offsets])
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


def _shard_rows(value: Any) -> tuple[int, torch.Tensor] | None:
    """``(start, rows)`` of a :func:`row_shard` DTensor holding one block of rows, else None."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    if not isinstance(value, DTensor):
        return None
    local = value._local_tensor
    if not isinstance(local, LocalShardsWrapper) or len(local.local_shards()) != 1:
        return None
    return int(local.local_offsets()[0][0]), local.local_shards()[0]


class VocabCheckpoint:
    """The state-dict side of one rank's vocabulary-parallel layers (see the module docstring).

    ``runner`` is the rank's :class:`~.runner.VocabRunner`; the mesh of its shards spans the ranks of
    the runner's collectives (made when first needed: it communicates nothing).
    """

    def __init__(self, runner: VocabRunner):
        self.runner = runner
        self._mesh: Any = None

    def layers(self) -> list[tuple[str, _Layer]]:
        """``(name, layer)`` of each layer present, in :data:`VOCAB_LAYER_NAMES` order."""
        found = (self.runner.embedding, self.runner.head)
        return [(name, layer) for name, layer in zip(VOCAB_LAYER_NAMES, found) if layer is not None]

    def tie(self) -> tuple[str, ...]:
        """The two names of a head tied to the embedding (the first the optimizer's), else ()."""
        head, embedding = self.runner.head, self.runner.embedding
        tied = head is not None and embedding is not None and head.weight is embedding.weight
        return tuple(f"{name}.weight" for name in VOCAB_LAYER_NAMES) if tied else ()

    def mesh(self) -> Any:
        """The 1-D DeviceMesh of the pipeline's ranks (over the embedding's group)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._mesh = DeviceMesh.from_group(self.runner.groups.embed, self.runner.device.type)
        return self._mesh

    def _shard(self, layer: _Layer, rows: torch.Tensor) -> Any:
        return row_shard(rows, layer.vocab_start, layer.vocab_size, self.mesh())

    # -- the model ---------------------------------------------------------------------------------

    def sharded_state(self, local: Mapping[str, Any]) -> dict[str, Any]:
        """``local`` (the module's state dict) with each vocabulary weight as this rank's shard of it."""
        out = dict(local)
        for name, layer in self.layers():
            key = f"{name}.weight"
            out[key] = self._shard(layer, local[key])
        return out

    def rows_state(self, local: Mapping[str, Any]) -> dict[str, Any]:
        """``local`` with each vocabulary weight as CPU copies of this rank's rows (:class:`VocabRows`)."""
        out = dict(local)
        for name, layer in self.layers():
            key = f"{name}.weight"
            out[key] = VocabRows(layer.vocab_start, local[key].detach().to("cpu", copy=True))
        return out

    def select_rows(
        self, state_dict: Mapping[str, Any], *, strict: bool
    ) -> tuple[dict[str, Any], list[str], list[tuple[_Layer, torch.Tensor]]]:
        """This rank's rows of the vocabulary weights in ``state_dict`` (full tensors, or this rank's
        shards as :meth:`sharded_state` gives them and ``dcp.load`` fills them), checked but not yet
        loaded (:meth:`write_rows`): ``(the rest of the dict, the vocabulary keys it lacks, the rows
        by layer)``.  A tied weight takes the first of its names the dict holds."""
        rest = {k: v for k, v in state_dict.items() if k.split(".")[0] not in VOCAB_LAYER_NAMES}
        missing: list[str] = []
        loads: dict[int, tuple[_Layer, torch.Tensor]] = {}
        tie = self.tie()
        for name, layer in self.layers():
            key = f"{name}.weight"
            value = state_dict.get(key)
            if value is None:
                if not (tie and any(state_dict.get(other) is not None for other in tie)):
                    missing.append(key)
                continue
            if id(layer.weight) not in loads:  # a tied weight from the first of its names
                loads[id(layer.weight)] = (layer, self._rows_of(key, layer, value))
        if strict and missing:
            raise PipelineError(
                f"the state dict lacks {missing}, nothing was loaded: the vocabulary-parallel layers load "
                "their rows from the full weights (the unpipelined model's state_dict(), "
                "full_state_dict()) or from this rank's shards (its own state_dict(), filled by dcp.load)"
            )
        return rest, missing, list(loads.values())

    @staticmethod
    def write_rows(loads: Sequence[tuple[_Layer, torch.Tensor]]) -> None:
        """Copy :meth:`select_rows`' rows into the layers' weights."""
        with torch.no_grad():
            for layer, rows in loads:
                if rows.data_ptr() != layer.weight.data_ptr():  # dcp.load may have filled it in place
                    layer.weight.copy_(rows)

    def _rows_of(self, key: str, layer: _Layer, value: Any, *, any_width: bool = False) -> torch.Tensor:
        """This rank's rows of ``value``: a full tensor's slice, or a shard of exactly these rows.  A
        full tensor has the weight's shape, or (``any_width``: optimizer state) just its row count."""
        rows = layer.vocab_stop - layer.vocab_start
        shard = _shard_rows(value)
        if shard is not None:
            start, local = shard
            if start != layer.vocab_start or local.shape[0] != rows:
                raise PipelineError(
                    f"{key} holds rows [{start}, {start + local.shape[0]}) of the vocabulary, but this rank "
                    f"holds rows [{layer.vocab_start}, {layer.vocab_stop}): load another layout's "
                    "checkpoint with dcp.load into this Pipeline's own state_dict(), or pass full tensors"
                )
            return local
        from torch.distributed.tensor import DTensor

        full = (layer.vocab_size, *layer.weight.shape[1:])
        if any_width and isinstance(value, torch.Tensor) and value.dim() > 0:
            full = (layer.vocab_size, *value.shape[1:])
        if isinstance(value, DTensor) or not isinstance(value, torch.Tensor) or tuple(value.shape) != full:
            shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise PipelineError(
                f"{key} is {shape} in the state dict; the vocabulary-parallel layer loads the full weight "
                f"{list(full)} (and keeps its rows) or this rank's shard of it from its own state_dict()"
            )
        return value[layer.vocab_start : layer.vocab_stop]

    # -- the optimizer -----------------------------------------------------------------------------

    def _params(self, names: Mapping[int, str]) -> list[tuple[tuple[str, ...], _Layer]]:
        """``(names, layer)`` of each vocabulary weight the optimizer holds: the name the Pipeline
        gives it (a tied weight's first name), then its other name."""
        found: dict[int, tuple[tuple[str, ...], _Layer]] = {}
        for _, layer in self.layers():
            if id(layer.weight) in names and id(layer.weight) not in found:
                first = names[id(layer.weight)]
                found[id(layer.weight)] = ((first, *(n for n in self.tie() if n != first)), layer)
        return list(found.values())

    def sharded_optimizer_state(
        self, state: dict[str, Any], names: Mapping[int, str], *, flatten: bool
    ) -> dict[str, Any]:
        """An :func:`~..state.checkpoint.optimizer_state_by_name` dict (changed in place and returned) with
        each vocabulary weight's per-row state (tensors whose first dimension is the shard's rows) as
        this rank's shards of the full tensors; ``step`` and the like stay as they are (equal on every
        rank, DCP writes them once)."""
        for (name, *_), layer in self._params(names):
            values = _state_of(state, name, flatten)
            rows = layer.weight.shape[0]
            for key, value in values.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
                    values[key] = self._shard(layer, value)
            _put_state(state, name, values, flatten)
        return state

    def sliced_optimizer_state(self, state_dict: Mapping[str, Any], names: Mapping[int, str]) -> Any:
        """An optimizer state dict with each vocabulary weight's per-row state cut to this rank's rows:
        full tensors sliced, this rank's shards unwrapped (a copy of the dict; the tensors shared)."""
        flatten = "state" not in state_dict
        state = dict(state_dict) if flatten else {**state_dict, "state": dict(state_dict["state"])}
        for aliases, layer in self._params(names):
            for name in aliases:
                values = _state_of(state, name, flatten)
                for key, value in values.items():
                    full = isinstance(value, torch.Tensor) and value.shape[:1] == (layer.vocab_size,)
                    if full or _shard_rows(value) is not None:  # per-row (not ``step``)
                        values[key] = self._rows_of(f"state.{name}.{key}", layer, value, any_width=True)
                if values:
                    _put_state(state, name, values, flatten)
        return state


def join_rows(parts: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The ranks' :meth:`VocabCheckpoint.rows_state` dicts with every :class:`VocabRows` entry replaced
    by the full tensor all the ranks' rows of that key make (in the first dict holding the key)."""
    blocks: dict[str, list[VocabRows]] = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, VocabRows):
                blocks.setdefault(key, []).append(value)
    joined = {}
    for key, found in blocks.items():
        ordered = sorted(found, key=lambda block: block.start)
        covered = 0
        for block in ordered:  # contiguous from row 0: each rank's rows once
            if block.start != covered:
                raise PipelineError(f"the ranks' rows of {key} are not contiguous at row {covered}")
            covered += block.rows.shape[0]
        joined[key] = torch.cat([block.rows for block in ordered])
    out = []
    for part in parts:
        out.append({k: joined[k] if isinstance(v, VocabRows) else v for k, v in part.items()})
    return out


def _state_of(state: Mapping[str, Any], name: str, flatten: bool) -> dict[str, Any]:
    if not flatten:
        return dict(state["state"].get(name, {}))
    prefix = f"state.{name}."
    return {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}


def _put_state(state: dict[str, Any], name: str, values: Mapping[str, Any], flatten: bool) -> None:
    if not flatten:
        state["state"][name] = dict(values)
    else:
        state.update({f"state.{name}.{key}": value for key, value in values.items()})
