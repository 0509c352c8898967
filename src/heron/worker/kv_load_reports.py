"""Where background KV loads (disk tier, remote prefill engine) report back to
the step loop: each finished load as (request id, block hashes that failed)."""

from __future__ import annotations

import threading

from heron.core.hashing import BlockHash


class LoadReports:
    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._finished: list[tuple[str, list[BlockHash]]] = []
        self._in_flight = 0

    def started(self, count: int = 1) -> None:
        with self._lock:
            self._in_flight += count

    def finished(self, request_id: str, failed: list[BlockHash]) -> None:
        with self._lock:
            self._finished.append((request_id, failed))
            self._in_flight -= 1
            self._lock.notify_all()

    def take(self) -> list[tuple[str, list[BlockHash]]]:
        """Loads finished since the last call."""
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def wait(self, timeout: float) -> None:
        """Until a load finishes (or ``timeout`` seconds pass, or none is in flight)."""
        with self._lock:
            self._lock.wait_for(lambda: self._finished or not self._in_flight, timeout)
