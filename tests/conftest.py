"""Shared test configuration: the test profiles and hypothesis's settings.

Three profiles, chosen by the environment variable ``ZEROBUBBLE_TESTS`` (``tests/helpers/_profile.py``):

* ``quick`` (the default: the README's ``python -m pytest -q``) runs every test but those marked
  ``slow`` or ``long``; the split fuzzer draws 100 stages, the training-equivalence property 12 and 3
  configurations (two and four ranks).
* ``ci`` also runs the ``slow`` tests — the larger spawned groups and sweeps that repeat what a quick
  test already covers at a smaller size — and the ``fuzz`` tests with more examples: the split fuzzer
  at 300 stages, the training-equivalence property at 150 and 40.  ``.ci/run`` runs
  ``ZEROBUBBLE_TESTS=ci python -m pytest -q -m "slow or fuzz"`` after the README's command.
* ``long`` (``ZEROBUBBLE_TESTS=long``, or ``ZEROBUBBLE_SLOW=1``) runs everything, ``long`` sweeps
  included, and the fuzzer at 5,000 stages.

Ranks start from a forkserver that imported torch once (``ZEROBUBBLE_START_METHOD``,
:func:`zerobubble.runtime.launch.start_context`): a group of ranks then starts in a fraction of a
second instead of about 1.2 s a rank.  Tests whose point is that ranks are independent processes
(the construction-time consistency checks) pass ``start_method="spawn"``.
"""

import os

import pytest
from _profile import profile
from hypothesis import HealthCheck, settings

settings.register_profile(
    "zerobubble",
    deadline=None,
    max_examples=40,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
settings.load_profile("zerobubble")

os.environ.setdefault("ZEROBUBBLE_START_METHOD", "forkserver")

# the markers each profile skips
_SKIPPED = {"quick": ("slow", "long"), "ci": ("long",), "long": ()}


def pytest_collection_modifyitems(config, items):
    """Skip the tests the profile leaves out, saying which profile runs them."""
    chosen = profile()
    for item in items:
        for marker in _SKIPPED[chosen]:
            if marker in item.keywords:
                runs_it = "ci" if marker == "slow" else "long"
                item.add_marker(pytest.mark.skip(reason=f"{marker}; ZEROBUBBLE_TESTS={runs_it} runs it"))
                break
