"""Weight-gradient deferral: the B/W split of every parameter of a stage.

A zero-bubble schedule runs the backward of a stage in two ops.  **B** computes the gradient of the
stage input, which the previous stage waits for; **W** computes the parameter gradients, which
nobody waits for, so the schedule may postpone it into a bubble.  :func:`install_deferral` splits
every module of a stage, with no change to the model:

* **fast paths** (:mod:`.rules`): closed-form splits for ``nn.Linear``, transformers' ``Conv1D``,
  ``Conv1d/2d/3d``, ``Embedding`` and the affine parts of ``LayerNorm``/``GroupNorm``/``BatchNorm``/
  ``RMSNorm`` (torch's and transformers' Llama, Mistral, Qwen2);
  B calls the backward kernel for the input only and W the one for the parameters, so the split
  costs about what the fused backward does.  :class:`FastPaths` registers rules for other types.
* **the generic split** (:mod:`.generic`): any other module owning parameters runs on a local
  autograd graph that B walks for the input gradients and W for the parameter gradients; the
  ``F.linear`` calls, ``x @ w`` products, biases and scales on leaf weights in its forward
  (``nn.MultiheadAttention``'s projections, a tied head, a block on raw weights) take a closed form
  instead (:mod:`.routed`), and a module they cover entirely runs without a local graph.

The deferred work of one stage lives in its :class:`WeightGradStore`, keyed by
``(stage, microbatch)``, so W ops may run in whatever order the schedule says; W frees what it held.
How it works, what it costs and how to register a rule: ``docs/wgrad.md``.
"""

from .generic import Bridge, LocalGraph
from .install import Deferral, install_deferral, remove_deferral
from .rules import FastPaths, SplitRule, default_fast_paths
from .store import WeightGradStore, accumulate, accumulate_product
from .verify import SplitGuard, SplitMismatchError, SplitMismatchWarning, SplitRecord

__all__ = [
    "Bridge",
    "Deferral",
    "FastPaths",
    "LocalGraph",
    "SplitGuard",
    "SplitMismatchError",
    "SplitMismatchWarning",
    "SplitRecord",
    "SplitRule",
    "WeightGradStore",
    "accumulate",
    "accumulate_product",
    "default_fast_paths",
    "install_deferral",
    "remove_deferral",
]
