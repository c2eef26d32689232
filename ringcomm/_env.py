"""RINGCOMM_* knobs read by the Python layer, parsed as the core parses its own (common/env.h):
unset or empty means the default, anything else must be what the knob takes. Every knob is
listed in docs/configuration.md."""
from __future__ import annotations

import os
import re

_DECIMAL = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]+")


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    if not value:
        return default
    # strtoll's decimal form, as the core takes it: leading blanks, a sign, ASCII digits, no more
    if not _DECIMAL.fullmatch(value):
        raise ValueError(f"{name}={value} is not an integer")
    return int(value)


def env_flag(name: str) -> bool:
    """Set to anything but 0 (RINGCOMM_DEBUG)."""
    return os.environ.get(name, "0") not in ("", "0")
