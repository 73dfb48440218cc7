"""Shared test configuration: hypothesis profile and the slow-test switch."""

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "zerobubble",
    deadline=None,
    max_examples=40,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
settings.load_profile("zerobubble")


def pytest_collection_modifyitems(config, items):
    """Skip tests marked slow unless ZEROBUBBLE_SLOW=1."""
    if os.environ.get("ZEROBUBBLE_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow; set ZEROBUBBLE_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
