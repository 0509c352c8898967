"""Every ``HERON_*`` environment variable heron reads, in one place.

Each is read when asked for, not at import, so a test (or a user) may set one
between engines. The names are public: README lists them.
"""

from __future__ import annotations

import math
import os

HERON_API_KEY = "HERON_API_KEY"  # accepted API keys, comma separated (heron serve)
HERON_CACHE_DIR = "HERON_CACHE_DIR"  # built kernels and converted weights (default ~/.cache/heron)
HERON_CPU_ISA = "HERON_CPU_ISA"  # CPU kernel build: auto | scalar | avx2 | avx512 | avx512_vnni
HERON_DISABLE_NATIVE = "HERON_DISABLE_NATIVE"  # no native CPU kernels at all (torch only)
HERON_DISABLE_NATIVE_DECODE = "HERON_DISABLE_NATIVE_DECODE"  # low-bit decode steps through torch
HERON_DISABLE_WEIGHT_CACHE = "HERON_DISABLE_WEIGHT_CACHE"  # convert a GGUF's weights at every start
HERON_ATTENTION_MAX_KV_SPLITS = "HERON_ATTENTION_MAX_KV_SPLITS"  # CUDA split-KV decode (1: off)
HERON_RAY_CPUS_PER_ENGINE = "HERON_RAY_CPUS_PER_ENGINE"  # CPUs each Ray engine-core actor reserves (default 1)
HERON_HUB_TIMEOUT_S = "HERON_HUB_TIMEOUT_S"  # seconds the Hub may take to answer whether a model exists (default 30)

ALL = (HERON_API_KEY, HERON_CACHE_DIR, HERON_CPU_ISA, HERON_DISABLE_NATIVE, HERON_DISABLE_NATIVE_DECODE,
       HERON_DISABLE_WEIGHT_CACHE, HERON_ATTENTION_MAX_KV_SPLITS, HERON_RAY_CPUS_PER_ENGINE, HERON_HUB_TIMEOUT_S)


def is_set(name: str) -> bool:
    """A flag variable: set to anything but "" or "0"."""
    return os.environ.get(name, "") not in ("", "0")


def get(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def positive_number(name: str, default: float, zero: bool = False) -> float:
    """A variable holding a finite number above 0 (or 0 too, with ``zero``;
    ``default`` when unset or empty); anything else is a ValueError naming the
    variable (one was reported as the network failing)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 <= value if zero else 0 < value) or value == math.inf:
        raise ValueError(f"{name}={text!r}: expected a finite number {'>= 0' if zero else 'above 0'}")
    return value


def cache_dir(kind: str) -> str:
    """``$HERON_CACHE_DIR/kind`` (default ``~/.cache/heron/kind``)."""
    base = os.environ.get(HERON_CACHE_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "heron")
    return os.path.join(base, kind)


def api_keys() -> list[str]:
    return [key.strip() for key in os.environ.get(HERON_API_KEY, "").split(",") if key.strip()]
