"""A replica's health as the router sees it: a circuit breaker fed by the
outcome of every request and probe.

closed (in use) -> open after ``failure_threshold`` consecutive failures (a
connection error, a timeout, a 5xx; a 4xx is the client's fault and counts as
a success) -> half-open after ``open_seconds``: one request or probe is let
through -> closed again on its success, open again (for twice as long, up to
``max_open_seconds``) on its failure. Failures reported while open (requests
sent before it opened) change nothing.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


# server errors that say the replica is unwell; the others answer the request itself: 504 is a replica's own
# --request-timeout (its work ran too long, another replica would take as long), 501/505 a request it cannot
# serve. Retrying a 504 ran one long request on every replica, and a few opened healthy replicas' breakers.
REPLICA_FAILURES = frozenset({500, 502, 503})


# set on a replica's error answer to a request that failed on its own while the replica serves on (a KV pull
# under kv_load_failure_policy "fail"): the router passes it through, neither blaming the replica nor sending
# the request elsewhere (one dead prefill engine's handles opened every decode replica's breaker)
REQUEST_FAILURE_HEADER = "x-heron-request-failure"


def is_request_failure(headers: list[tuple[str, str]]) -> bool:
    """Whether an answer's headers say that its error is the request's alone."""
    return any(name.lower() == REQUEST_FAILURE_HEADER for name, _ in headers)


def is_replica_failure(status: int | None) -> bool:
    """Whether an outcome counts against the replica (and another may be tried):
    no response at all (None) or a 500, 502 or 503. Client errors (4xx, 429
    included) never do, nor a 504, 501 or 505 (the request's own answer)."""
    return status is None or status in REPLICA_FAILURES


@dataclass
class CircuitBreaker:
    failure_threshold: int = 3
    open_seconds: float = 2.0
    max_open_seconds: float = 30.0
    clock: Callable[[], float] = time.monotonic
    state: BreakerState = BreakerState.CLOSED
    consecutive_failures: int = 0
    _opened_at: float = 0.0
    _current_open_seconds: float = field(default=0.0)
    _trial_in_flight: bool = False

    def allows(self) -> bool:
        """Whether a request may go to the replica now (half-open: one trial at a time)."""
        if self.state is BreakerState.OPEN and self.clock() - self._opened_at >= self._current_open_seconds:
            self.state = BreakerState.HALF_OPEN
            self._trial_in_flight = False
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.HALF_OPEN and not self._trial_in_flight:
            self._trial_in_flight = True
            return True
        return False

    def release_trial(self) -> None:
        """A request given the half-open trial ended with no verdict (its client
        left, the router's deadline passed): the next request may take it. It
        used to stay taken until the next health probe."""
        if self.state is BreakerState.HALF_OPEN:
            self._trial_in_flight = False

    @property
    def usable(self) -> bool:
        """Closed, or open long enough to be tried again (does not take the trial)."""
        if self.state is BreakerState.OPEN:
            return self.clock() - self._opened_at >= self._current_open_seconds
        return self.state is BreakerState.CLOSED or not self._trial_in_flight

    def record(self, status: int | None) -> None:
        """The outcome of a request or probe: an HTTP status, or None for no response."""
        if not is_replica_failure(status):
            self.state = BreakerState.CLOSED
            self.consecutive_failures = 0
            self._current_open_seconds = 0.0
            self._trial_in_flight = False
            return
        if self.state is BreakerState.OPEN:
            return  # a late answer to a request sent before it opened: the open period stands
        self.consecutive_failures += 1
        if self.state is BreakerState.HALF_OPEN or self.consecutive_failures >= self.failure_threshold:
            self._open()

    def _open(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self._current_open_seconds = min(
                self.max_open_seconds, max(self.open_seconds, 2 * self._current_open_seconds)
            )
        else:
            self._current_open_seconds = self.open_seconds
        self.state = BreakerState.OPEN
        self._opened_at = self.clock()
        self._trial_in_flight = False
