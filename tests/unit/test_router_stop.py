"""The router's graceful stop at its HTTP front (``http_front.py``: ``drain``
and ``cut``), against a scripted handler. It only stopped listening: a client
with a kept-alive connection went on sending requests after SIGTERM, which
were taken and then cut at the shutdown timeout with no answer at all, and a
stream cut then ended with no error event, no [DONE] and no end of its
chunked framing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

from heron.router.http_front import FrontConnection, HttpRequest, serve
from heron.router.response_writer import ResponseWriter
from tests.unit.test_router_relay import post


class ScriptedHandler:
    """``/fast``: a JSON answer at once; ``/stream``: an event, then the rest
    once ``release`` is set; ``/late``: nothing until ``release``."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.cancelled = 0

    async def __call__(self, request: HttpRequest, writer: ResponseWriter) -> None:
        try:
            if request.path == "/fast":
                writer.send_json(200, {"ok": True})
            elif request.path == "/stream":
                writer.start(200, [("content-type", "text/event-stream")], content_length=None)
                writer.write(b"data: first\n\n")
                writer.flush()
                await self.release.wait()
                writer.write(b"data: [DONE]\n\n")
                writer.end()
            elif request.path == "/late":
                await self.release.wait()
                writer.send_json(200, {"late": True})
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


Scenario = Callable[[ScriptedHandler, asyncio.Server, set[FrontConnection], int], Awaitable[None]]


def run_with_front(scenario: Scenario) -> None:
    """``scenario(handler, server, connections, port)`` against a front over a scripted handler."""
    async def main() -> None:
        handler = ScriptedHandler()
        connections: set[FrontConnection] = set()
        server = await serve(handler, "127.0.0.1", 0, connections)
        try:
            await scenario(handler, server, connections, server.sockets[0].getsockname()[1])
        finally:
            server.close()

    asyncio.run(main())


async def _read_until(reader: asyncio.StreamReader, marker: bytes) -> bytes:
    data = b""
    while marker not in data:
        chunk = await asyncio.wait_for(reader.read(65536), 10)
        if not chunk:
            break
        data += chunk
    return data


def _drain_all(connections: set[FrontConnection]) -> None:
    for connection in list(connections):
        connection.drain()


def test_an_idle_kept_alive_connection_is_closed_and_a_busy_one_refuses_what_comes_next():
    async def scenario(handler: ScriptedHandler, server: asyncio.Server, connections: set[FrontConnection],
                       port: int) -> None:
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
        idle_writer.write(post("/fast", {}))
        assert b'{"ok": true}' in await _read_until(idle_reader, b"}")
        busy_reader, busy_writer = await asyncio.open_connection("127.0.0.1", port)
        busy_writer.write(post("/stream", {}))
        assert b"data: first" in await _read_until(busy_reader, b"data: first")
        server.close()
        _drain_all(connections)
        assert await asyncio.wait_for(idle_reader.read(), 10) == b""  # closed, nothing taken
        busy_writer.write(post("/fast", {}))  # on the busy connection, as the router stops
        await asyncio.sleep(0.1)
        handler.release.set()
        rest = await asyncio.wait_for(busy_reader.read(), 10)  # read until the router closes it
        assert b"data: [DONE]\n\n" in rest and b"0\r\n\r\n" in rest  # the stream ran to its end
        refused = rest[rest.index(b"HTTP/1.1 503"):]
        assert b"connection: close" in refused and b'"code": "server_stopping"' in refused
        assert b'{"ok": true}' not in rest
        idle_writer.close()
        busy_writer.close()

    run_with_front(scenario)


def test_an_answer_drained_before_its_head_says_connection_close():
    async def scenario(handler: ScriptedHandler, server: asyncio.Server, connections: set[FrontConnection],
                       port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/late", {}))
        await asyncio.sleep(0.1)
        _drain_all(connections)
        handler.release.set()
        answer = await asyncio.wait_for(reader.read(), 10)
        assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" in answer
        assert answer.endswith(b'{"late": true}')
        writer.close()

    run_with_front(scenario)


def test_at_the_deadline_a_stream_ends_with_an_error_event_and_a_waiting_request_with_a_503():
    async def scenario(handler: ScriptedHandler, server: asyncio.Server, connections: set[FrontConnection],
                       port: int) -> None:
        stream_reader, stream_writer = await asyncio.open_connection("127.0.0.1", port)
        stream_writer.write(post("/stream", {}))
        await _read_until(stream_reader, b"data: first")
        late_reader, late_writer = await asyncio.open_connection("127.0.0.1", port)
        late_writer.write(post("/late", {}))
        await asyncio.sleep(0.1)
        _drain_all(connections)
        for connection in list(connections):
            connection.cut()
        stream_rest = await asyncio.wait_for(stream_reader.read(), 10)
        events = [line for line in stream_rest.split(b"\r\n") if line.startswith(b"data: ")]
        assert json.loads(events[0].removeprefix(b"data: ").split(b"\n")[0])["error"]["code"] == \
            "server_stopping"
        assert stream_rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")  # the chunked framing ended too
        late = await asyncio.wait_for(late_reader.read(), 10)
        assert late.startswith(b"HTTP/1.1 503") and b'"code": "server_stopping"' in late
        await asyncio.sleep(0.05)
        assert handler.cancelled == 2 and not connections
        stream_writer.close()
        late_writer.close()

    run_with_front(scenario)
