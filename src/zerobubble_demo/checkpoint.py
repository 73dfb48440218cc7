"""``zerobubble train --save DIR`` and ``--resume DIR``: the run's checkpoint (torch DCP) and its checks.

A checkpoint holds every rank's model entries under the unpipelined model's names, the AdamW state by
parameter name (the flat form, which loads into any layout) and the steps taken.  Before any rank
starts, :func:`check_checkpoint` reads the checkpoint's index (``DIR/.metadata``) and compares it with
the model the flags describe, so a truncated file or a checkpoint of another model size is a one-line
:class:`~zerobubble_demo.ConfigError` naming the file, or the parameter and both shapes, instead of
DCP's tracebacks from every rank.  A data file damaged inside (its length intact) shows only when the
ranks read it: :func:`load_checkpoint` then finds the file and says which.
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch
from torch import nn

from . import ConfigError
from .models import GPTConfig, gpt_layers


def checkpoint_state(pipe: Any, optimizer: torch.optim.Optimizer, steps: int) -> dict[str, Any]:
    """What ``--save`` writes: this rank's model entries, its AdamW state by parameter name and the
    steps taken."""
    return {
        "model": pipe.state_dict(),
        "optim": pipe.optimizer_state_dict(optimizer, flatten=True),
        "progress": {"steps": steps},
    }


def save_checkpoint(pipe: Any, optimizer: torch.optim.Optimizer, directory: str, steps: int) -> None:
    """Write the checkpoint to ``directory`` (collective: every rank)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(checkpoint_state(pipe, optimizer, steps), checkpoint_id=directory)


def load_checkpoint(pipe: Any, optimizer: torch.optim.Optimizer, directory: str) -> int:
    """Load ``--resume``'s checkpoint in place (collective); the number of steps it had taken.

    A read that fails on a damaged data file raises :class:`ConfigError` naming it (on every rank:
    DCP shares a failure with all of them)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    state = checkpoint_state(pipe, optimizer, 0)
    try:
        dcp.load(state, checkpoint_id=directory)
    except (Exception, CheckpointException) as error:  # DCP's gathered failure is a BaseException
        damaged = _damaged_entry(directory)
        if damaged is None:
            raise  # not the files: a failure of the run, with its traceback
        raise ConfigError(
            f"resume {directory!r}: {damaged}; write the checkpoint again with --save"
        ) from error
    pipe.load_state_dict(state["model"])
    pipe.load_optimizer_state_dict(optimizer, state["optim"])
    return int(state["progress"]["steps"])


def check_checkpoint(directory: str, model: GPTConfig) -> None:
    """Raise a one-line :class:`ConfigError` unless ``directory`` holds a readable checkpoint of
    ``model``: its index readable, every data file it names present and long enough, and the same
    parameters with the same shapes (global shapes: any layout saved or resumed)."""
    metadata = _read_metadata(directory)
    short = _short_file(directory, metadata)
    if short is not None:
        raise ConfigError(f"resume {directory!r}: {short}; write the checkpoint again with --save")
    mismatch = _model_mismatch(metadata, model)
    if mismatch is not None:
        raise ConfigError(f"resume {directory!r}: {mismatch}")


def _read_metadata(directory: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    path = os.path.join(directory, ".metadata")
    try:
        return FileSystemReader(directory).read_metadata()
    except Exception as error:  # truncated or garbled: pickle raises anything from EOFError on
        raise ConfigError(
            f"resume {directory!r}: cannot read the checkpoint's index {path} ({_one_line(error)}); "
            "it is truncated or corrupt: write the checkpoint again with --save"
        ) from None


def _short_file(directory: str, metadata: Any) -> str | None:
    """A data file the index names that is missing or shorter than its entries need."""
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            return f"the data file {path} is missing (the checkpoint's index names it)"
        actual = os.path.getsize(path)
        if actual < size:
            return f"the data file {path} is truncated: {actual} bytes where the index needs {size}"
    return None


def _model_mismatch(metadata: Any, model: GPTConfig) -> str | None:
    """How the checkpoint's model entries differ from ``model``'s parameters, or None."""
    saved = {
        key.removeprefix("model."): tuple(entry.size)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith("model.") and hasattr(entry, "size")
    }
    with torch.device("meta"):
        wanted = {
            key: tuple(value.shape) for key, value in nn.Sequential(*gpt_layers(model)).state_dict().items()
        }
    again = "resume with the sizes it was saved with (--vocab, --seq-len, --dim, --layers)"
    saved_layers = len({key.split(".", 1)[0] for key in saved})
    if saved_layers != model.n_layers + 2:
        return (
            f"the checkpoint holds {saved_layers - 2} blocks but the model has {model.n_layers} "
            f"(--layers {model.n_layers}); {again}"
        )
    for key, shape in wanted.items():
        if key not in saved:
            return _qkv_mismatch(key, saved) or (
                f"the checkpoint has no parameter {key} (the model's is {list(shape)}); {again}"
            )
        if saved[key] != shape:
            return (
                f"parameter {key} is {list(saved[key])} in the checkpoint but {list(shape)} in the model; "
                f"{again}"
            )
    extra = sorted(set(saved) - set(wanted))
    if extra:
        return f"the checkpoint's parameter {extra[0]} is not in the model; {again}"
    return None


def _qkv_mismatch(key: str, saved: dict[str, tuple[int, ...]]) -> str | None:
    """A block's q, k, v fused in the checkpoint and apart in the model (a tp mesh dimension keeps
    them apart), or the other way round; None for any other missing ``key``."""
    block, _, name = key.rpartition(".")
    block, _, projection = block.rpartition(".")
    if projection == "qkv" and f"{block}.q.{name}" in saved:
        return (
            f"the checkpoint keeps q, k and v apart ({block}.q.{name}, …), as a run with a tp mesh dimension "
            f"does, but the model fuses them ({key}); resume with tp in --mesh"
        )
    if projection in ("q", "k", "v") and f"{block}.qkv.{name}" in saved:
        return (
            f"the checkpoint fuses q, k and v ({block}.qkv.{name}), as a run without a tp mesh dimension "
            f"does, but the model keeps them apart ({key}); resume without tp in --mesh"
        )
    return None


def _damaged_entry(directory: str) -> str | None:
    """The first data file that is short or whose entries do not read back (as DCP reads them),
    described; None when every entry reads."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _read_metadata(directory)  # a damaged index: its own ConfigError
    short = _short_file(directory, metadata)
    if short is not None:
        return short
    entries = sorted(metadata.storage_data.items(), key=lambda item: (item[1].relative_path, item[1].offset))
    for index, info in entries:
        if info.transform_descriptors:  # compressed or otherwise transformed: DCP's own to read
            continue
        path = os.path.join(directory, info.relative_path)
        tensor = isinstance(metadata.state_dict_metadata.get(index.fqn), TensorStorageMetadata)
        try:
            with open(path, "rb") as handle:
                handle.seek(info.offset)
                data = handle.read(info.length)
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=tensor)
        except Exception as error:
            return (
                f"the data file {path} is corrupt: its entry {index.fqn} does not read ({_one_line(error)})"
            )
    return None


def _one_line(error: BaseException) -> str:
    """``Type: the message's first sentence``."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0].split('. ')[0]}" if lines else type(error).__name__
