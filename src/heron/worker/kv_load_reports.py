"""Where background KV loads (disk tier, remote prefill engine) report back to
the step loop: each finished load as (request id, block hashes that failed),
why they failed, and which loads' failures were only misses (a block file
another replica had deleted: not there, rather than broken)."""

from __future__ import annotations

import threading

from heron.core.hashing import BlockHash


class LoadReports:
    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._finished: list[tuple[str, list[BlockHash]]] = []
        self._errors: dict[str, str] = {}  # why a load's blocks failed, by request id
        self._misses: set[str] = set()  # loads whose first failed block was not there at all
        self._in_flight = 0

    def started(self, count: int = 1) -> None:
        with self._lock:
            self._in_flight += count

    def finished(self, request_id: str, failed: list[BlockHash], error: str | None = None,
                 missed: bool = False) -> None:
        """``error``: why ``failed`` could not be loaded (a failed request is told);
        ``missed``: the first of ``failed`` was not there at all (a cache miss,
        computed again whatever the failure policy)."""
        with self._lock:
            self._finished.append((request_id, failed))
            if failed and error:
                self._errors[request_id] = error
            if failed and missed:
                self._misses.add(request_id)
            self._in_flight -= 1
            self._lock.notify_all()

    def take(self) -> list[tuple[str, list[BlockHash]]]:
        """Loads finished since the last call."""
        return self.take_with_errors()[0]

    def take_with_errors(self) -> tuple[list[tuple[str, list[BlockHash]]], dict[str, str], set[str]]:
        """Loads finished since the last call, why those that failed did, and
        which of them only missed."""
        with self._lock:
            finished, self._finished = self._finished, []
            errors, self._errors = self._errors, {}
            misses, self._misses = self._misses, set()
        return finished, errors, misses

    def wait(self, timeout: float) -> None:
        """Until a load finishes (or ``timeout`` seconds pass, or none is in flight)."""
        with self._lock:
            self._lock.wait_for(lambda: self._finished or not self._in_flight, timeout)
