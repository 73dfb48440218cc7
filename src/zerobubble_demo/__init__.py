"""The ``zerobubble train`` demo: a small GPT trained on a synthetic Markov corpus.

Not part of the library (``zerobubble``): an example job that uses it end to end, through the
library's public modules only (``docs/architecture.md``, "The public surface").
:mod:`.models` holds the GPT and the corpus, :mod:`.train` the training job, :mod:`.profile` the
per-layer profile of that GPT for ``zerobubble plan``, :mod:`.split_models` the small models the
B/W split is checked and measured on.  This module imports no torch.
"""

from zerobubble.errors import ConfigError

__all__ = ["ConfigError"]
