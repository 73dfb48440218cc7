"""A built Pipeline's checkpoints: this rank's model entries and optimizer state, by parameter name.

:class:`PipelineState` is what :meth:`Pipeline.state_dict`, ``full_state_dict``, ``load_state_dict``,
``optimizer_state_dict`` and ``load_optimizer_state_dict`` delegate to, once the Pipeline has settled
a pending optimizer step: the names are those of the unpipelined model (:mod:`.checkpoint`), the
vocabulary-parallel weights and their per-row state are each rank's rows as DTensor shards of the
full tensors, for DCP (:mod:`..vocab.state`), and FSDP2 shards load from full tensors without
communication.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .. import PipelineError
from ..execute.ends import ModelEnds
from ..failures import Guarded, PeerMonitor
from ..parallel.consistency import STATE_DICT_TAG, CallCheck, share_objects
from ..parallel.data_parallel import ParallelLayout
from ..vocab.runner import VocabRunner
from ..vocab.state import VOCAB_LAYER_NAMES, VocabCheckpoint, join_rows
from .checkpoint import merge_state_dicts, select_entries, strict_error


class PipelineState:
    """The state dicts of one rank of a built Pipeline (see the module docstring).

    ``model_keys`` are the unpipelined model's state-dict keys in order, ``ties`` the names of each
    tied parameter (first name first); ``guarded`` wraps every call that communicates.  The rank is
    ``layout``'s pipeline rank.
    """

    def __init__(
        self,
        *,
        module: nn.Module,
        ends: ModelEnds,
        layout: ParallelLayout,
        calls: CallCheck,
        monitor: PeerMonitor,
        model_keys: Sequence[str],
        ties: Sequence[tuple[str, ...]],
        guarded: Guarded,
    ):
        self.module, self.layout = module, layout
        # the vocabulary-parallel rows are checkpointed as every rank's own shards (.vocab_state)
        self.vocab = VocabCheckpoint(ends) if isinstance(ends, VocabRunner) else None
        self._calls, self._monitor, self._guarded = calls, monitor, guarded
        self.model_keys, self._known_keys = tuple(model_keys), frozenset(model_keys)
        self.ties, self.rank = list(ties), layout.grid.pipeline_rank

    def state_dict(self) -> dict[str, Any]:
        """This rank's entries of the unpipelined model's ``state_dict()``, under the same names.

        Every parameter, persistent buffer and extra state of the layers this rank holds, in the
        model's order; a tied parameter appears under each of its names whose layer this rank holds.
        The ranks of a pipeline hold disjoint keys whose union is the unpipelined model's state dict,
        but for the vocabulary-parallel weights: every rank holds them, as DTensors of the full shape
        whose local data are its own rows (:mod:`..vocab.state`; ``dcp.save`` writes each row once).
        The tensors share storage with the parameters, as ``nn.Module.state_dict``'s.
        """
        if self.vocab is not None:
            return self.vocab.sharded_state(self.module.state_dict())
        return self.module.state_dict()

    def full_state_dict(self) -> dict[str, Any]:
        """Every rank's :meth:`state_dict` of this replica gathered (collective), as CPU copies of the
        full tensors (a DTensor shard all-gathered first, the vocabulary rows of every rank joined):
        the unpipelined model's state dict."""
        local = {
            k: _full(v).detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
            for k, v in self.module.state_dict().items()
        }
        if self.vocab is not None:
            local = self.vocab.rows_state(local)
        ranks = self.layout.grid.replica_ranks(self.layout.grid.dp_index)
        parts = self._guarded(
            "full_state_dict",
            lambda: share_objects(local, self._calls.group, ranks, self._monitor, tag=STATE_DICT_TAG),
        )
        return merge_state_dicts(join_rows(parts), self.model_keys)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """Load this rank's entries of a whole-model state dict, or of this rank's own.

        Each rank takes the keys of its layers and ignores the others'; every copy of a tied
        parameter is set from the first of its names the dict holds (differing values are refused).
        With ``strict`` a missing key of this rank's layers or a key of no layer raises, naming
        them; a shape that differs always raises; nothing is loaded when it raises.  Returns
        ``(missing_keys, unexpected_keys)`` as ``nn.Module.load_state_dict`` does.
        """
        local = self.module.state_dict()
        vocab_missing: list[str] = []
        rows: list[Any] = []
        if self.vocab is not None:  # each rank loads its rows (of full weights, or its own shards)
            state_dict, vocab_missing, rows = self.vocab.select_rows(state_dict, strict=strict)
            local = {k: v for k, v in local.items() if k.split(".")[0] not in VOCAB_LAYER_NAMES}
        entries, missing, unexpected = select_entries(state_dict, local, self._known_keys, self.ties)
        missing = [*missing, *vocab_missing]
        if strict and (missing or unexpected):
            raise strict_error(missing, unexpected, self.rank)
        self.module.load_state_dict(_sharded_like(entries, local), strict=False)
        VocabCheckpoint.write_rows(rows)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer | None, flatten: bool = False) -> dict:
        """``optimizer``'s state keyed by this rank's parameter names (nested, or torch's flat form
        with ``flatten``); parameters without state get the state their first step starts from.  The
        vocabulary-parallel weights' per-row state is this rank's rows as DTensor shards."""
        from .checkpoint import create_optimizer_state, optimizer_state_by_name

        optimizer = self._named_optimizer(optimizer, "optimizer_state_dict")
        if optimizer is None:  # a rank without parameters
            return {} if flatten else {"state": {}, "param_groups": []}
        create_optimizer_state(optimizer)
        names = self.parameter_names()
        state = optimizer_state_by_name(optimizer, names, flatten)
        if self.vocab is not None:  # the vocabulary rows' state: this rank's shards of the full tensors
            return self.vocab.sharded_optimizer_state(state, names, flatten=flatten)
        return state

    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer | None, state_dict: Mapping[str, Any], strict: bool = True
    ) -> list[str]:
        """Load a by-name optimizer state dict of any layout into ``optimizer``; returns the names of
        this rank's parameters it lacks (with ``strict`` those raise before anything loads)."""
        from .checkpoint import load_optimizer_state_by_name

        optimizer = self._named_optimizer(optimizer, "load_optimizer_state_dict")
        if optimizer is None:
            return []
        aliases = {tie[0]: tie[1:] for tie in self.ties}
        if self.vocab is not None:  # this rank's rows of the vocabulary state (full, or its own shards)
            state_dict = self.vocab.sliced_optimizer_state(state_dict, self.parameter_names())
            tie = self.vocab.tie()
            aliases.update({tie[0]: tie[1:]} if tie else {})
        return load_optimizer_state_by_name(optimizer, state_dict, self.parameter_names(), aliases, strict)

    def parameter_names(self) -> dict[int, str]:
        """Each of this rank's parameters by id: its name, a tied one's first name (on every holder)."""
        first = {name: tie[0] for tie in self.ties for name in tie}
        names: dict[int, str] = {}
        for name, param in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), first.get(name, name))
        return names

    def _named_optimizer(
        self, optimizer: torch.optim.Optimizer | None, call: str
    ) -> torch.optim.Optimizer | None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if isinstance(optimizer, ZeroRedundancyOptimizer):
            raise PipelineError(
                f"{call}() keys a local optimizer's state by parameter name; a ZeroRedundancyOptimizer's is "
                "sharded over the replicas: use its consolidate_state_dict() after pipe.synchronize()"
            )
        if optimizer is None and any(True for _ in self.module.parameters()):
            raise PipelineError(f"rank {self.rank} holds parameters: pass an optimizer over them")
        return optimizer


def _full(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's full tensor (an all-gather over its mesh), any other tensor itself."""
    full_tensor = getattr(value, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else value


def _sharded_like(entries: Mapping[str, Any], local: Mapping[str, Any]) -> dict[str, Any]:
    """``entries`` with each full tensor whose local entry is a DTensor (FSDP2) cut to this rank's
    shard of it, laid out as the local one (no communication: every replica loads the same value)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    out = dict(entries)
    for key, value in entries.items():
        mine = local.get(key)
        if isinstance(mine, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            full = value.detach().to(mine.device, mine.dtype)
            out[key] = distribute_tensor(full, mine.device_mesh, mine.placements, src_data_rank=None)
    return out
