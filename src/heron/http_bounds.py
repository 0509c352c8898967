"""What a client connection may hold of an HTTP server of heron's, in time and
in bytes of an unfinished request head: one set of rules for `heron serve`
(uvicorn's protocol, entrypoints/openai/http_limits.py) and `heron router`'s
own front (router/http_front.py).

Without them a client that sends a few bytes and stops, or never sends any,
or sends one header line that never ends, holds a descriptor (and, for the
header, memory) for ever, and enough such clients (slowloris) take every
descriptor the server has.
"""

from __future__ import annotations

from dataclasses import dataclass

# seconds a request's head may take to arrive whole (from the connection, or from its first byte)
HEAD_TIMEOUT_S = 30.0
# seconds a request's body may go without a byte
BODY_IDLE_TIMEOUT_S = 60.0
# and on average, past that first stretch, bytes a second it must bring (Apache's mod_reqtimeout rate): a byte
# every 25 s reset the idle bound for ever (slowloris by the body)
BODY_MIN_RATE = 500.0
# seconds an idle kept-alive connection stays open: longer than clients' pools keep one (httpx and the openai
# client: 5 s; aiohttp: 15 s), or a client reusing a connection the server is closing gets a reset
DEFAULT_KEEP_ALIVE_S = 20.0


@dataclass(frozen=True)
class ConnectionBounds:
    head_timeout_s: float = HEAD_TIMEOUT_S
    body_idle_timeout_s: float = BODY_IDLE_TIMEOUT_S
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S


DEFAULT_BOUNDS = ConnectionBounds()


class BodyClock:
    """The time a request's body may take: ``idle_s`` without a byte, and in
    all ``idle_s`` plus a second for every ``BODY_MIN_RATE`` bytes received."""

    def __init__(self, now: float, idle_s: float) -> None:
        self._idle_s = idle_s
        self._started = now
        self._received = 0

    def received(self, size: int) -> None:
        self._received += size

    def restart(self, now: float) -> None:
        """The server stopped reading meanwhile: the body's time starts again."""
        self._started, self._received = now, 0

    def seconds_left(self, now: float) -> float:
        """Until the body has stalled (no byte for ``idle_s``) or come too slowly."""
        overall = self._started + self._idle_s + self._received / BODY_MIN_RATE - now
        return max(0.0, min(self._idle_s, overall))


class HeadMeter:
    """The bytes received so far of the request head being parsed, counted
    from the raw reads: a parser reports a header only once its line has
    ended, so counting what it reports misses one line that never ends.

    Feed it the parser's callbacks and wrap each read in ``read_begins`` /
    ``read_ends``. Every read from the one where a head begins until the head
    is complete is the head's whole, except a read in which another request
    ended first: there only the parts the parser reported count (what came
    before the head, a body and its chunked framing, is not the head's; such
    framing read as the next head was a false 431). The count may fall short
    by that one read's unfinished line, never exceed the head."""

    # the request line's and the head's separators, which no callback reports
    _SEPARATORS = len(b"GET  HTTP/1.1\r\n\r\n")

    def __init__(self) -> None:
        self.head_bytes = 0  # of the head being parsed; -1 between a complete head and the next request's first byte
        self._began = False  # a request began in this read
        self._ended = False  # a request ended in this read
        self._reported = 0  # the reported parts of the head being parsed

    def read_begins(self) -> None:
        self._began = self._ended = False

    def message_begins(self) -> None:
        self.head_bytes = 0
        self._reported = self._SEPARATORS
        self._began = True

    def url(self, size: int) -> None:
        self._reported += size

    def header(self, name_and_value: int) -> None:
        self._reported += name_and_value + 4  # ": " and the line's end

    def headers_complete(self) -> None:
        self.head_bytes = -1

    def message_ends(self) -> None:
        self._ended = True

    def read_ends(self, size: int) -> int:
        """After a read of ``size`` bytes was parsed: the bytes of the
        unfinished head so far (-1 when no head is being received)."""
        if self.head_bytes < 0:
            return -1
        if self._began:
            self.head_bytes = self._reported if self._ended else size
        else:
            self.head_bytes += size
        return self.head_bytes
