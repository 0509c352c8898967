"""The router's HTTP/1.1 front door: a small asyncio server on httptools (the C
parser uvicorn uses), so that a proxied request costs a parse and a few writes
rather than a web framework's request and response objects.

Measured on a 2-core EPYC (BENCHMARKS.md, issue #18): the time to the first
streamed chunk through the router, over a direct request, went from 1.4-2.6 ms
with aiohttp's server and client to a fraction of a millisecond.

Invariants:
- requests on one connection are answered one at a time, in order (pipelined
  requests wait their turn; a client that floods them is paused);
- flow control belongs to the connection, not to one response: while the
  client's socket buffer is full (asyncio says so once, in ``pause_writing``,
  whichever response filled it), no queued request is started, and a response
  that starts then pauses its source at once;
- a response is complete (its Content-Length sent, or its chunked framing
  ended) before the next one starts, or the connection is closed;
- a client that goes away cancels the handler of its request, so whatever the
  handler holds (an upstream request) is dropped with it; a client that only
  half-closes (sends its end of stream) counts as gone, as with uvicorn: a
  closed socket looks the same until a write fails, and a generation must not
  run on for a client that left;
- a request that cannot be parsed, or is too large, is answered 400 / 413 /
  431 after the requests before it, and the connection closed; the handler
  never sees it, nor anything after it (nor after a request that asked for
  ``Connection: close``);
- an HTTP/1.0 client gets no chunked framing: a streamed answer of unknown
  length is sent bare and the connection closed after it;
- an offer to upgrade (h2c, websocket) is declined by answering in HTTP/1.1.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httptools

from heron.http_bounds import BODY_MIN_RATE, DEFAULT_BOUNDS, BodyClock, ConnectionBounds, HeadMeter
from heron.router.response_writer import ResponseWriter, error_body

logger = logging.getLogger(__name__)

STOPPING = "the router is stopping"
MAX_BODY_BYTES = 64 << 20
MAX_HEAD_BYTES = 64 << 10
_MAX_QUEUED_REQUESTS = 8  # pipelined requests held before the client is paused


@dataclass
class HttpRequest:
    method: str
    path: str  # without the query string
    query: str  # the raw query string, '' when none
    headers: dict[str, str]  # names lower-cased; a repeated header keeps its last value
    body: bytes
    client: str = ""  # the peer's address ('' where the transport has none)

    @property
    def path_qs(self) -> str:
        return f"{self.path}?{self.query}" if self.query else self.path


Handler = Callable[[HttpRequest, ResponseWriter], Awaitable[None]]
CorsHeaders = Callable[[str | None], list[tuple[str, str]]]  # a request's Origin -> the CORS headers it gets


def no_cors(origin: str | None) -> list[tuple[str, str]]:
    return []


class FrontConnection(asyncio.Protocol):
    """One client connection: parses requests and runs ``handler`` on each in turn."""

    def __init__(self, handler: Handler, open_connections: set[FrontConnection] | None = None,
                 bounds: ConnectionBounds = DEFAULT_BOUNDS, cors: CorsHeaders = no_cors) -> None:
        """``open_connections``: where this connection is listed while it is open (a graceful stop's);
        ``bounds``: how long a head, a stalled body and an idle connection may take; ``cors``: the
        headers the answers written here (never by the handler) carry, from the request's Origin."""
        self._handler = handler
        self._cors = cors
        self._open_connections = open_connections
        self._bounds = bounds
        self._meter = HeadMeter()  # the unfinished head's bytes, counted from the reads
        self._timer: asyncio.TimerHandle | None = None  # the one bound running: head, body or idle
        self._in_message = False  # between a request's first byte and its end
        self._body_clock: BodyClock | None = None  # the time the body being received may take
        self._reading_paused = False  # by the router (requests queued, or a rejection): no bound runs against it
        self._queued_bytes = 0  # of the bodies of the requests queued
        self._draining = False  # the router is stopping: no request is started, the connection closes
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._client = ""
        self._queue: deque[tuple[HttpRequest, bool, bool]] = deque()  # request, keep-alive, HTTP/1.0
        self._task: asyncio.Task[None] | None = None
        self._writer: ResponseWriter | None = None
        self._client_paused = False  # the client's socket buffer is full, whichever answer filled it
        self._rejected = False  # nothing more is parsed (a bad request, or one after which the client closes)
        # answered once the requests before it are: status, message, code, CORS headers
        self._rejection: tuple[int, str, str | None, list[tuple[str, str]]] | None = None
        self._reset_message()

    # ---- asyncio.Protocol -----------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        peer = transport.get_extra_info("peername")
        self._client = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        send_at_once(transport)
        if self._open_connections is not None:
            self._open_connections.add(self)
        self._bound(self._bounds.head_timeout_s, self._head_too_late)  # a connection that never sends a byte too

    def data_received(self, data: bytes) -> None:
        if self._rejected:
            return
        self._meter.read_begins()
        try:
            self._feed(data)
        finally:
            if not self._rejected and self._meter.read_ends(len(data)) > MAX_HEAD_BYTES:
                self._head_too_large()

    def _feed(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            if self._parser.get_method() == b"CONNECT":
                self._reject(400, "CONNECT is not supported")
                return
            # an offer to upgrade (h2c, websocket) that the router declines: the request
            # was read whole and is answered in HTTP/1.1; what follows is parsed afresh
            self._parser = httptools.HttpRequestParser(self)
            rest = data[exc.args[0]:] if exc.args and isinstance(exc.args[0], int) else b""
            if rest:
                self._feed(rest)
        except httptools.HttpParserError as exc:
            if not self._rejected:
                self._reject(400, f"malformed HTTP request: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        if self._open_connections is not None:
            self._open_connections.discard(self)
        self._unbound()
        self._queue.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def pause_writing(self) -> None:
        self._client_paused = True
        if self._writer is not None:
            self._writer.client_paused = True
            if self._writer.on_pause is not None:
                self._writer.on_pause()

    def resume_writing(self) -> None:
        self._client_paused = False
        if self._writer is not None:
            self._writer.client_paused = False
            if self._writer.on_resume is not None:
                self._writer.on_resume()
        self._next()  # a queued request may start now

    # ---- httptools callbacks ----------------------------------------------------

    def _reset_message(self) -> None:
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._head_bytes = 0  # of the parts of a head reported so far (the meter counts one not yet parsed)
        self._body_bytes = 0

    def on_message_begin(self) -> None:
        self._reset_message()
        self._meter.message_begins()
        self._in_message = True
        self._bound(self._bounds.head_timeout_s, self._head_too_late)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._meter.url(len(url))
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._meter.header(len(name) + len(value))
        self._count_head(len(name) + len(value))
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self._meter.headers_complete()
        # ended at once when there is none
        self._body_clock = BodyClock(asyncio.get_running_loop().time(), self._bounds.body_idle_timeout_s)
        self._bound_body()
        length = self._headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            self._reject(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
        idle = not self._queue and (self._task is None or self._task.done())
        if (self._headers.get("expect", "").lower() == "100-continue" and self._transport is not None
                and idle and not self._rejected):
            # only between answers (a client that gets none sends its body after a pause)
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._body_clock is not None:
            self._body_clock.received(len(body))
            self._bound_body()
        self._body_bytes += len(body)
        if self._body_bytes > MAX_BODY_BYTES:
            self._reject(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
        if not self._rejected:
            self._body.append(body)

    def on_message_complete(self) -> None:
        self._meter.message_ends()
        self._in_message = False
        self._body_clock = None
        self._unbound()
        if self._rejected:
            return
        url = httptools.parse_url(self._url)
        request = HttpRequest(
            method=self._parser.get_method().decode("latin-1"),
            path=(url.path or b"/").decode("latin-1"),
            query=(url.query or b"").decode("latin-1"),
            headers=self._headers,
            body=b"".join(self._body),
            client=self._client,
        )
        keep_alive = self._parser.should_keep_alive()
        self._queue.append((request, keep_alive, self._parser.get_http_version() == "1.0"))
        self._queued_bytes += len(request.body)
        if not keep_alive:
            self._rejected = True  # the client closes after this one: whatever follows is not read
        if len(self._queue) > _MAX_QUEUED_REQUESTS or self._queued_bytes > MAX_BODY_BYTES:
            self._pause_reading()
        self._next()

    # ---- running requests ----------------------------------------------------------

    def _next(self) -> None:
        """Starts the next queued request, unless one is under way or the client
        is not reading what was sent (``resume_writing`` calls again)."""
        if self._task is not None and not self._task.done():
            return
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if (not self._queue and not self._in_message and not self._draining
                and (self._rejection is None or self._client_paused)):
            # idle, or not reading what it was sent: kept for so long
            self._bound(self._bounds.keep_alive_s, self._close_idle)
        if self._client_paused:
            return
        if self._draining:
            self._unbound()
            if self._queue:  # sent on a kept-alive connection as the router stops: refused, not cut later
                request, _, http10 = self._queue.popleft()
                refusal = ResponseWriter(transport, keep_alive=False, head_only=request.method == "HEAD",
                                         http10=http10)
                refusal.own_headers = self._cors(request.headers.get("origin"))
                refusal.send_json(503, error_body(503, STOPPING, "server_stopping"))
            transport.close()
            return
        if not self._queue:
            if self._rejection is not None:  # every request before the bad one is answered
                status, message, code, cors_headers = self._rejection
                refusal = ResponseWriter(transport, keep_alive=False, head_only=False)
                refusal.own_headers = cors_headers  # a page's script can read why (a 413, a 408)
                refusal.send_json(status, error_body(status, message, code))
                transport.close()
            return
        request, keep_alive, http10 = self._queue.popleft()
        self._queued_bytes -= len(request.body)
        if (self._reading_paused and not self._rejected and len(self._queue) <= _MAX_QUEUED_REQUESTS // 2
                and self._queued_bytes <= MAX_BODY_BYTES // 2):
            self._reading_paused = False
            transport.resume_reading()
        if not self._in_message:
            self._unbound()  # busy, not idle
        self._writer = ResponseWriter(transport, keep_alive, head_only=request.method == "HEAD", http10=http10,
                                      client_paused=self._client_paused)
        self._task = asyncio.get_running_loop().create_task(self._run(request, self._writer))

    async def _run(self, request: HttpRequest, writer: ResponseWriter) -> None:
        assert self._transport is not None
        try:
            await self._handler(request, writer)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 (a bug in a handler costs that request, never the server)
            logger.exception("the router failed on %s %s", request.method, request.path)
            if not writer.started:
                writer.send_json(500, error_body(500, "the router failed on this request"))
        if not writer.finished or not writer.keep_alive:
            self._transport.close()
            return
        self._writer = None
        self._task = None
        self._next()

    # ---- a graceful stop ---------------------------------------------------------

    def drain(self) -> None:
        """The router is stopping: an idle connection closes now; one with an
        answer under way closes after it (its head, if not yet sent, says
        ``connection: close``), and a request that comes meanwhile is refused
        with a 503 instead of being taken and cut at the deadline."""
        self._draining = True
        if self._writer is not None and not self._writer.started:
            self._writer.keep_alive = False
        self._next()

    def cut(self) -> None:
        """The graceful stop's time is up: the answer under way ends with an
        error (a 503 if it has not started, an error event and ``[DONE]`` in a
        stream, else the connection is closed) and its handler is cancelled."""
        if self._writer is not None:
            self._writer.fail(503, error_body(503, f"{STOPPING}; this request was cut at its shutdown timeout",
                                              "server_stopping"))
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._transport is not None:
            self._transport.close()

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_HEAD_BYTES:
            self._head_too_large()

    def _head_too_large(self) -> None:
        self._reject(431, f"the request line and headers are larger than {MAX_HEAD_BYTES} bytes")

    # ---- the connection's time bounds -------------------------------------------

    def _bound(self, seconds: float, expired: Callable[[], None]) -> None:
        """Runs ``expired`` in ``seconds`` unless another bound replaces this one first."""
        self._unbound()
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expire, seconds, expired)

    def _unbound(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _bound_body(self) -> None:
        assert self._body_clock is not None
        self._bound(self._body_clock.seconds_left(asyncio.get_running_loop().time()), self._body_stalled)

    def _expire(self, seconds: float, expired: Callable[[], None]) -> None:
        self._timer = None
        if self._reading_paused and not self._rejected:
            if self._body_clock is not None:  # a body's time starts again when the router reads again
                self._body_clock.restart(asyncio.get_running_loop().time())
                seconds = self._bounds.body_idle_timeout_s
            self._bound(seconds, expired)  # the router is not reading: the client is not the one late
        else:
            expired()

    def _close_idle(self) -> None:
        """Closes a connection past its keep-alive bound; one whose client is not
        reading what it was sent is dropped (a close waits for the buffer to drain)."""
        if self._transport is not None:
            if self._transport.get_write_buffer_size():
                self._transport.abort()
            else:
                self._transport.close()

    def _head_too_late(self) -> None:
        self._reject(408, f"the request's head did not arrive within {self._bounds.head_timeout_s:g} s",
                     "request_timeout")

    def _body_stalled(self) -> None:
        self._reject(408, f"the request's body sent no byte for {self._bounds.body_idle_timeout_s:g} s, or came "
                          f"slower than {BODY_MIN_RATE:g} bytes a second",
                     "request_timeout")

    def _pause_reading(self) -> None:
        self._reading_paused = True
        if self._transport is not None:
            self._transport.pause_reading()

    def _reject(self, status: int, message: str, code: str | None = None) -> None:
        """Answers a request the handler never sees, after the requests before
        it (never in the middle of another answer), and closes the connection;
        nothing the client sent after it is read."""
        if self._rejection is not None:
            return
        self._unbound()
        self._in_message = False  # the request is not read further
        self._rejected = True
        self._rejection = (status, message, code, self._cors(self._headers.get("origin")))
        self._pause_reading()
        self._next()


def send_at_once(transport: asyncio.Transport) -> None:
    """TCP_NODELAY on a TCP connection: a relayed event goes out when written."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def serve(handler: Handler, host: str, port: int, open_connections: set[FrontConnection] | None = None,
                bounds: ConnectionBounds = DEFAULT_BOUNDS, cors: CorsHeaders = no_cors) -> asyncio.Server:
    """A listening server running ``handler`` on every request (``open_connections``: kept
    listing its connections, for a graceful stop to ``drain`` and ``cut``)."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: FrontConnection(handler, open_connections, bounds, cors), host, port,
                                    reuse_address=True)
