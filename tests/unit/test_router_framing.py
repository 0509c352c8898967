"""HTTP framing at the router's edges, against replicas scripted byte by byte:
a pooled connection paused for a slow client reads again, interim 1xx answers
are skipped, a cut JSON answer is cut for the client too, an answer delimited
by the replica's close is whole; on the client side, a bad or closing request
in a pipeline never spoils the answers before it, upgrades are declined by
answering, ``100 Continue`` never lands inside another answer, HTTP/1.0
clients get no chunked framing, flow control outlives the answer that filled
a client's buffer, a body nested too deeply to parse is the replica's to
refuse, and a stream cut inside an event ends with an error event of its own."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable

from heron.router.server import RouterServer
from tests.unit.test_router_relay import FakeReplica, post, raw_exchange, run_with_router

_PROBES = {b"/health": b'{"status": "ok"}', b"/v1/kv_events": b'{"enabled": false}', b"/metrics": b""}

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawReplica:
    """A replica that answers every request on a connection with ``script``."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.url = ""
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length:")), 0)
                    await reader.readexactly(length)
                    probe = _PROBES.get(head.split(b" ", 2)[1].split(b"?")[0])
                    if probe is not None:  # the router's health probes
                        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                     b"Content-Length: %d\r\n\r\n%b" % (len(probe), probe))
                    else:
                        await self.script(reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        self.server = await asyncio.start_server(connection, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]:d}"

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()


def run(test: Callable[[str, list, RouterServer], Awaitable[None]], replicas: list) -> None:
    run_with_router(test, replicas)  # type: ignore[arg-type]


async def small_window_client(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client connection with a 16 KiB receive buffer: the router's writes to it back up soon."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    return await asyncio.open_connection(sock=sock)


BIG = (6 << 20) + (200 << 10)


async def big_answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % BIG)
    writer.write(b"x" * BIG)
    await writer.drain()


def test_a_connection_paused_for_a_slow_client_goes_back_to_the_pool_reading():
    async def test(url: str, _: list, server: RouterServer) -> None:
        reader, writer = await small_window_client(url)
        writer.write(post("/v1/completions", {}))
        await reader.readuntil(b"\r\n\r\n")
        received = 0
        while received < BIG:  # slowly enough that the relay pauses its replica connection
            received += len(await reader.readexactly(min(16384, BIG - received)))
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.1)
        pooled = [c for connections in server.upstream._idle.values() for c in connections]  # noqa: SLF001
        assert pooled and all(c.transport is not None and c.transport.is_reading() for c in pooled)
        answer = await raw_exchange(url, post("/v1/completions", {}, close=True))
        assert answer.startswith(b"HTTP/1.1 200") and len(answer) > BIG
        writer.close()

    run(test, [RawReplica(big_answer)])


def test_interim_answers_are_skipped_and_the_next_request_gets_its_own_answer():
    answers = iter(range(1, 10))

    async def hints(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = b'{"answer": %d}' % next(answers)
        writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))

    async def test(url: str, _: list, __: RouterServer) -> None:
        for expected in (b'{"answer": 1}', b'{"answer": 2}'):
            answer = await raw_exchange(url, post("/v1/completions", {}, close=True))
            assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(expected), answer

    run(test, [RawReplica(hints)])


def test_a_cut_json_answer_reaches_the_client_cut_and_a_close_delimited_one_whole():
    async def cut(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"8\r\n{\"text\":\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()

    async def close_delimited(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n{\"ok\": true}")
        await writer.drain()
        writer.close()

    async def test(url: str, _: list, server: RouterServer) -> None:
        answer = await raw_exchange(url, post("/v1/completions", {}, close=True))
        assert b'{"text":' in answer and not answer.endswith(b"0\r\n\r\n")  # no chunked end: visibly cut
        answer = await raw_exchange(url, post("/v1/completions", {}, close=True))
        assert answer.endswith(b'{"ok": true}\r\n0\r\n\r\n'), answer
        failures = [replica.breaker.consecutive_failures for replica in server.replicas.replicas]
        assert failures == [1, 0]  # the close that ended an answer is no failure

    run(test, [RawReplica(cut), RawReplica(close_delimited)])


def test_a_bad_or_closing_request_in_a_pipeline_spoils_nothing_before_it():
    async def test(url: str, fakes: list[FakeReplica], _: RouterServer) -> None:
        fakes[0].release.set()
        stream = post("/v1/completions", {"mode": "sse"})
        answer = await raw_exchange(url, stream + b"NOT HTTP AT ALL\r\n\r\n")
        assert b"data: second" in answer and answer.count(b"HTTP/1.1 ") == 2
        assert answer.rstrip().endswith(b"}") and b"HTTP/1.1 400" in answer.split(b"0\r\n\r\n", 1)[1]
        answer = await raw_exchange(url, post("/v1/completions", {}, close=True) + post("/v1/completions", {}))
        assert answer.count(b"HTTP/1.1 200") == 1 and b'"bytes"' in answer  # the second is never read
        huge_header = b"GET /v1/models HTTP/1.1\r\nX-Big: " + b"y" * (70 << 10) + b"\r\n\r\n"
        answer = await raw_exchange(url, stream + huge_header)
        assert b"data: second" in answer and b"HTTP/1.1 431" in answer

    run(test, [FakeReplica()])


def test_an_upgrade_offer_is_declined_by_answering():
    async def test(url: str, _: list, __: RouterServer) -> None:
        offer = (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                 b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n")
        answer = await raw_exchange(url, offer + b"GET /v1/models HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert answer.count(b"HTTP/1.1 200 OK") == 2, answer

    run(test, [FakeReplica()])


def test_continue_never_lands_inside_another_answer():
    async def test(url: str, fakes: list[FakeReplica], __: RouterServer) -> None:
        fakes[0].release.set()
        second = post("/v1/completions", {}, extra="Expect: 100-continue\r\n", close=True)
        answer = await raw_exchange(url, post("/v1/completions", {"mode": "sse"}) + second)
        assert b"100 Continue" not in answer and answer.count(b"HTTP/1.1 200") == 2, answer

    run(test, [FakeReplica()])


def test_an_http10_client_gets_a_bare_stream_ended_by_the_close():
    async def test(url: str, fakes: list[FakeReplica], __: RouterServer) -> None:
        fakes[0].release.set()
        request = post("/v1/completions", {"mode": "sse"}).replace(b"HTTP/1.1", b"HTTP/1.0", 1)
        answer = await raw_exchange(url, request)
        head, body = answer.split(b"\r\n\r\n", 1)
        assert b"transfer-encoding" not in head.lower() and b"connection: close" in head.lower()
        assert body == b"data: first\n\ndata: second\n\ndata: [DONE]\n\n"

    run(test, [FakeReplica()])


def test_a_client_too_slow_for_the_deadline_is_not_the_replicas_failure():
    async def test(url: str, _: list[FakeReplica], server: RouterServer) -> None:
        server.request_timeout = 1.0
        reader, writer = await small_window_client(url)
        writer.write(post("/v1/completions", {"mode": "big"}))  # 64 MiB, never read
        await asyncio.sleep(1.5)
        assert server.metrics.timeouts._value.get() == 1  # noqa: SLF001 (the counter's value)
        assert server.metrics.cut_streams._value.get() == 0  # noqa: SLF001
        assert server.replicas.replicas[0].breaker.consecutive_failures == 0
        writer.close()

    run(test, [FakeReplica()])


def test_a_client_that_stopped_reading_during_an_earlier_answer_still_pauses_the_next():
    """asyncio says once that the client's buffer is full: an answer that starts
    after the one that filled it must not read its replica without bound."""
    async def test(url: str, fakes: list[FakeReplica], server: RouterServer) -> None:
        host, port = url.removeprefix("http://").split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 16)
        not_found = f"GET /nothing/{'a' * (60 << 10)} HTTP/1.1\r\nHost: x\r\n\r\n".encode()  # a 60 KiB 404
        writer.write(not_found * 200 + post("/v1/completions", {"mode": "big"}, close=True))
        await asyncio.sleep(1.5)  # the client reads nothing
        assert fakes[0].sent_bytes < 40 << 20, "the router kept reading a replica its client does not read"
        received = 0
        while chunk := await reader.read(1 << 20):
            received += len(chunk)
        assert received > (64 << 20) + 200 * (60 << 10) and fakes[0].sent_bytes == 64 << 20
        writer.close()

    run(test, [FakeReplica()])


async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    body = b'{"error": {"message": "not JSON the server can read"}}'
    writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                 % (len(body), body))


def test_a_body_nested_too_deeply_to_parse_is_passed_to_the_replica_to_refuse():
    async def test(url: str, _: list, server: RouterServer) -> None:
        for body in (b"[" * 100000, b'{"prompt": ' + b"[" * 100000):
            request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Connection: close\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
            answer = await raw_exchange(url, request)
            assert answer.startswith(b"HTTP/1.1 400") and answer.endswith(b"server can read\"}}"), answer[:200]
        assert server.replicas.replicas[0].num_requests == 2

    run(test, [RawReplica(refuse)])


def dechunked(answer: bytes) -> bytes:
    body, data = answer.split(b"\r\n\r\n", 1)[1], b""
    while True:
        size, body = body.split(b"\r\n", 1)
        if not int(size, 16):
            return data
        data, body = data + body[:int(size, 16)], body[int(size, 16) + 2:]


def test_a_stream_cut_inside_an_event_ends_with_an_error_event_of_its_own():
    """After a whole first event: the cut event's bytes, then the error and [DONE]
    as events of their own. A stream cut inside its first event (held until
    whole: router/first_event.py) passes none of it on, only the error."""
    first = b'data: {"text": "a"}\n\n'
    sent = [b'data: {"text": "hel', first + b'data: {"text": "hel', first + b'data: {"text": "hello"}\n',
            first + b'data: {"text": "hello"}\n\n']

    async def cut(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        part = sent[len(answers)]
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"%x\r\n%b\r\n" % (len(part), part))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()

    answers: list[bytes] = []

    async def test(url: str, _: list, __: RouterServer) -> None:
        for _ in sent:
            answers.append(dechunked(await raw_exchange(url, post("/v1/completions", {"stream": True},
                                                                   close=True))))
        error, done, rest = answers[0].split(b"\n\n")  # nothing of the cut first event
        assert json.loads(error.removeprefix(b"data: "))["error"]["code"] == "replica_failed"
        assert done == b"data: [DONE]" and rest == b""
        for part, body in zip(sent[1:], answers[1:], strict=True):
            assert body.startswith(part)
            whole, cut_event, error, done, rest = body.split(b"\n\n")  # the error and [DONE]: events of their own
            assert whole + b"\n\n" == first and part.removeprefix(first).startswith(cut_event), body
            assert done == b"data: [DONE]" and rest == b"", body
            assert json.loads(error.removeprefix(b"data: "))["error"]["code"] == "replica_failed"

    run(test, [RawReplica(cut)])
