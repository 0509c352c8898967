"""Small helpers every layer shares."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import numpy as np

IntOrArray = TypeVar("IntOrArray", int, "np.ndarray")


def cdiv(a: IntOrArray, b: int) -> IntOrArray:
    """``ceil(a / b)`` for integers, and elementwise for integer numpy arrays."""
    return -(-a // b)
