"""Argparse types for bounded numbers: a value out of bounds (or no number at
all) is a usage error naming the flag, not a ZeroDivisionError later on."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def number_at_least(kind: type[int] | type[float], minimum: float, *, above: bool = False,
                    finite: bool = False) -> Callable[[str], float]:
    """A type reading ``kind`` no smaller than ``minimum`` (greater than it when
    ``above``); NaN is refused too, and infinity when ``finite``."""
    bound = f"> {minimum:g}" if above else f">= {minimum:g}"
    name = ("a finite number" if finite else "a number") if kind is float else "an integer"

    def within(value: float) -> bool:
        return (value > minimum if above else value >= minimum) and (not finite or math.isfinite(value))

    def parse(text: str) -> float:
        return _read(kind, text, f"{name} {bound}", within)

    return parse


POSITIVE_INT = number_at_least(int, 1)
NON_NEGATIVE_INT = number_at_least(int, 0)
POSITIVE_FLOAT = number_at_least(float, 0, above=True)
NON_NEGATIVE_FLOAT = number_at_least(float, 0)
FINITE_NON_NEGATIVE_FLOAT = number_at_least(float, 0, finite=True)
FINITE_POSITIVE_FLOAT = number_at_least(float, 0, above=True, finite=True)


def _read(kind: type[int] | type[float], text: str, expected: str, within: Callable[[float], bool]) -> float:
    """``text`` as ``kind`` when ``within`` holds for it, else a usage error saying ``expected``."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not within(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535: a port past it failed only when
    the server bound it, with a traceback, after the model had loaded."""
    return int(_read(int, text, "a port number (0-65535)", lambda value: 0 <= value <= 65535))


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
    return _read(float, text, "a number in [0, 1)", lambda value: 0 <= value < 1)


def unit_interval(*, above_zero: bool = False) -> Callable[[str], float]:
    """A type reading a number in [0, 1], or in (0, 1] when ``above_zero`` (a top_p of 0)."""
    expected = "a number in (0, 1]" if above_zero else "a number in [0, 1]"

    def parse(text: str) -> float:
        return _read(float, text, expected, lambda value: (value > 0 if above_zero else value >= 0) and value <= 1)

    return parse


def add_keep_alive_timeout(group: argparse._ActionsContainer) -> None:
    """--keep-alive-timeout, as heron serve and heron router both take it."""
    from heron.http_bounds import BODY_IDLE_TIMEOUT_S, BODY_MIN_RATE, DEFAULT_KEEP_ALIVE_S, HEAD_TIMEOUT_S

    group.add_argument("--keep-alive-timeout", type=FINITE_POSITIVE_FLOAT, default=DEFAULT_KEEP_ALIVE_S,
                       metavar="SECONDS",
                       help="seconds an idle kept-alive connection stays open; longer than the idle expiry of the "
                            "clients' pools (httpx and the openai client: 5 s, aiohttp: 15 s), so that a client "
                            "never sends a request on a connection the server is closing (it would get a reset). "
                            f"A request's head must arrive within {HEAD_TIMEOUT_S:g} s; its body may pause "
                            f"{BODY_IDLE_TIMEOUT_S:g} s and must bring {BODY_MIN_RATE:g} bytes a second after")
