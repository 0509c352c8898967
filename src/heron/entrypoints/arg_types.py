"""Argparse types for bounded numbers: a value out of bounds (or no number at
all) is a usage error naming the flag, not a ZeroDivisionError later on."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def number_at_least(kind: type[int] | type[float], minimum: float, *, above: bool = False) -> Callable[[str], float]:
    """A type reading ``kind`` no smaller than ``minimum`` (greater than it when
    ``above``); NaN is refused too."""
    bound = f"> {minimum:g}" if above else f">= {minimum:g}"
    name = "an integer" if kind is int else "a number"

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {name} {bound}, got {text!r}") from None
        if not (value > minimum if above else value >= minimum):
            raise argparse.ArgumentTypeError(f"expected {name} {bound}, got {text!r}")
        return value

    return parse


POSITIVE_INT = number_at_least(int, 1)
NON_NEGATIVE_INT = number_at_least(int, 0)
POSITIVE_FLOAT = number_at_least(float, 0, above=True)
NON_NEGATIVE_FLOAT = number_at_least(float, 0)


def port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535: a port past it failed only when
    the server bound it, with a traceback, after the model had loaded."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number (0-65535), got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number (0-65535), got {text!r}")
    return value


def percentiles(text: str) -> list[float]:
    """A comma-separated list of percentiles, each within [0, 100]: one out of
    range failed only when the report was computed, after the whole run."""
    values = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected percentiles such as 50,90,99, got {text!r}") from None
        if not 0 <= value <= 100:
            raise argparse.ArgumentTypeError(f"each percentile must be within [0, 100], got {item.strip()!r}")
        values.append(value)
    return values


def range_ratio(text: str) -> float:
    """A length range ratio r in [0, 1): lengths drawn from [L(1-r), L(1+r)]
    (a negative r or one of 1 or more drew lengths off that mean, or none)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return value
