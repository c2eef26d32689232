"""The environment the Python layer reads, through the core's table of knobs (common/knobs.h):
the same names, types, defaults and parse rules as the core's readers. A name the table does not
list raises RuntimeError; a value the knob does not take raises ValueError."""

from __future__ import annotations

from typing import Optional

from . import _C


def env_int(name: str) -> Optional[int]:
    """An int or size knob as set, else its default; None where the reader works it out."""
    return _C.knob_int(name)


def env_flag(name: str) -> bool:
    """A flag (on when set to anything but 0, as RINGCOMM_DEBUG) or a switch (0 or 1)."""
    return _C.knob_on(name)


def env_string(name: str) -> str:
    """A string or path knob as set, else its default value ("" where it has none); an enum's
    value, checked against what it takes."""
    return _C.knob_string(name)
