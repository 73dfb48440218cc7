"""``zerobubble profile``: the per-layer profile of the demo's GPT, for ``zerobubble plan``.

:func:`profile_gpt` builds the built-in GPT (:mod:`.models`) and measures it with the runtime's
profiler (:func:`zerobubble.runtime.construct.profile.profile_layers`), with the transfer cost timed
between two local ranks when asked.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zerobubble.runtime.construct.profile import measure_transfer, profile_layers
from zerobubble.runtime.launch import init_distributed, launch
from zerobubble.schedule.modelplan import ModelProfile

from . import ConfigError
from .models import MarkovCorpus, gpt_layers, lm_loss


def profile_gpt(
    config: Any,
    microbatch_size: int,
    repeats: int = 5,
    seed: int = 0,
    transfer: bool = True,
    threads: int = 1,
) -> ModelProfile:
    """Profile the built-in GPT (:mod:`zerobubble_demo.models`) at ``microbatch_size`` sequences.

    With ``transfer`` two local gloo ranks are started: both time the transfer
    (:func:`measure_transfer`), rank 0 profiles the layers; without it, this process profiles and
    ``T_comm`` is 0.  ``threads`` is the intra-op thread count (that of the ranks that will train).
    """
    if microbatch_size < 1:
        raise ConfigError(f"microbatch size must be at least 1, got {microbatch_size}")
    if repeats < 1:
        raise ConfigError(f"repeats must be at least 1, got {repeats}")
    if not transfer:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return _profile_gpt_here(config, microbatch_size, repeats, seed, (0.0, 0.0))
        finally:
            torch.set_num_threads(previous)
    return launch(_profile_gpt_rank, 2, (config, microbatch_size, repeats, seed), threads=threads)[0]


def _profile_gpt_rank(config: Any, microbatch_size: int, repeats: int, seed: int) -> ModelProfile | None:
    init_distributed(backend="gloo", timeout=120)
    comm = measure_transfer(None, torch.device("cpu"))
    profile = (
        _profile_gpt_here(config, microbatch_size, repeats, seed, comm) if dist.get_rank() == 0 else None
    )
    dist.barrier()
    return profile


def _profile_gpt_here(
    config: Any, microbatch_size: int, repeats: int, seed: int, comm: tuple[float, float]
) -> ModelProfile:
    with torch.random.fork_rng(devices=[]):  # the caller's RNG state is left as it was
        torch.manual_seed(seed)
        layers = gpt_layers(config)
    inputs, targets = MarkovCorpus(config.vocab, config.seq_len, seed=seed).batch(microbatch_size)
    return profile_layers(layers, inputs, targets, lm_loss, repeats=repeats, comm=comm)
