"""RINGCOMM_* knobs read by the Python layer, parsed as the core parses its own (common/env.h):
unset or empty means the default, anything else must be what the knob takes. Every knob is
listed in docs/configuration.md."""
from __future__ import annotations

import os


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    if not value:
        return default
    try:
        return int(value, 10)
    except ValueError:
        raise ValueError(f"{name}={value} is not an integer") from None


def env_flag(name: str) -> bool:
    """Set to anything but 0 (RINGCOMM_DEBUG)."""
    return os.environ.get(name, "0") not in ("", "0")
