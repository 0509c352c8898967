"""The connection-level bound on request heads (``bounded_http_protocol``),
driven in-process over a stand-in transport: a head that never ends is cut
off, and a pipelined request's body is never counted as the next one's head."""

from __future__ import annotations

import asyncio

from uvicorn.config import Config
from uvicorn.server import ServerState

from heron.entrypoints.openai.http_limits import bounded_http_protocol

MAX_HEADER_BYTES = 4096  # the bound on an unfinished head: twice this


async def app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closing = False

    def write(self, data) -> None:
        self.written += bytes(data)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 5555)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


async def settled(transport: Transport, quiet_s: float = 0.1, limit_s: float = 10.0) -> None:
    """Until the connection has written nothing new for ``quiet_s`` (a fixed 0.05 s
    wait, on a loaded machine, cut 300 pipelined answers off at 256)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    seen: tuple[int, bool] | None = None
    quiet_since = loop.time()
    while loop.time() < deadline:
        state = (len(transport.written), transport.closing)
        if state != seen:
            seen, quiet_since = state, loop.time()
        elif loop.time() - quiet_since >= quiet_s:
            return
        await asyncio.sleep(0.01)


def feed(*reads: bytes) -> Transport:
    """The connection's answers to ``reads``, each one ``data_received`` call."""

    async def run() -> Transport:
        config = Config(app, log_level="warning")
        config.load()
        protocol_class = bounded_http_protocol(MAX_HEADER_BYTES)
        assert protocol_class is not None  # httptools is installed with heron
        protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
        transport = Transport()
        protocol.connection_made(transport)
        for data in reads:
            protocol.data_received(data)
            await settled(transport)
        return transport

    return asyncio.run(run())


def post(body: bytes) -> bytes:
    return b"POST /a HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n" % len(body) + body


def test_a_pipelined_body_is_not_the_next_requests_head():
    # one read: a whole request whose body passes the bound, then the next request's first bytes; the body
    # used to count as the new head's, and the first request was answered 431 and its connection closed
    transport = feed(post(b"x" * 3 * MAX_HEADER_BYTES) + b"GET /b HTTP/1.1\r\nHost: h\r\n", b"\r\n")
    assert not transport.closing and transport.written.count(b"HTTP/1.1 200") == 2


def test_many_small_pipelined_requests_in_one_read_are_served():
    transport = feed(b"".join(b"GET /%d HTTP/1.1\r\nHost: h\r\nX-A: 1\r\n\r\n" % i for i in range(300)))
    assert not transport.closing and transport.written.count(b"HTTP/1.1 200") == 300


def test_a_head_that_never_ends_is_cut_off_even_after_a_body():
    endless = b"GET /b HTTP/1.1\r\nHost: h\r\nX-Pad: " + b"a" * MAX_HEADER_BYTES
    transport = feed(post(b"x" * 100) + endless, b"a" * MAX_HEADER_BYTES, b"a" * MAX_HEADER_BYTES)
    assert transport.closing and b"HTTP/1.1 431" in transport.written
    transport = feed(endless + b"a" * 3 * MAX_HEADER_BYTES)  # one read, the connection's first
    assert transport.closing and b"HTTP/1.1 431" in transport.written
