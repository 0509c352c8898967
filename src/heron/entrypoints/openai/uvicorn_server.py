"""uvicorn's server, but a SIGINT forces the exit (requests cut, the shutdown
skipped) only after an earlier SIGINT, not after any earlier stop: one of
several API servers (``--api-server-count``) gets the terminal's Ctrl-C and
its launcher's SIGTERM in either order, and when the SIGTERM came first
uvicorn took the Ctrl-C for a second one and cut that server's streams at
once (found by the lifecycle review)."""

from __future__ import annotations

import signal
from types import FrameType

import uvicorn


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._interrupted = False

    def note_interrupt(self) -> None:
        """A Ctrl-C came before uvicorn's own handlers: the next one forces the exit."""
        self._interrupted = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGINT and not self._interrupted:
            self._interrupted = True
            self._captured_signals.append(sig)
            self.should_exit = True  # a first Ctrl-C stops gracefully, whatever stopped it before
            return
        super().handle_exit(sig, frame)
