"""Kept-alive HTTP/1.1 connections from the router to its replicas, on
httptools: a request is written in one piece and the answer's body is handed to
a sink (the client's response) from the socket callback as it arrives, with no
task switch per chunk.

Two ways an exchange fails, kept apart because the router treats them apart:
``UpstreamFailed`` before the answer's status line (nothing reached the client:
retry elsewhere) and ``UpstreamCut`` after it (the client has part of an answer).
A pooled connection the replica closed while idle fails a request before any
byte; that is retried once on a fresh connection and is not the replica's fault.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

from heron.router.http_front import send_at_once

Sink = Callable[[bytes], None]
Flush = Callable[[], None]


class UpstreamFailed(Exception):
    """The replica gave no answer (no connection, or closed before a status line).
    ``delivered``: the request was sent, so the replica may have begun it."""

    def __init__(self, message: str, delivered: bool = True) -> None:
        super().__init__(message)
        self.delivered = delivered


class UpstreamCut(Exception):
    """The replica's answer stopped before its end."""


class UpstreamConnection(asyncio.Protocol):
    """One connection to a replica, one exchange at a time. The status and
    headers resolve ``head``; body bytes go to ``sink`` once one is set (those
    that came before it are held and handed over first), and ``flush`` is
    called after each read that brought some; ``done`` resolves when the
    answer ends, and fails with ``UpstreamCut`` if the connection ends first."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.closed = False
        self._begin(head_only=False)

    def _begin(self, head_only: bool) -> None:
        loop = asyncio.get_running_loop()
        self.head: asyncio.Future[tuple[int, list[tuple[str, str]]]] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()
        self.received_any = False
        self.complete = False
        self._keep_alive = False  # read when the answer ends (the parser forgets it after)
        self._head_only = head_only
        self._headers: list[tuple[str, str]] = []
        self._interim = False  # parsing a 1xx answer (not the final one)
        self._final_head = False  # the final answer's status line and headers are in
        self._framed = False  # the answer has a length or chunked framing (else it ends when the replica closes)
        self._held: list[bytes] = []
        self._sink: Sink | None = None
        self._flush: Flush | None = None

    def send(self, request: bytes, head_only: bool) -> None:
        """Starts an exchange (the previous one must be complete)."""
        assert self.transport is not None and not self.closed
        self._begin(head_only)
        self.transport.write(request)

    def stream_to(self, sink: Sink, flush: Flush | None = None) -> None:
        held, self._held = self._held, []
        self._sink = sink
        self._flush = flush
        for piece in held:
            sink(piece)
        if flush is not None and (held or self.complete):
            flush()

    @property
    def reusable(self) -> bool:
        """Its answer ended cleanly, the replica keeps it open, and it is reading
        (a relay that paused it for a slow client must have resumed it)."""
        return (self.complete and self._keep_alive and not self.closed and self.transport is not None
                and self.transport.is_reading())

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # ---- asyncio.Protocol -----------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        send_at_once(transport)

    def data_received(self, data: bytes) -> None:
        if self.complete:  # bytes while no exchange is under way: nothing can be trusted on it any more
            self.close()
            return
        self.received_any = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"the replica's answer is not valid HTTP: {exc}")
            self.close()
        if self._flush is not None:
            self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._final_head and not self._framed and not self._head_only and exc is None:
            self.on_message_complete()  # an answer with no length nor chunks ends when its connection does
        if not self.complete:
            self._fail(f"the replica closed the connection{f': {exc}' if exc else ''}")

    # ---- httptools callbacks ----------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # an interim answer (100 Continue, 103 Early Hints): wait on
            self._interim = True
            self._headers = []
            return
        names = {name.lower() for name, _ in self._headers}
        self._framed = ("content-length" in names or "transfer-encoding" in names
                        or status in (204, 304))
        self._final_head = True
        if not self.head.done():
            self.head.set_result((status, self._headers))
        if self._head_only:  # a HEAD answer has no body, whatever its headers say
            self.on_message_complete()
            self.close()

    def on_body(self, body: bytes) -> None:
        if self._sink is not None:
            self._sink(body)
        else:
            self._held.append(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        if self.complete:
            return
        self.complete = True
        self._keep_alive = self._parser.should_keep_alive() and not self._head_only
        if not self.done.done():
            self.done.set_result(None)

    def _fail(self, message: str) -> None:
        if not self.head.done():
            self.head.set_exception(UpstreamFailed(message))
        elif not self.done.done():
            self.done.set_exception(UpstreamCut(message))
        # nobody may wait on a future that failed: keep asyncio from logging it
        for future in (self.head, self.done):
            if future.done() and not future.cancelled():
                future.exception()


@dataclass(frozen=True, slots=True)
class _Address:
    host: str
    port: int
    tls: bool
    path: str  # the URL's path, without a trailing slash: requests' paths go after it
    host_header: str


class UpstreamPool:
    """Idle kept-alive connections per replica URL."""

    def __init__(self, connect_timeout: float = 2.0) -> None:
        self.connect_timeout = connect_timeout
        self._idle: dict[str, list[UpstreamConnection]] = {}
        self._addresses: dict[str, _Address] = {}  # a replica's URL read once, not per request
        self._ssl = ssl.create_default_context()

    async def request(self, base_url: str, method: str, target: str, headers: list[tuple[str, str]],
                      body: bytes) -> UpstreamConnection:
        """Sends a request and returns its connection once the answer's status
        and headers are in (``connection.head``); raises ``UpstreamFailed``
        when the replica gives none. The caller hands the connection back with
        ``release`` (or ``discard`` on any failure)."""
        address = self._address(base_url)
        lines = [f"{method} {address.path}{target} HTTP/1.1", address.host_header]
        lines += [f"{name}: {value}" for name, value in headers]
        if body or method in ("POST", "PUT", "PATCH"):
            lines.append(f"content-length: {len(body)}")
        lines.append("\r\n")
        raw = "\r\n".join(lines).encode("latin-1") + body
        head_only = method == "HEAD"
        connection = self._take_idle(base_url)
        if connection is not None:
            try:
                connection.send(raw, head_only)
                await connection.head
                return connection
            except UpstreamFailed:
                connection.close()
                if connection.received_any:
                    raise
                # closed by the replica while idle: not the replica's failure, try a new connection
            except BaseException:
                connection.close()
                raise
        connection = await self._connect(address.host, address.port, address.tls)
        try:
            connection.send(raw, head_only)
            await connection.head
        except BaseException:
            connection.close()
            raise
        return connection

    def _address(self, base_url: str) -> _Address:
        address = self._addresses.get(base_url)
        if address is None:
            split = urlsplit(base_url)
            tls = split.scheme == "https"
            address = self._addresses[base_url] = _Address(
                host=split.hostname or "127.0.0.1", port=split.port or (443 if tls else 80), tls=tls,
                path=split.path.rstrip("/"), host_header=f"host: {split.netloc}")
        return address

    def release(self, base_url: str, connection: UpstreamConnection) -> None:
        if connection.reusable:
            self._idle.setdefault(base_url, []).append(connection)
        else:
            connection.close()

    def close(self) -> None:
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()

    def _take_idle(self, base_url: str) -> UpstreamConnection | None:
        idle = self._idle.get(base_url)
        while idle:
            connection = idle.pop()
            if not connection.closed:
                return connection
        return None

    async def _connect(self, host: str, port: int, tls: bool) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns a connection that completes as the
            # caller is cancelled, swallowing the cancel (a request taken off a replica went on to send there,
            # and hung on its silence)
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await loop.create_connection(UpstreamConnection, host, port,
                                                             ssl=self._ssl if tls else None)
        except (OSError, TimeoutError) as exc:
            raise UpstreamFailed(f"no connection to {host}:{port}: {exc or type(exc).__name__}",
                                 delivered=False) from exc
        return connection
