"""SIGTERM and SIGINT in an API server, from its coroutine's first line until
the server has stopped: each stops it gracefully, and heron then exits 0
(during the engines' shutdown after it, the handlers found are back).

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
    server: Any = None  # a uvicorn_server.Server, once built
    previous: dict[int, Any] = field(default_factory=dict)  # the handlers to put back

    def stop(self, server: Any) -> None:
        """``server`` stops on a signal from now on, and at once if one came already
        (a Ctrl-C counts as its first: the next one forces the exit, as under uvicorn)."""
        self.server = server
        for signum in self.received:
            self._tell(signum)

    def restore(self) -> None:
        """Put the handlers found back (once the server has stopped: a second Ctrl-C
        or a SIGTERM then ends the engines' shutdown as it did)."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        if self.server is not None:
            self._tell(signum)

    def _tell(self, signum: int) -> None:
        self.server.should_exit = True
        if signum == signal.SIGINT:
            self.server.note_interrupt()


@contextmanager
def stop_signals_heard() -> Iterator[StopSignals]:
    """Install the handler for the block, or until ``restore()`` (main thread only;
    elsewhere signals are not this thread's)."""
    heard = StopSignals()
    if threading.current_thread() is not threading.main_thread():
        yield heard
        return
    heard.previous = {sig: signal.signal(sig, heard._handle) for sig in STOP_SIGNALS}
    try:
        yield heard
    finally:
        heard.restore()
