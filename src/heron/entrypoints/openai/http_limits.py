"""Limits on the size of what a client sends, before any handler reads it: the
body (``--max-request-body-bytes``, 413) and the headers (``--max-header-bytes``,
431), answered in OpenAI's error shape.

The header limit holds at two places:

* exactly, on the headers the app receives (the sum of the names' and values'
  lengths), by ``RequestSizeLimitMiddleware``; the connection stays usable;
* at the connection, so that no head is buffered without bound first:
  httptools (uvicorn's parser when it is installed) keeps reading a request
  head of any size, so ``bounded_http_protocol`` answers 431 and closes the
  connection once an unfinished head (request line and headers) passes
  ``head_limit`` bytes; without httptools, uvicorn's h11 parser stops at the
  same bound by itself (``h11_max_incomplete_event_size``, a plain 400).
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from heron import http_bounds
from heron.entrypoints.openai.errors import APIError, bad_request, body_too_large, headers_too_large
from heron.http_bounds import BodyClock, HeadMeter


def head_limit(max_header_bytes: int) -> int:
    """The most bytes of an unfinished request head a connection buffers: room
    for headers at the limit plus a request line and the separators."""
    return 2 * max_header_bytes


class RequestSizeLimitMiddleware:
    """431 for headers over ``max_header_bytes``; 413 for a body over
    ``max_body_bytes``, by Content-Length or by counting a chunked body as it
    streams in."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, max_header_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header_bytes = 0
        declared = 0
        for name, value in scope.get("headers", ()):
            header_bytes += len(name) + len(value)
            if name == b"content-length" and value.isdigit():
                declared = int(value)
        if header_bytes > self.max_header_bytes:
            await headers_too_large(self.max_header_bytes).response(close=has_body(scope))(scope, receive, send)
            return
        if declared > self.max_body_bytes:
            await body_too_large(self.max_body_bytes).response(close=True)(scope, receive, send)
            return
        await self._counting_body(scope, receive, send)

    async def _counting_body(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app on a body without Content-Length (chunked), stopping it
        with a 413 once the body passes the limit. The app may turn the error
        raised from ``receive`` into an answer of its own (FastAPI makes any
        failure to read the body a 400): that answer is replaced."""
        received = 0
        overflowed = started = False

        async def counting_receive() -> Message:
            nonlocal received, overflowed
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    overflowed = True
                    raise _BodyTooLarge()
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if overflowed and not started:
                return
            started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except _BodyTooLarge:
            pass
        if overflowed and not started:
            await body_too_large(self.max_body_bytes).response(close=True)(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


def has_body(scope: Scope) -> bool:
    """Whether the request declares a body (a length above 0, or chunks)."""
    for name, value in scope.get("headers", ()):
        if (name == b"content-length" and value.strip() not in (b"", b"0")) or name == b"transfer-encoding":
            return True
    return False


def raw_response(error: APIError, reason: bytes) -> bytes:
    """``error`` as a whole HTTP/1.1 response that closes the connection."""
    body = json.dumps(error.body()).encode()
    head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (error.status_code, reason, len(body)))
    return head + body


if TYPE_CHECKING:  # the mixin below is checked against the protocol it is mixed into
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _MixedInto
else:
    _MixedInto = object


class _StallTimers(_MixedInto):
    """The time bounds of ``bounded_http_protocol``, mixed in before httptools'
    protocol: a head must arrive whole within ``HEAD_TIMEOUT_S`` of the
    connection or of its first byte (else 408 and closed), and a body may go
    ``BODY_IDLE_TIMEOUT_S`` without a byte, nor come slower than
    ``BODY_MIN_RATE`` past that (``BodyClock``; else closed: the app, waiting
    on the body, sees the client gone). Neither runs out while the server is the
    one not reading (uvicorn pauses reading behind a pipelined request, or a
    body the app has not taken), and a head's bound not while an earlier
    answer is still being written: a pipelined request's timer cut the stream
    before it, and wrote its 408 into that stream."""

    _head_timer: asyncio.TimerHandle | None = None  # armed while a head is awaited
    _body_timer: asyncio.TimerHandle | None = None  # armed while a body is awaited
    _body_clock: BodyClock | None = None  # the time the body being awaited may take

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()  # a connection that never sends a byte is cut too

    def connection_lost(self, exc: Exception | None) -> None:
        _disarm(self._head_timer)
        _disarm(self._body_timer)
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_head_timer()

    def on_headers_complete(self) -> None:
        _disarm(self._head_timer)
        super().on_headers_complete()
        if has_body({"headers": self.headers}):
            self._body_clock = BodyClock(self.loop.time(), http_bounds.BODY_IDLE_TIMEOUT_S)
            self._arm_body_timer()

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        if self._body_timer is not None and self._body_clock is not None:
            self._body_clock.received(len(body))
            self._arm_body_timer()

    def on_message_complete(self) -> None:
        _disarm(self._body_timer)
        self._body_timer = self._body_clock = None  # a later request's body is timed only once it declares one
        super().on_message_complete()

    def _arm_head_timer(self) -> None:
        _disarm(self._head_timer)
        self._head_timer = self.loop.call_later(http_bounds.HEAD_TIMEOUT_S, self._head_too_late)

    def _arm_body_timer(self) -> None:
        _disarm(self._body_timer)
        assert self._body_clock is not None
        self._body_timer = self.loop.call_later(self._body_clock.seconds_left(self.loop.time()), self._body_stalled)

    def _body_stalled(self) -> None:
        if self.flow.read_paused:
            assert self._body_clock is not None
            self._body_clock.restart(self.loop.time())
            self._arm_body_timer()
        else:
            self._cut(b"")

    def _head_too_late(self) -> None:
        if self.flow.read_paused or (self.cycle is not None and not self.cycle.response_complete):
            self._arm_head_timer()
            return
        message = f"The request's head did not arrive within {http_bounds.HEAD_TIMEOUT_S:g} s."
        self._cut(raw_response(APIError(408, message, "invalid_request_error", None, "request_timeout"),
                               b"Request Timeout"))

    def _cut(self, answer: bytes) -> None:
        """Send ``answer`` (if any) and close the connection."""
        if not self.transport.is_closing():
            if answer:
                self.transport.write(answer)
            self.transport.close()


def _send_bare_to_http10(cycle: Any) -> None:
    """An answer of unknown length to an HTTP/1.0 request goes out unframed,
    ended by the close (uvicorn's httptools protocol framed it in chunks, which
    an HTTP/1.0 client cannot read: RFC 9112 section 6.1); ``cycle`` is the
    request's RequestResponseCycle, whose ``send`` the app has not called yet.
    Such an answer cut short (the app failed) ends with a reset, not a close,
    which would read as its end."""
    if cycle is None or "send" in vars(cycle):
        return
    cycle.transport = _ResetWhenCut(cycle.transport, cycle)
    send = cycle.send
    bare = False

    async def send_unframed(message: Message) -> None:
        nonlocal bare
        if message["type"] == "http.response.start":
            names = {bytes(name).lower() for name, _ in message.get("headers", ())}
            bare = (not names & {b"content-length", b"transfer-encoding"} and cycle.scope["method"] != "HEAD"
                    and message["status"] not in (204, 304))
            if bare:
                cycle.chunked_encoding = False  # uvicorn then adds no framing, and counts the body as if sized
            await send(message)
            if bare:
                cycle.expected_content_length = _UNKNOWN_LENGTH
            return
        if bare and message["type"] == "http.response.body" and not message.get("more_body", False):
            cycle.expected_content_length = len(message.get("body", b""))  # the last part ends it exactly
        await send(message)

    cycle.send = send_unframed


_UNKNOWN_LENGTH = 1 << 62


class _ResetWhenCut:
    """A transport whose ``close`` resets the connection while the cycle's
    answer is unfinished; anything else goes to the transport itself."""

    def __init__(self, transport: asyncio.Transport, cycle: Any) -> None:
        self._transport = transport
        self._cycle = cycle

    def close(self) -> None:
        if self._cycle.response_started and not self._cycle.response_complete:
            sock = self._transport.get_extra_info("socket")
            if sock is not None:  # a linger of 0: the close is a reset (abort alone still ends with a FIN)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self._transport.abort()
        else:
            self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _disarm(timer: asyncio.TimerHandle | None) -> None:
    if timer is not None:
        timer.cancel()


def bounded_http_protocol(max_header_bytes: int) -> type[asyncio.Protocol] | None:
    """uvicorn's httptools protocol with a bound on the request head it buffers
    (``head_limit``) and on the time a head or a stalled body may take
    (``_StallTimers``), or None without httptools (then h11 bounds the head's
    size, not its time)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return None
    limit = head_limit(max_header_bytes)
    rejection = raw_response(headers_too_large(max_header_bytes), b"Request Header Fields Too Large")

    class BoundedHeadProtocol(_StallTimers, HttpToolsProtocol):
        _meter: HeadMeter | None = None  # made on the first read (uvicorn's __init__ is left alone)

        @property
        def meter(self) -> HeadMeter:
            if self._meter is None:
                self._meter = HeadMeter()
            return self._meter

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.meter.message_begins()

        def on_url(self, url: bytes) -> None:
            self.meter.url(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self.meter.header(len(name) + len(value))
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self.meter.headers_complete()
            super().on_headers_complete()
            if self.parser.get_http_version() == "1.0":
                _send_bare_to_http10(self.cycle)

        def on_message_complete(self) -> None:
            self.meter.message_ends()
            super().on_message_complete()

        def send_400_response(self, msg: str) -> None:
            # uvicorn's answer to a request httptools cannot parse was text/plain, the one error not in OpenAI's shape
            self._cut(raw_response(bad_request(msg, code="invalid_http_request"), b"Bad Request"))

        def data_received(self, data: bytes) -> None:
            self.meter.read_begins()
            super().data_received(data)
            if not self.transport.is_closing() and self.meter.read_ends(len(data)) > limit:
                self._cut(rejection)

    return BoundedHeadProtocol
