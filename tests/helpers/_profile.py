"""Which test profile runs: ``quick``, ``ci`` or ``long`` (``ZEROBUBBLE_TESTS``; see ``conftest.py``)."""

from __future__ import annotations

import os

import pytest

PROFILES = ("quick", "ci", "long")


def profile() -> str:
    """The profile of this run: ``ZEROBUBBLE_TESTS``, ``long`` under ``ZEROBUBBLE_SLOW=1``, else ``quick``."""
    if os.environ.get("ZEROBUBBLE_SLOW") == "1":
        return "long"
    chosen = os.environ.get("ZEROBUBBLE_TESTS", "quick")
    if chosen not in PROFILES:
        raise ValueError(f"ZEROBUBBLE_TESTS={chosen!r}: choose one of {', '.join(PROFILES)}")
    return chosen


def fuzz_examples() -> int:
    """How many stages the split fuzzer draws: 100 quick, 300 in CI's profile, 5,000 long."""
    return {"quick": 100, "ci": 300, "long": 5000}[profile()]


#: A fixture's rank counts: 2 in every profile, 4 (a larger spawned group) from CI's profile on.
TWO_AND_FOUR_RANKS = (2, pytest.param(4, marks=pytest.mark.slow))
