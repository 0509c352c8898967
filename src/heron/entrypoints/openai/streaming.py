"""Streamed responses that a client cannot hold open by not reading.

uvicorn's ``send`` waits without limit for the connection's write buffer to
drain once it is past its high-water mark (64 KiB): a client that stops
reading would keep its stream, its task, its connection and (until
``max_tokens``) its engine request forever. ``GuardedStreamingResponse``
streams a body as Starlette's ``StreamingResponse`` does, with these
invariants:

* no ``send`` stays pending longer than ``stall_timeout_s``. When one does,
  the stream is *stalled*: the send is cancelled, the body is closed at once
  (its cleanup aborts the engine request and frees its KV blocks), the
  connection is aborted (unsent bytes dropped: a graceful close would wait for
  the client to read them) and the end is reported as ``stream_stalled``;
* only a pending send counts: the time the body takes to produce its next
  chunk (the engine's share, which ``--request-timeout`` bounds) never does, and
  a client that drains the buffer within the timeout, however slowly it reads
  between, is not stalled. With a request timeout R (``sse_stream``: it
  bounds the waits for the next chunk, then leaves one chunk to send) and a
  stall timeout S, a stream ends by R + 3S at worst: the send under way at
  the deadline, the last chunk, the end of the chunked body;
* a client that disconnects ends the stream the same way, reported as
  ``client_disconnected``;
* the body is closed on every path, so the cleanup of the request the handler
  registered runs, and then ``on_closed`` releases whatever the body's
  cleanup could not: closing a generator runs none of the code it has not
  reached, so a stream that ends before the body first asked for a chunk (the
  client left while the response's start was being sent), or before the body
  opened its engine streams (it sends some events first: a Responses stream's
  ``response.created``, a chat stream's role chunks), never started them, and
  only ``on_closed`` can release their requests (idempotent: requests already
  released are not touched).

Aborting a connection needs its transport, which ASGI does not expose:
``ConnectionAbortMiddleware`` finds uvicorn's and puts an abort callable in the
scope. Without one (another server, a test client) a stalled stream still
ends, and the server closes the connection its own way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from functools import partial
from typing import Literal

from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

# the scope key of a callable that drops the request's connection at once
ABORT_CONNECTION = "heron.abort_connection"

StreamEnd = Literal["stream_stalled", "client_disconnected"]

_STREAM_END = b"data: [DONE]\n\n"  # the last event of an OpenAI SSE stream


class SendWatch:
    """Times the send under way and calls ``on_stall`` (once) when one has been
    pending for ``timeout_s``. One timer per watch, re-armed at most every
    ``timeout_s``; a send costs two attribute writes and a clock read."""

    def __init__(self, timeout_s: float, on_stall: Callable[[], object]) -> None:
        self.timeout_s = timeout_s
        self.on_stall = on_stall
        self.stalled = False
        self._pending_since: float | None = None
        self._loop = asyncio.get_running_loop()
        self._timer = self._loop.call_later(timeout_s, self._check)

    async def send(self, send: Send, message: Message) -> None:
        self._pending_since = self._loop.time()
        await send(message)
        self._pending_since = None

    def _check(self) -> None:
        since = self._pending_since
        now = self._loop.time()
        if since is not None and now - since >= self.timeout_s:
            self.stalled = True
            self.on_stall()
            return
        self._timer = self._loop.call_at((since if since is not None else now) + self.timeout_s, self._check)

    def stop(self) -> None:
        self._timer.cancel()


class GuardedStreamingResponse(StreamingResponse):
    """An HTTP streaming response whose sends may not stall (see the module's
    invariants). ``on_end`` is told how a stream ended early (never called for
    a stream that completed); ``on_closed`` releases what the body still holds
    once it is closed (see the module's invariants); ``stall_timeout_s`` None
    disables the guard."""

    def __init__(
        self,
        body: AsyncGenerator[str, None],
        *,
        stall_timeout_s: float | None,
        on_end: Callable[[StreamEnd], None] = lambda end: None,
        on_closed: Callable[[], None] = lambda: None,
        request_id: str = "",
        media_type: str = "text/event-stream",
    ) -> None:
        super().__init__(body, media_type=media_type)
        self.chunks = body
        self.stall_timeout_s = stall_timeout_s
        self.on_end = on_end
        self.on_closed = on_closed
        self.request_id = request_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        watch = SendWatch(self.stall_timeout_s, lambda: streamer.cancel()) if self.stall_timeout_s else None
        streamer = loop.create_task(self._send_body(send, watch))
        listener = loop.create_task(_until_disconnected(receive))
        try:
            await asyncio.wait((streamer, listener), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if watch is not None:
                watch.stop()
            streamer.cancel()
            listener.cancel()
            await asyncio.wait((streamer, listener))
            await self.chunks.aclose()
            self.on_closed()
        if not streamer.cancelled():
            streamer.result()  # a completed stream, or the body's own error (the server then closes it)
            return
        await self._ended_early(scope, "stream_stalled" if watch is not None and watch.stalled
                                else "client_disconnected")

    async def _send_body(self, raw_send: Send, watch: SendWatch | None) -> None:
        send: Send = raw_send if watch is None else partial(watch.send, raw_send)
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        # a chunk ending an SSE stream ([DONE]) is held until the body says it is the last, then sent with the
        # body's end: uvicorn writes both in one piece, one write (and one wakeup of a client or router) fewer
        held = b""
        async for chunk in self.chunks:
            if held:
                await send({"type": "http.response.body", "body": held, "more_body": True})
            data = chunk.encode(self.charset)
            held = data if data.endswith(_STREAM_END) else b""
            if not held:
                await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": held, "more_body": False})

    async def _ended_early(self, scope: Scope, end: StreamEnd) -> None:
        if end == "stream_stalled":
            logger.warning("%s: the client took no bytes for %g s; its stream is ended, its request aborted and "
                           "its connection closed", self.request_id or "a stream", self.stall_timeout_s)
            abort = scope.get(ABORT_CONNECTION)
            if abort is not None:
                abort()
                await asyncio.sleep(0)  # the server sees the connection lost before the app returns
        self.on_end(end)


async def _until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class ConnectionAbortMiddleware:
    """Puts ``scope[ABORT_CONNECTION]``, a callable that drops the connection at
    once, into each HTTP request's scope when the server is uvicorn: its
    ``receive`` is a bound method of the request's cycle, which holds the
    connection's asyncio transport. Add it last (outermost): Starlette's error
    middleware passes ``receive`` through, heron's body-size limit wraps it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            abort = transport_abort(receive)
            if abort is not None:
                scope[ABORT_CONNECTION] = abort
        await self.app(scope, receive, send)


def transport_abort(receive: Receive) -> Callable[[], None] | None:
    """The ``abort`` of the transport behind uvicorn's ``receive``, if there is one."""
    transport = getattr(getattr(receive, "__self__", None), "transport", None)
    abort = getattr(transport, "abort", None)
    return abort if callable(abort) else None
