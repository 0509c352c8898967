"""Keeping the cyclic garbage collector off a server's start-up objects.

After start-up a process holds hundreds of thousands of long-lived objects
(imported modules, the model's modules, the tokenizer, FastAPI's routes). Each
full collection walks all of them (about 100 ms on the development machine),
and a server makes enough new objects that one comes every so often: a pause
of the engine loop that shows up as an inter-token-latency spike. Freezing
moves everything alive at the end of start-up into a generation the collector
never scans (vLLM and SGLang do the same). Long-running server processes only:
an in-process ``LLM`` may be built and dropped many times in one program, and
cyclic garbage among frozen objects would never be collected.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_objects(process: str) -> int:
    """Collect what start-up left behind, then freeze the survivors; returns how
    many objects are frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: froze %d start-up objects out of the garbage collector's full collections", process, frozen)
    return frozen
