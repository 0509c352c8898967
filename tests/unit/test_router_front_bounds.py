"""The router's front holds a client connection only as long as its bounds
allow (heron/http_bounds.py): a head that does not arrive whole, a body that
stalls, a kept-alive connection left idle, one header line that never ends.
It held every one of them for ever (slowloris: a descriptor each, and memory
for the header)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from heron.http_bounds import ConnectionBounds
from heron.router.http_front import MAX_HEAD_BYTES, HttpRequest, serve
from heron.router.response_writer import ResponseWriter

BOUNDS = ConnectionBounds(head_timeout_s=0.5, body_idle_timeout_s=0.5, keep_alive_s=1.0)
GET = b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n"


async def answer_ok(request: HttpRequest, writer: ResponseWriter) -> None:
    writer.send_json(200, {"path": request.path})


def with_front(test: Callable[[int], Awaitable[None]],
               handler: Callable[[HttpRequest, ResponseWriter], Awaitable[None]] = answer_ok) -> None:
    async def main() -> None:
        server = await serve(handler, "127.0.0.1", 0, bounds=BOUNDS)
        try:
            await test(server.sockets[0].getsockname()[1])
        finally:
            server.close()
    asyncio.run(main())


async def until_closed(reader: asyncio.StreamReader, within: float = 5.0) -> tuple[bytes, float]:
    """What the router sends until it closes, and how long that took."""
    started = time.monotonic()
    received = await asyncio.wait_for(reader.read(-1), within)
    return received, time.monotonic() - started


def test_a_connection_that_sends_nothing_or_half_a_head_gets_408_and_is_closed():
    async def test(port: int) -> None:
        for sent in (b"", b"GET /x HTTP/1.1\r\nHost"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(sent)
            received, waited = await until_closed(reader)
            assert received.startswith(b"HTTP/1.1 408") and b"request_timeout" in received, received
            assert 0.4 < waited < 3
            writer.close()
    with_front(test)


def test_a_body_that_stalls_gets_408_and_is_closed():
    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n\r\n" + b"a" * 10)
        for _ in range(4):  # a body still coming (and at more than BODY_MIN_RATE) is not stalled
            await asyncio.sleep(0.3)
            writer.write(b"a" * 200)
        received, waited = await until_closed(reader)
        assert received.startswith(b"HTTP/1.1 408") and b"body" in received, received
        writer.close()
    with_front(test)


def test_an_idle_kept_alive_connection_is_kept_for_the_timeout_then_closed():
    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(3):  # reused within the timeout: answered
            writer.write(GET)
            assert (await asyncio.wait_for(reader.readuntil(b'"/x"}'), 5)).startswith(b"HTTP/1.1 200")
            await asyncio.sleep(0.6)  # over the head timeout: an idle connection is timed by the keep-alive bound
        received, waited = await until_closed(reader)
        assert received == b"" and waited < 2
        writer.close()
    with_front(test)


def test_one_header_line_that_never_ends_gets_431():
    """httptools reports a header only once its line ends: the router counted
    reported parts only, and buffered a header value without bound."""
    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        # past the bound in two reads (the first read's unfinished line counts from the next read on), all
        # of it read by the router (more, unread at its close, would reset the connection)
        writer.write(b"GET /x HTTP/1.1\r\nHost: x\r\nx-long: " + b"a" * (MAX_HEAD_BYTES // 2))
        await asyncio.sleep(0.1)
        writer.write(b"a" * (MAX_HEAD_BYTES + 4096))
        received, _ = await until_closed(reader)
        assert received.startswith(b"HTTP/1.1 431"), received[:80]
        writer.close()
    with_front(test)


def test_a_head_the_router_is_not_reading_is_not_timed():
    """Pipelined requests past the queue's bound pause the router's reading:
    the head behind them waits on the router, not on the client, and is
    answered, not cut with 408."""
    async def slow(request: HttpRequest, writer: ResponseWriter) -> None:
        await asyncio.sleep(0.2)
        await answer_ok(request, writer)

    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        last = b"GET /last HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        writer.write(GET * 10 + last[:20])
        await asyncio.sleep(1.0)  # over the head timeout, while the router works through the queue
        writer.write(last[20:])
        received, _ = await until_closed(reader, within=10)
        assert received.count(b"HTTP/1.1 200") == 11 and received.endswith(b'"/last"}'), received[-200:]
        writer.close()
    with_front(test, slow)


def test_pipelined_bodies_past_the_body_bound_pause_the_reading(monkeypatch):
    """Eight queued requests of 60 MiB each were held at once (the queue was bounded by count only)."""
    from heron.router import http_front

    monkeypatch.setattr(http_front, "MAX_BODY_BYTES", 1000)
    release = asyncio.Event()

    async def held(request: HttpRequest, writer: ResponseWriter) -> None:
        await release.wait()
        await answer_ok(request, writer)

    async def main() -> None:
        connections: set[http_front.FrontConnection] = set()
        server = await serve(held, "127.0.0.1", 0, connections, BOUNDS)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        post = b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 400\r\n\r\n" + b"b" * 400
        writer.write(post * 4 + post.replace(b"Host: x", b"Host: x\r\nConnection: close"))
        await asyncio.sleep(0.3)
        [connection] = connections
        assert connection._reading_paused  # three bodies queued behind the first: 1200 bytes
        release.set()
        received, _ = await until_closed(reader)
        assert received.count(b"HTTP/1.1 200") == 5
        writer.close()
        server.close()
    asyncio.run(main())


def test_a_chunked_upload_before_a_pipelined_request_is_no_oversized_head():
    """The chunks' framing was counted as the next request's head: a false 431."""
    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /up HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1\r\na\r\n" * 20000
                     + b"0\r\n\r\nGET /next HT")
        await asyncio.sleep(0.2)
        writer.write(b"TP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        received, _ = await until_closed(reader)
        assert received.count(b"HTTP/1.1 200") == 2 and received.endswith(b'"/next"}'), received[-200:]
        writer.close()
    with_front(test)


def test_a_client_that_reads_nothing_is_dropped_after_the_keep_alive_bound():
    """Its connection was closed politely, which waits for the write buffer to drain: held for ever."""
    from heron.router import http_front

    async def big(request: HttpRequest, writer: ResponseWriter) -> None:
        writer.send(200, b"x" * (8 << 20), "application/octet-stream")

    async def main() -> None:
        connections: set[http_front.FrontConnection] = set()
        server = await serve(big, "127.0.0.1", 0, connections, BOUNDS)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        writer.write(GET)  # and never read
        for _ in range(50):
            await asyncio.sleep(0.1)
            if not connections:
                break
        assert not connections  # dropped, about the keep-alive bound after the answer was written
        writer.close()
        server.close()
    asyncio.run(main())


def test_a_body_that_trickles_is_cut_and_a_steady_one_is_not(monkeypatch):
    """A byte every 0.3 s never let the 0.5 s idle bound run out (a byte every
    25 s against 60 s held a connection for hours); a body must also come at
    BODY_MIN_RATE bytes a second, past its first idle stretch."""
    from heron import http_bounds

    monkeypatch.setattr(http_bounds, "BODY_MIN_RATE", 100.0)

    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        started = time.monotonic()
        while not reader.at_eof() and time.monotonic() - started < 5:
            writer.write(b"a")
            try:
                received = await asyncio.wait_for(reader.read(-1), 0.3)
                break
            except TimeoutError:
                continue
        assert received.startswith(b"HTTP/1.1 408") and time.monotonic() - started < 3, received[:80]
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # 2 KB/s: served
        writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 4000\r\nConnection: close\r\n\r\n")
        for _ in range(10):
            writer.write(b"b" * 400)
            await asyncio.sleep(0.2)
        received, _ = await until_closed(reader)
        assert received.startswith(b"HTTP/1.1 200"), received[:80]
        writer.close()
    with_front(test)
