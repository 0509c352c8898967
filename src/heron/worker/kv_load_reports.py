"""Where background KV loads (disk tier, remote prefill engine) report back to
the step loop: each finished load as (request id, block hashes that failed)."""

from __future__ import annotations

import threading

from heron.core.hashing import BlockHash


class LoadReports:
    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._finished: list[tuple[str, list[BlockHash]]] = []
        self._errors: dict[str, str] = {}  # why a load's blocks failed, by request id
        self._in_flight = 0

    def started(self, count: int = 1) -> None:
        with self._lock:
            self._in_flight += count

    def finished(self, request_id: str, failed: list[BlockHash], error: str | None = None) -> None:
        """``error``: why ``failed`` could not be loaded (a failed request is told)."""
        with self._lock:
            self._finished.append((request_id, failed))
            if failed and error:
                self._errors[request_id] = error
            self._in_flight -= 1
            self._lock.notify_all()

    def take(self) -> list[tuple[str, list[BlockHash]]]:
        """Loads finished since the last call."""
        return self.take_with_errors()[0]

    def take_with_errors(self) -> tuple[list[tuple[str, list[BlockHash]]], dict[str, str]]:
        """Loads finished since the last call, and why those that failed did."""
        with self._lock:
            finished, self._finished = self._finished, []
            errors, self._errors = self._errors, {}
        return finished, errors

    def wait(self, timeout: float) -> None:
        """Until a load finishes (or ``timeout`` seconds pass, or none is in flight)."""
        with self._lock:
            self._lock.wait_for(lambda: self._finished or not self._in_flight, timeout)
