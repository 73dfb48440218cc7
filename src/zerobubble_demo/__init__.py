"""The ``zerobubble train`` demo: a small GPT trained on a synthetic Markov corpus.

Not part of the library (``zerobubble``): an example job that uses it end to end.
:mod:`.models` holds the GPT and the corpus, :mod:`.train` the training job, :mod:`.profile` the
per-layer profile of that GPT for ``zerobubble plan``.  This module imports no torch.
"""


class ConfigError(ValueError):
    """A demo setting that cannot run (a ``zerobubble train``/``profile`` flag): one-line message."""
