"""Argument checks shared by the Python front ends."""

from __future__ import annotations

import operator
from typing import Any, Optional


def as_int(value: Any) -> Optional[int]:
    """``value`` as an int where it is an integer (int, numpy integer, 0-d integer
    tensor), else None (a bool, a float such as 2.7 or 2.0, a string)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
