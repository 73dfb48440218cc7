"""Byte amounts for the model-level planner: reading a budget (``"24GiB"``, ``"80%"``) and printing one.

Pure Python; no torch.
"""

from __future__ import annotations

import math
import re

from ..ir import ScheduleError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BYTES = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str | float | None, device_memory: float | None = None) -> float | None:
    """A byte budget: ``"24GiB"``, ``"500MB"``, ``1.5e9``, or ``"80%"`` of ``device_memory``.

    ``None`` means no budget.  Raises :class:`ScheduleError` for anything else.
    """
    if text is None:
        return None
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        value = _parse_text(str(text), device_memory)
    if not math.isfinite(value) or value <= 0:
        raise ScheduleError(f"a memory budget must be positive, got {text!r}")
    return value


def _parse_text(text: str, device_memory: float | None) -> float:
    stripped = text.strip()
    if stripped.endswith("%"):
        if device_memory is None:
            raise ScheduleError(
                f"memory budget {text!r} is a fraction of the device's memory, which is only known on a "
                "GPU; give an amount such as 24GiB"
            )
        try:
            return float(stripped[:-1]) / 100 * device_memory
        except ValueError:
            pass
    match = _BYTES.match(stripped)
    if match and match.group(2).lower() in _UNITS:
        return float(match.group(1)) * _UNITS[match.group(2).lower()]
    raise ScheduleError(
        f"cannot read memory budget {text!r}: give bytes with a unit (24GiB, 512MiB, 2GB), a number of "
        "bytes, or a percentage of the device's memory (80%)"
    )


def format_bytes(value: float) -> str:
    """``value`` bytes in binary units, e.g. ``"1.50 GiB"``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"
