"""The router's own HTTP front and replica connections (``http_front.py``,
``upstream.py``), in one event loop against scripted fake replicas (aiohttp
servers on loopback): keep-alive and pipelining, bad requests, streams passed
through as they come, cut streams, clients that leave, retries after a 5xx,
pooled connections the replica closed, and a reader that stops reading."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from aiohttp import web

from heron.router.replica import ReplicaSet
from heron.router.server import STALL_S, RouterServer
from heron.routing.policies import Router


class FakeReplica:
    """A replica whose /v1/completions does what the request's ``mode`` says."""

    def __init__(self, fail_with: int | None = None, silent: bool = False,
                 fail_headers: dict[str, str] | None = None, cut_early: bool = False,
                 refuse_in_stream: str | None = None) -> None:
        self.fail_with = fail_with
        self.refuse_in_stream = refuse_in_stream  # a stream whose first event is heron's error with this code
        self.split_refusal = False
        self.cut_early = cut_early  # a stream's head, then the replica dies (during a long prefill, say)
        self.fail_headers = fail_headers
        self.responses_mode: str | None = None  # how its Responses streams go, whatever the request says
        self.silent = silent
        self.release = asyncio.Event()
        self.client_left = asyncio.Event()
        self.sent_bytes = 0
        self.requests = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, port: int = 0) -> None:
        app = web.Application()
        for path, answer in (("/health", {"status": "ok"}), ("/v1/kv_events", {"enabled": False}),
                             ("/v1/models", {"object": "list", "data": []}), ("/metrics", {})):
            app.router.add_get(path, _answer(answer))
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_route("OPTIONS", "/v1/completions", self.preflight)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    async def preflight(self, request: web.Request) -> web.Response:
        """A CORS preflight, answered as a replica allowing the origin it names does."""
        return web.Response(headers={
            "Access-Control-Allow-Origin": request.headers.get("Origin", ""),
            "Access-Control-Allow-Methods": request.headers.get("Access-Control-Request-Method", ""),
            "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", "")})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        raw = await request.read()
        if self.fail_with is not None:
            return web.json_response({"error": "down"}, status=self.fail_with, headers=self.fail_headers)
        mode = json.loads(raw).get("mode", "echo")
        if self.silent:  # a hung host: no answer at all until the test says so
            await self.release.wait()
            return web.json_response({"late": True})
        if mode == "echo":
            return web.json_response({"bytes": len(raw), "query": request.query_string,
                                      "auth": request.headers.get("Authorization"),
                                      "forwarded_for": request.headers.get("X-Forwarded-For"),
                                      "origin": request.headers.get("Origin")},
                                     headers={"Access-Control-Allow-Origin": request.headers.get("Origin", "")})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if self.cut_early:
            assert request.transport is not None
            request.transport.abort()
            return response
        if self.refuse_in_stream is not None:  # an engine core that died before the request's first token
            error = {"message": "The engine is not running", "type": "server_error", "param": None,
                     "code": self.refuse_in_stream}
            event = f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()
            if self.split_refusal:  # in two reads: the gate held only the first read's bytes, then let go
                await response.write(event[:30])
                await asyncio.sleep(0.3)
                event = event[30:]
            await response.write(event)
            await response.write_eof()
            return response
        try:
            if mode == "sse":  # one event, then the next only once the test says so
                await response.write(b"data: first\n\n")
                await self.release.wait()
                await response.write(b"data: second\n\ndata: [DONE]\n\n")
            elif mode == "late":  # the head at once, the first event only once the test says so
                await self.release.wait()
                await response.write(b"data: first\n\ndata: [DONE]\n\n")
            elif mode == "cut":  # the replica dies mid-stream
                await response.write(b"data: first\n\n")
                assert request.transport is not None
                request.transport.abort()
                return response
            elif mode == "hang":  # never answers more: only a leaving client ends it
                await response.write(b"data: first\n\n")
                while request.transport is not None and not request.transport.is_closing():
                    await asyncio.sleep(0.02)
                self.client_left.set()
                return response
            elif mode == "trickle":  # an event every 0.4 s for 4 s, then the end
                for _ in range(10):
                    await response.write(b"data: tick\n\n")
                    await asyncio.sleep(0.4)
                await response.write(b"data: [DONE]\n\n")
            elif mode == "pause":  # an event, a 3 s pause (a long prefill beside it), the last
                await response.write(b"data: first\n\n")
                await asyncio.sleep(3.0)
                await response.write(b"data: last\n\ndata: [DONE]\n\n")
            elif mode == "big":  # as fast as the router takes it
                chunk = b"x" * (1 << 20)
                for _ in range(64):
                    await response.write(chunk)
                    self.sent_bytes += len(chunk)
        except (asyncio.CancelledError, ConnectionResetError):
            self.client_left.set()
            raise
        await response.write_eof()
        return response


    async def responses(self, request: web.Request) -> web.StreamResponse:
        """A Responses stream, as heron's replica writes one: its head events at once
        (``response.created``, ``response.in_progress``), then what ``mode`` says:
        "die" (killed during the prefill), "delta_then_die", or "whole"."""
        self.requests += 1
        mode = self.responses_mode or (await request.json()).get("mode", "whole")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        identity = f"resp_{id(self):x}_{self.requests}"
        instructions = "x" * (100 * 1024 if mode == "big_head_die" else 10)  # repeated in both head events
        head = {"id": identity, "status": "in_progress", "instructions": instructions}
        events = [("response.created", {"response": head}), ("response.in_progress", {"response": head})]
        if mode == "engine_dead":  # its API server up, its engine core gone during the prefill
            events.append(("response.failed", {"response": {**head, "status": "failed", "error": {
                "code": "engine_dead", "message": "The engine is not running"}}}))
        elif mode not in ("die", "big_head_die"):
            events.append(("response.output_text.delta", {"delta": "Hi"}))
        if mode == "whole":
            events.append(("response.completed", {"response": {"id": identity, "status": "completed"}}))
        for number, (kind, fields) in enumerate(events):
            payload = {"type": kind, "sequence_number": number, **fields}
            await response.write(f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode())
            await asyncio.sleep(0.05)
        if mode not in ("whole", "engine_dead"):
            assert request.transport is not None
            request.transport.abort()
            return response
        await response.write_eof()
        return response


def _answer(value: dict[str, Any]) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(_: web.Request) -> web.Response:
        return web.json_response(value)
    return handler


class OneBlockHasher:
    """Every request's prompt is one block (the router's hashing without a tokenizer)."""

    def block_hashes(self, path: str, body: object, block_size: int) -> list[bytes]:
        return [b"h" * 32]


def run_with_router(test: Callable[[str, list[FakeReplica], RouterServer], Awaitable[None]],
                    replicas: list[FakeReplica] | None = None, hasher: OneBlockHasher | None = None,
                    allowed_origins: tuple[str, ...] = ()) -> None:
    async def main() -> None:
        fakes = replicas or [FakeReplica()]
        for fake in fakes:
            await fake.start()
        server = RouterServer(ReplicaSet([f.url for f in fakes], {}, probe_interval=30.0), Router("round_robin"),
                              hasher=hasher, allowed_origins=allowed_origins)  # type: ignore[arg-type]
        await server.start()
        front = await server.listen("127.0.0.1", 0)
        port = front.sockets[0].getsockname()[1]
        try:
            await asyncio.wait_for(test(f"http://127.0.0.1:{port}", fakes, server), 30)
        finally:
            front.close()
            await server.stop()
            for fake in fakes:
                await fake.stop()

    asyncio.run(main())


async def raw_exchange(url: str, data: bytes, read_until_closed: bool = True) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    received = await asyncio.wait_for(reader.read(-1) if read_until_closed else reader.read(65536), 10)
    writer.close()
    return received


def post(path: str, body: dict[str, Any], extra: str = "", close: bool = False) -> bytes:
    raw = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(raw)}\r\n"
            f"{'Connection: close' + chr(13) + chr(10) if close else ''}{extra}\r\n").encode() + raw


def test_requests_on_one_connection_are_answered_in_order_pipelined_or_not():
    async def test(url: str, _: list[FakeReplica], __: RouterServer) -> None:
        async with httpx.AsyncClient(base_url=url) as client:
            for size in (1, 200, 5000):  # kept alive between them
                answer = (await client.post("/v1/completions?x=1", content=json.dumps({"pad": "p" * size}),
                                            headers={"Authorization": "Bearer k"})).json()
                assert answer == {"bytes": len(json.dumps({"pad": "p" * size})), "query": "x=1",
                                  "auth": "Bearer k", "forwarded_for": "127.0.0.1", "origin": None}
            # the client's address joins those of the proxies before the router (a replica trusting the
            # router keys its rate limit by it: every client behind the router shared one bucket)
            answer = (await client.post("/v1/completions", json={}, headers={"X-Forwarded-For": "10.0.0.7"})).json()
            assert answer["forwarded_for"] == "10.0.0.7, 127.0.0.1"
        # three requests in one write, the last closing the connection: three answers, in order
        pipelined = (post("/v1/completions", {"a": 1}) + b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
                     + post("/v1/completions", {"abc": 1}, close=True))
        received = await raw_exchange(url, pipelined)
        assert received.count(b"HTTP/1.1 200 OK") == 3
        assert received.index(b'"bytes": 8') < received.index(b'"data": []') < received.index(b'"bytes": 10')

    run_with_router(test)


def test_a_chunked_request_body_reaches_the_replica_whole():
    async def test(url: str, _: list[FakeReplica], __: RouterServer) -> None:
        body = json.dumps({"pad": "z" * 3000}).encode()
        chunked = b"".join(b"%x\r\n%b\r\n" % (len(body[i:i + 1000]), body[i:i + 1000])
                           for i in range(0, len(body), 1000)) + b"0\r\n\r\n"
        received = await raw_exchange(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                           b"Transfer-Encoding: chunked\r\n\r\n" + chunked)
        assert received.startswith(b"HTTP/1.1 200 OK") and b'"bytes": %d' % len(body) in received

    run_with_router(test)


def test_bad_requests_get_a_clear_error_and_a_closed_connection():
    async def test(url: str, fakes: list[FakeReplica], __: RouterServer) -> None:
        cases = [
            (b"NOT HTTP AT ALL\r\n\r\n", b"400"),
            (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999999\r\n\r\n", b"413"),
            (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (70 << 10) + b"\r\n\r\n", b"431"),
            (b"GET /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", b"404"),
            (b"GET /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", b"405"),
        ]
        for request, status in cases:
            received = await raw_exchange(url, request)  # returns only once the router closes
            assert received.startswith(b"HTTP/1.1 " + status), received[:80]
            assert b'"error"' in received
        assert fakes[0].requests == 0

    run_with_router(test)


def test_a_stream_is_passed_through_as_it_comes():
    async def test(url: str, fakes: list[FakeReplica], __: RouterServer) -> None:
        async with httpx.AsyncClient(base_url=url) as client, \
                client.stream("POST", "/v1/completions", json={"mode": "sse"}) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = response.aiter_lines()
            assert await anext(lines) == "data: first"  # before the replica sends the rest
            fakes[0].release.set()
            assert [line async for line in lines if line] == ["data: second", "data: [DONE]"]

    run_with_router(test)


def test_a_streams_head_is_passed_on_before_its_first_event():
    """A replica sends a stream's head before its first token: the client gets it
    then too, and reads it while the replica computes, not on the way to the token."""
    async def test(url: str, fakes: list[FakeReplica], __: RouterServer) -> None:
        release_later = asyncio.get_running_loop().call_later(3.0, fakes[0].release.set)
        async with httpx.AsyncClient(base_url=url) as client, \
                client.stream("POST", "/v1/completions", json={"mode": "late"}) as response:
            assert response.status_code == 200 and not fakes[0].release.is_set()
            release_later.cancel()
            fakes[0].release.set()
            assert [line async for line in response.aiter_lines() if line] == ["data: first", "data: [DONE]"]

    run_with_router(test)


def test_a_stream_cut_by_its_replica_ends_with_an_error_event():
    async def test(url: str, _: list[FakeReplica], server: RouterServer) -> None:
        async with httpx.AsyncClient(base_url=url) as client, \
                client.stream("POST", "/v1/completions", json={"mode": "cut"}) as response:
            lines = [line async for line in response.aiter_lines() if line]
        assert lines[0] == "data: first" and lines[-1] == "data: [DONE]"
        assert json.loads(lines[1].removeprefix("data: "))["error"]["code"] == "replica_failed"
        assert server.replicas.replicas[0].breaker.consecutive_failures == 1

    run_with_router(test)


@pytest.mark.parametrize("then", ["served", "cut", "refused"])
def test_a_stream_cut_before_its_first_byte_goes_on_from_another_replica(then):
    """A replica sends a stream's head at once and the router passes it on: one
    killed during the prompt's prefill (the likeliest moment) left the client an
    error event, though another replica could have served the request. Behind
    the head already sent, the next replica's stream goes on; one that answers
    an error instead ends it with that error."""
    async def test(url: str, fakes: list[FakeReplica], server: RouterServer) -> None:
        fakes[1].release.set()
        async with httpx.AsyncClient(base_url=url) as client, \
                client.stream("POST", "/v1/completions", json={"mode": "late"}) as response:
            assert response.status_code == 200
            lines = [line async for line in response.aiter_lines() if line]
        assert fakes[0].requests == 1 and fakes[1].requests == 1
        assert server.replicas.replicas[0].breaker.consecutive_failures == 1
        assert server.metrics.retries._value.get() == 1  # noqa: SLF001 (the counter's value)
        if then == "served":
            assert lines == ["data: first", "data: [DONE]"]
            return
        assert lines[-1] == "data: [DONE]" and len(lines) == 2, lines
        error = json.loads(lines[0].removeprefix("data: "))["error"]
        assert error["code"] == "replica_failed" if then == "cut" else "answered 400" in error["message"]

    second = {"served": FakeReplica(), "cut": FakeReplica(cut_early=True), "refused": FakeReplica(fail_with=400)}
    run_with_router(test, [FakeReplica(cut_early=True), second[then]])


@pytest.mark.parametrize("code, split", [("engine_dead", False), ("model_loading", False),
                                         ("server_stopping", False), ("engine_dead", True)])
def test_a_stream_its_replica_refuses_in_its_first_event_goes_on_from_another_replica(code, split):
    """An API server whose engine core died before a stream's first token answers
    it with a 200 whose first event is the error: the router passed that on,
    though the other replica was healthy (found by the fleet review). Where
    every replica refuses, the last one's own error ends the stream."""
    async def test(url: str, fakes: list[FakeReplica], server: RouterServer) -> None:
        fakes[1].release.set()
        async with httpx.AsyncClient(base_url=url) as client:
            async with client.stream("POST", "/v1/completions", json={"mode": "late"}) as response:
                lines = [line async for line in response.aiter_lines() if line]
            assert lines == ["data: first", "data: [DONE]"]
            assert fakes[0].requests == 1 and fakes[1].requests == 1
            assert server.replicas.replicas[0].breaker.consecutive_failures == 1
            assert server.metrics.retries._value.get() == 1  # noqa: SLF001 (the counter's value)
            fakes[1].refuse_in_stream = code
            async with client.stream("POST", "/v1/completions", json={"mode": "late"}) as response:
                lines = [line async for line in response.aiter_lines() if line]
        assert lines[-1] == "data: [DONE]" and len(lines) == 2, lines
        assert json.loads(lines[0].removeprefix("data: "))["error"]["code"] == code

    refusing = FakeReplica(refuse_in_stream=code)
    refusing.split_refusal = split
    run_with_router(test, [refusing, FakeReplica()])


def _events(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: {")]


@pytest.mark.parametrize("mode", ["die", "big_head_die", "engine_dead"])
def test_a_responses_stream_cut_after_its_head_events_goes_on_from_another_replica(mode):
    """A Responses stream opens with response.created and response.in_progress
    before the engine does anything: the router passed them on as the first
    event, so a replica killed during the prefill left the client an error
    though the other replica was healthy (found by the Responses review). They
    are held until the event after them, however large (each repeats the
    request's instructions and tools), and a response.failed after them for an
    engine core gone is that replica's refusal (found by the diff review)."""
    async def test(url: str, fakes: list[FakeReplica], server: RouterServer) -> None:
        async with httpx.AsyncClient(base_url=url) as client, \
                client.stream("POST", "/v1/responses", json={"mode": mode}) as response:
            lines = [line async for line in response.aiter_lines() if line]
        events = _events(lines)
        assert [event["type"] for event in events] == ["response.created", "response.in_progress",
                                                        "response.output_text.delta", "response.completed"]
        assert len({event["response"]["id"] for event in events if "response" in event}) == 1  # the second's
        assert "data: [DONE]" not in lines
        assert fakes[0].requests == 1 and fakes[1].requests == 1
        assert server.metrics.retries._value.get() == 1  # noqa: SLF001 (the counter's value)

    second = FakeReplica()
    second.responses_mode = "whole"
    run_with_router(test, [FakeReplica(), second])


def test_a_responses_stream_cut_later_ends_with_an_error_event_in_its_own_form():
    """The router ended a cut Responses stream as a chat stream (an untyped error
    object and ``[DONE]``); the Responses API ends with a typed ``error`` event,
    numbered after the stream's last, and has no ``[DONE]``."""
    async def test(url: str, fakes: list[FakeReplica], server: RouterServer) -> None:
        async with httpx.AsyncClient(base_url=url) as client, \
                client.stream("POST", "/v1/responses", json={"mode": "delta_then_die"}) as response:
            lines = [line async for line in response.aiter_lines() if line]
        assert "data: [DONE]" not in lines and lines[-2] == "event: error", lines
        events = _events(lines)
        assert [event["type"] for event in events] == ["response.created", "response.in_progress",
                                                        "response.output_text.delta", "error"]
        assert events[-1]["code"] == "replica_failed" and events[-1]["sequence_number"] == 3
        assert fakes[0].requests == 1

    run_with_router(test, [FakeReplica()])


def test_a_first_event_with_an_odd_error_code_is_passed_on():
    """A code that is no string (a list: unhashable) crashed the router's
    request, the client's connection closed with no answer (found by the diff review)."""
    async def test(url: str, fakes: list[FakeReplica], server: RouterServer) -> None:
        async with httpx.AsyncClient(base_url=url) as client, \
                client.stream("POST", "/v1/completions", json={"mode": "late"}) as response:
            lines = [line async for line in response.aiter_lines() if line]
        assert json.loads(lines[0].removeprefix("data: "))["error"]["code"] == ["odd"] and fakes[0].requests == 1

    run_with_router(test, [FakeReplica(refuse_in_stream=["odd"])])  # type: ignore[arg-type]


def test_a_client_that_leaves_takes_its_replica_request_with_it():
    async def test(url: str, fakes: list[FakeReplica], server: RouterServer) -> None:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(post("/v1/completions", {"mode": "hang"}))
        assert b"data: first" in await asyncio.wait_for(reader.read(65536), 10)
        writer.close()
        await asyncio.wait_for(fakes[0].client_left.wait(), 10)
        while server.replicas.replicas[0].load.in_flight:
            await asyncio.sleep(0.01)

    run_with_router(test)


def test_a_5xx_before_the_first_byte_is_retried_on_another_replica():
    async def test(url: str, fakes: list[FakeReplica], server: RouterServer) -> None:
        async with httpx.AsyncClient(base_url=url) as client:
            assert (await client.post("/v1/completions", json={"prompt": "x"})).status_code == 200
            failing, serving = server.replicas.replicas
            # tried first (round robin), failed: its block is expected where the request went instead
            assert fakes[0].requests == 1 and not failing.index.expected and serving.index.expected
            for _ in range(4):
                response = await client.post("/v1/completions", content=json.dumps({"n": 1}))
                assert response.status_code == 200 and response.json()["bytes"] == 8
        assert fakes[0].requests >= 2 and fakes[1].requests == 5
        assert server.metrics.retries._value.get() >= 2  # noqa: SLF001 (the counter's value)

    run_with_router(test, [FakeReplica(fail_with=503), FakeReplica()], OneBlockHasher())


def test_a_request_waiting_on_a_replica_taken_out_goes_elsewhere():
    """A replica that stops answering (a hung host, a partition) held the
    requests waiting for its answer until their clients gave up, though its
    breaker had opened and no byte had reached them."""
    async def test(url: str, fakes: list[FakeReplica], server: RouterServer) -> None:
        hung = server.replicas.replicas[0]
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            waiting = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x"}))
            while not hung.out_waiters:
                await asyncio.sleep(0.01)
            for _ in range(3):  # its probes fail
                server.replicas.record(hung, None)
            answer = await waiting
        assert answer.status_code == 200 and answer.json()["bytes"] > 0  # served by the other replica
        assert fakes[1].requests == 1 and not hung.out_waiters and server.metrics.retries._value.get() == 1  # noqa: SLF001
        fakes[0].release.set()

    run_with_router(test, [FakeReplica(silent=True), FakeReplica()])


@pytest.mark.parametrize("mode", ["hang", "trickle"])
def test_a_stream_from_a_replica_taken_out_ends_once_it_stalls(mode):
    """A stream whose replica stopped answering mid-way (a hung host, a
    partition) never ended, though its breaker had opened: the client waited
    for ever with no error event. One still sending runs to its end."""
    async def test(url: str, _: list[FakeReplica], server: RouterServer) -> None:
        replica = server.replicas.replicas[0]
        lines: list[str] = []
        async with httpx.AsyncClient(base_url=url, timeout=20) as client, \
                client.stream("POST", "/v1/completions", json={"mode": mode}) as response:
            async for line in response.aiter_lines():
                if not line:
                    continue
                lines.append(line)
                if len(lines) == 1:
                    taken_out = asyncio.get_running_loop().time()
                    for _ in range(3):  # its probes fail
                        server.replicas.record(replica, None)
        ended_after = asyncio.get_running_loop().time() - taken_out
        assert lines[-1] == "data: [DONE]", lines
        if mode == "hang":
            assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "replica_failed"
            assert STALL_S - 0.5 <= ended_after < STALL_S + 3
        else:
            assert lines[:-1] == ["data: tick"] * 10  # a replica still sending is not cut
        assert not replica.out_waiters

    run_with_router(test)


def test_a_replicas_own_504_is_its_answer_not_its_failure():
    """A replica's --request-timeout 504 was retried (one long request ran on
    every replica, the client got 503 'no replica') and counted against the
    replica: a few such requests opened healthy replicas' breakers."""
    async def test(url: str, fakes: list[FakeReplica], server: RouterServer) -> None:
        async with httpx.AsyncClient(base_url=url) as client:
            for _ in range(4):
                assert (await client.post("/v1/completions", json={"prompt": "x"})).status_code == 504
        assert fakes[0].requests == 4 and server.metrics.retries._value.get() == 0  # noqa: SLF001
        assert server.replicas.replicas[0].breaker.consecutive_failures == 0

    run_with_router(test, [FakeReplica(fail_with=504)])


def test_a_request_that_failed_on_its_own_is_passed_through_and_blames_no_replica():
    """A decode replica whose KV pull failed under kv_load_failure_policy
    "fail" answers that request 500 and serves on: the router counted it
    against the replica (three opened a healthy replica's breaker), retried
    the spent handle on the others, and told the client "no replica could
    serve the request" instead of the replica's reason."""
    from heron.routing.health import REQUEST_FAILURE_HEADER

    async def test(url: str, fakes: list[FakeReplica], server: RouterServer) -> None:
        async with httpx.AsyncClient(base_url=url) as client:
            for _ in range(4):
                answer = await client.post("/v1/completions", json={"prompt": "x"})
                assert answer.status_code == 500 and answer.json() == {"error": "down"}
        assert fakes[0].requests == 4 and server.metrics.retries._value.get() == 0  # noqa: SLF001
        assert server.replicas.replicas[0].breaker.consecutive_failures == 0

    run_with_router(test, [FakeReplica(fail_with=500, fail_headers={REQUEST_FAILURE_HEADER: "kv_load"})])


def test_a_refused_request_leaves_no_expected_blocks():
    """A 4xx caches nothing on the replica: its prompt's blocks stayed expected
    there for 30 s, drawing the same prefix to it."""
    async def test(url: str, fakes: list[FakeReplica], server: RouterServer) -> None:
        async with httpx.AsyncClient(base_url=url) as client:
            assert (await client.post("/v1/completions", json={"prompt": "x"})).status_code == 400
        assert fakes[0].requests == 1 and not server.replicas.replicas[0].index.expected

    run_with_router(test, [FakeReplica(fail_with=400)], OneBlockHasher())


def test_a_kept_alive_connection_the_replica_closed_is_not_the_replicas_failure():
    async def test(url: str, fakes: list[FakeReplica], server: RouterServer) -> None:
        async with httpx.AsyncClient(base_url=url) as client:
            assert (await client.post("/v1/completions", json={})).status_code == 200
            # the replica restarts its connections (an idle timeout, a restart): the pooled one is dead
            await fakes[0].stop()
            await fakes[0].start(port=int(fakes[0].url.rsplit(":", 1)[1]))
            assert (await client.post("/v1/completions", json={})).status_code == 200
        assert server.replicas.replicas[0].breaker.consecutive_failures == 0

    run_with_router(test)


def test_a_reader_that_stops_reading_stops_the_replica_not_the_routers_memory():
    async def test(url: str, fakes: list[FakeReplica], __: RouterServer) -> None:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port), limit=1 << 16)
        writer.write(post("/v1/completions", {"mode": "big"}, close=True))
        await asyncio.sleep(1.5)  # the client reads nothing
        assert fakes[0].sent_bytes < 40 << 20, "the router kept reading a replica its client does not read"
        received = 0
        while chunk := await reader.read(1 << 20):
            received += len(chunk)
        assert received > 64 << 20 and fakes[0].sent_bytes == 64 << 20
        writer.close()

    run_with_router(test)


def test_health_is_ok_only_once_a_replica_has_answered():
    """A replica's breaker starts closed: /health said ok for its first probes
    though nothing listened there, and readiness probes passed too early."""
    import socket

    async def main() -> None:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        fake = FakeReplica()
        await fake.start()
        nowhere = f"http://127.0.0.1:{listener.getsockname()[1]}"
        server = RouterServer(ReplicaSet([nowhere], {}, probe_interval=30.0), Router("round_robin"), None)
        await server.start()  # one probe round, failed: the breaker is still closed
        front = await server.listen("127.0.0.1", 0)
        url = f"http://127.0.0.1:{front.sockets[0].getsockname()[1]}"
        try:
            async with httpx.AsyncClient(base_url=url) as client:
                health = await client.get("/health")
                assert health.status_code == 503 and health.json()["status"] == "no replica available"
                assert server.replicas.replicas[0].breaker.usable  # closed on faith, not answered
                server.replicas.set_discovered([fake.url])  # a replica that answers joins
                await server.replicas.probe(server.session, server.replicas.replicas[-1])
                assert (await client.get("/health")).status_code == 200
        finally:
            front.close()
            await server.stop()
            await fake.stop()
            listener.close()

    asyncio.run(main())


def test_a_browsers_cors_requests_reach_the_replica_and_its_answers_come_back():
    """The router dropped Origin and answered a preflight 405 itself: a page that
    worked against a replica with --allowed-origins broke behind the router."""
    async def test(url: str, _: list[FakeReplica], server: RouterServer) -> None:
        origin = {"Origin": "http://localhost:3000"}
        async with httpx.AsyncClient(base_url=url) as client:
            preflight = await client.options("/v1/completions", headers={
                **origin, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type"})
            assert preflight.status_code == 200, preflight.text
            assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
            assert preflight.headers["access-control-allow-headers"] == "authorization,content-type"
            answer = await client.post("/v1/completions", json={"prompt": "x"}, headers=origin)
            assert answer.json()["origin"] == "http://localhost:3000"
            assert answer.headers["access-control-allow-origin"] == "http://localhost:3000"
            assert (await client.get("/v1/completions")).status_code == 405  # GET is still no generation

    run_with_router(test)


def test_the_routers_own_answers_carry_cors_headers_for_an_allowed_origin():
    """A page could not read the router's own errors (its 404, 405, 503, and the
    front's 413 / 408 / 431): no CORS headers; a replica's answer keeps the replica's own."""
    async def test(url: str, _: list[FakeReplica], server: RouterServer) -> None:
        async with httpx.AsyncClient(base_url=url) as client:
            allowed = {"Origin": "http://localhost:3000"}
            for answer in (await client.get("/nowhere", headers=allowed),
                           await client.get("/v1/completions", headers=allowed)):
                assert answer.status_code in (404, 405)
                assert answer.headers["access-control-allow-origin"] == "http://localhost:3000"
                assert answer.headers["vary"] == "origin"
            other = await client.get("/nowhere", headers={"Origin": "http://evil.example"})
            assert "access-control-allow-origin" not in other.headers
            relayed = await client.post("/v1/completions", json={"prompt": "x"}, headers=allowed)
            assert relayed.headers.get_list("access-control-allow-origin") == ["http://localhost:3000"]  # once
        # refused by the front before any handler runs (a body declared too large): CORS too
        reader, writer = await asyncio.open_connection(*url.removeprefix("http://").split(":"))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nOrigin: http://localhost:3000\r\n"
                     b"Content-Length: 999999999999\r\n\r\n")
        refusal = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert refusal.startswith(b"HTTP/1.1 413") and b"access-control-allow-origin: http://localhost:3000" in refusal

    run_with_router(test, allowed_origins=("http://localhost:3000",))


def test_when_every_replica_refuses_the_client_gets_the_last_replicas_answer():
    """Each replica's 503 was retried, then replaced by the router's own 503:
    the replica's reason and its Retry-After were lost."""
    async def test(url: str, fakes: list[FakeReplica], server: RouterServer) -> None:
        async with httpx.AsyncClient(base_url=url) as client:
            answer = await client.post("/v1/completions", json={"prompt": "x"})
        assert answer.status_code == 503 and answer.headers["retry-after"] == "7"
        assert answer.json() == {"error": "down"} and fakes[0].requests == fakes[1].requests == 1

    run_with_router(test, [FakeReplica(fail_with=503, fail_headers={"Retry-After": "7"}) for _ in range(2)])


def test_a_replica_back_in_use_has_its_streams_pauses_judged_as_pauses():
    """Once a replica had been out a moment (three failed probes: a blip), every
    stream under way on it was cut at its next 2 s pause, though the replica was
    back in use by then."""
    async def test(url: str, _: list[FakeReplica], server: RouterServer) -> None:
        replica = server.replicas.replicas[0]
        lines: list[str] = []
        async with httpx.AsyncClient(base_url=url, timeout=20) as client, \
                client.stream("POST", "/v1/completions", json={"mode": "pause"}) as response:
            async for line in response.aiter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 1 and replica.breaker.usable:
                    for _ in range(3):  # out...
                        server.replicas.record(replica, None)
                    await asyncio.sleep(0.3)
                    server.replicas.record(replica, 200)  # ...and back
        assert lines == ["data: first", "data: last", "data: [DONE]"]

    run_with_router(test)
