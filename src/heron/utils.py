"""Small helpers every layer shares."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (also for numpy integers and arrays)."""
    return -(-a // b)
