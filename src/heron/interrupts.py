"""Ctrl-C held off while work that must not stop half done runs."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """SIGINT received inside the block is held and raised as KeyboardInterrupt
    once the block has ended. For steps whose effects were already recorded
    elsewhere (a KV tier's index lists the blocks a copy is about to write): an
    interrupt half way through left the record false. Only in the main thread
    with Python's own handler installed; anywhere else the block runs as is."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt
