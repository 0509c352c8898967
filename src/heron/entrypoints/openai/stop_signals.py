"""SIGTERM and SIGINT in an API server, from its coroutine's first line to its
end: each stops the server gracefully, and heron then exits 0.

Before uvicorn installs its own handlers (the engine client and the app are
built first: the tokenizer loads then, for a second or more) asyncio.run's
SIGINT handler was in place: it cancelled the task, which surfaced inside
uvicorn's lifespan start-up and was logged there as an error traceback. Now a
signal then marks the server to stop as soon as it starts.

While uvicorn serves, its handlers stop it; when it has stopped it raises the
signals it caught again for the handler it found, which must not kill the
process (code -15 before the engine's shutdown ran): this one only records."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass
class StopSignals:
    """The stop signals received outside uvicorn's handlers, and the server to stop on one."""

    received: list[int] = field(default_factory=list)
    server: Any = None  # a uvicorn.Server, once built

    def stop(self, server: Any) -> None:
        """``server`` stops on a signal from now on, and at once if one came already."""
        self.server = server
        if self.received:
            server.should_exit = True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        if self.server is not None:
            self.server.should_exit = True


@contextmanager
def stop_signals_heard() -> Iterator[StopSignals]:
    """Install the handler for the block (main thread only; elsewhere signals are not this thread's)."""
    heard = StopSignals()
    if threading.current_thread() is not threading.main_thread():
        yield heard
        return
    previous = {sig: signal.signal(sig, heard._handle) for sig in STOP_SIGNALS}
    try:
        yield heard
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
