"""The stall guard of streamed responses (entrypoints/openai/streaming.py) and
the SSE wrapper's request timeout (serving_common.sse_stream), driven through
fake ASGI ``send``/``receive`` callables: no server, no engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any

import pytest

from heron.entrypoints.openai.serving_common import SSE_DONE, ServingContext, sse_stream
from heron.entrypoints.openai.streaming import (
    ABORT_CONNECTION,
    ConnectionAbortMiddleware,
    GuardedStreamingResponse,
    transport_abort,
)

STALL_S = 0.3


class Body:
    """A body generator that records whether it started and was cleaned up
    (as a handler's stream aborts its engine request in its ``finally``)."""

    def __init__(self, chunks: int = 1000, pause_s: float = 0.0) -> None:
        self.chunks = chunks
        self.pause_s = pause_s
        self.started = self.cleaned_up = self.cleaned_up_on_return = False

    async def generate(self) -> AsyncGenerator[str, None]:
        self.started = True
        try:
            for index in range(self.chunks):
                if self.pause_s:
                    await asyncio.sleep(self.pause_s)
                yield f"data: {index}\n\n"
        finally:
            self.cleaned_up = True


class Client:
    """The ASGI side of one connection: ``send`` completes after ``send_s``, or
    never once ``stall_after`` body messages went out; ``receive`` reports a
    disconnect after ``disconnect_after_s`` (never if None)."""

    def __init__(self, stall_after: int | None = None, send_s: float = 0.0,
                 disconnect_after_s: float | None = None) -> None:
        self.stall_after = stall_after
        self.send_s = send_s
        self.disconnect_after_s = disconnect_after_s
        self.messages: list[dict[str, Any]] = []
        self.pending_cancelled = False
        self.aborted = False

    async def send(self, message: dict[str, Any]) -> None:
        body_sent = sum(1 for m in self.messages if m["type"] == "http.response.body")
        if self.stall_after is not None and message["type"] == "http.response.body" and body_sent >= self.stall_after:
            try:
                await asyncio.Event().wait()  # a socket the client never drains
            except asyncio.CancelledError:
                self.pending_cancelled = True
                raise
        if self.send_s:
            await asyncio.sleep(self.send_s)
        self.messages.append(message)

    async def receive(self) -> dict[str, Any]:
        if self.disconnect_after_s is None:
            await asyncio.Event().wait()
        if self.disconnect_after_s:  # 0: gone already, answered without a pause (as uvicorn does)
            await asyncio.sleep(self.disconnect_after_s)
        return {"type": "http.disconnect"}

    def abort(self) -> None:
        self.aborted = True

    @property
    def completed(self) -> bool:
        return bool(self.messages) and self.messages[-1].get("more_body") is False


def run_response(body: Body, client: Client, stall_s: float | None = STALL_S) -> tuple[list[str], float]:
    """How the stream ended early (if it did) and how long it took; whether the
    body was cleaned up is recorded when the response returns (asyncio.run
    would close a forgotten generator later anyway)."""
    ends: list[str] = []

    async def run() -> float:
        response = GuardedStreamingResponse(body.generate(), stall_timeout_s=stall_s, on_end=ends.append,
                                            request_id="cmpl-test")
        started = time.monotonic()
        scope = {"type": "http", ABORT_CONNECTION: client.abort}
        await asyncio.wait_for(response(scope, client.receive, client.send), timeout=10)
        body.cleaned_up_on_return = body.cleaned_up
        return time.monotonic() - started

    return ends, asyncio.run(run())


def test_a_send_that_never_completes_ends_the_stream_after_the_stall_timeout():
    body, client = Body(), Client(stall_after=3)
    ends, elapsed = run_response(body, client)
    assert ends == ["stream_stalled"]
    assert STALL_S <= elapsed < STALL_S + 0.5
    assert client.pending_cancelled and client.aborted  # the send given up, the connection dropped
    assert body.started and body.cleaned_up_on_return  # the body's cleanup (the engine abort) ran
    assert not client.completed and len(client.messages) == 1 + 3  # start + the 3 chunks accepted


def test_without_the_guard_the_same_stream_hangs():
    body, client = Body(), Client(stall_after=3)

    async def run() -> None:
        response = GuardedStreamingResponse(body.generate(), stall_timeout_s=None)
        try:
            await asyncio.wait_for(response({"type": "http"}, client.receive, client.send), timeout=4 * STALL_S)
        finally:
            body.cleaned_up_on_return = body.cleaned_up

    with pytest.raises(TimeoutError):
        asyncio.run(run())
    assert body.cleaned_up_on_return  # a cancelled response closes its body all the same


def test_slow_sends_that_complete_and_slow_bodies_are_not_stalls():
    # every send takes 60% of the stall timeout: slow, but the client takes the bytes
    body, client = Body(chunks=4), Client(send_s=0.6 * STALL_S)
    ends, _ = run_response(body, client)
    assert ends == [] and client.completed and body.cleaned_up_on_return
    # the body (the engine) takes twice the stall timeout per chunk: no send is pending meanwhile
    body, client = Body(chunks=2, pause_s=2 * STALL_S), Client()
    ends, _ = run_response(body, client)
    assert ends == [] and client.completed
    assert [m["body"] for m in client.messages[1:]] == [b"data: 0\n\n", b"data: 1\n\n", b""]


def test_a_disconnect_ends_the_stream_and_closes_the_body():
    body, client = Body(pause_s=0.05), Client(disconnect_after_s=0.3)
    ends, elapsed = run_response(body, client)
    assert ends == ["client_disconnected"] and elapsed < 1.0
    assert body.cleaned_up_on_return and not client.aborted and not client.completed


def gone_while_the_start_is_sent(start_s: float) -> tuple[Body, list[bool]]:
    """A client gone at once, while sending the response's start takes ``start_s``
    (e.g. uvicorn draining the previous response on the connection)."""
    body, client = Body(pause_s=1.0), Client(disconnect_after_s=0.0)
    released: list[bool] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            await asyncio.sleep(start_s)
        await client.send(message)

    async def run() -> None:
        response = GuardedStreamingResponse(body.generate(), stall_timeout_s=STALL_S,
                                            on_closed=lambda: released.append(True))
        await response({"type": "http"}, client.receive, send)
        body.cleaned_up_on_return = body.cleaned_up

    asyncio.run(run())
    return body, released


def test_a_client_gone_before_the_body_starts_gets_its_request_released():
    """The handler registered the request before the response ran: when the
    client is gone while the response's start is still being sent, the body
    never runs (so neither does its cleanup) and ``on_closed`` releases it;
    once the body has started, its own cleanup runs first, and ``on_closed``
    after it (it releases only what the body never started)."""
    body, released = gone_while_the_start_is_sent(0.2)
    assert not body.started and released == [True]
    body, released = gone_while_the_start_is_sent(0.0)
    assert body.started and body.cleaned_up_on_return and released == [True]


def test_the_middleware_finds_the_transport_behind_uvicorns_receive():
    class Cycle:
        def __init__(self) -> None:
            self.transport = SimpleNamespace(abort=lambda: None)

        async def receive(self) -> dict[str, Any]:
            return {"type": "http.disconnect"}

    cycle = Cycle()
    assert transport_abort(cycle.receive) is cycle.transport.abort
    assert transport_abort(Client().receive) is None  # no transport: no abort

    seen: dict[str, Any] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.update(scope)

    asyncio.run(ConnectionAbortMiddleware(app)({"type": "http"}, cycle.receive, None))
    assert seen[ABORT_CONNECTION] is cycle.transport.abort


class Metrics:
    def __init__(self) -> None:
        self.aborts: list[str] = []

    def count_request_abort(self, reason: str) -> None:
        self.aborts.append(reason)


def context(request_timeout_s: float | None) -> ServingContext:
    engine: Any = SimpleNamespace(metrics=Metrics())
    return ServingContext(engine=engine, served_model_name="m", max_model_len=64, request_timeout_s=request_timeout_s)


def test_the_request_timeout_bounds_the_engine_wait_and_ends_with_one_chunk():
    body = Body(chunks=3, pause_s=1.0)  # the engine is slower than the timeout

    async def run() -> list[str]:
        chunks = [chunk async for chunk in sse_stream(ctx, body.generate(), lambda: None)]
        body.cleaned_up_on_return = body.cleaned_up
        return chunks

    ctx = context(0.2)
    chunks = asyncio.run(run())
    assert len(chunks) == 1 and '"request_timeout"' in chunks[0] and chunks[0].endswith(SSE_DONE)
    assert body.cleaned_up_on_return and ctx.engine.metrics.aborts == ["request_timeout"]


def test_the_request_timeout_never_cancels_a_slow_consumer_and_still_ends_the_stream():
    """The deadline passes while the consumer is busy (in a send): the consumer
    is not cancelled; its next pull gets the timeout event, even though the
    next chunk is ready at once."""
    body = Body(chunks=100)
    ctx = context(0.2)

    async def run() -> list[str]:
        received = []
        async for chunk in sse_stream(ctx, body.generate(), lambda: None):
            received.append(chunk)
            await asyncio.sleep(0.15)  # a send the client is slow to take
        body.cleaned_up_on_return = body.cleaned_up
        return received

    chunks = asyncio.run(run())
    assert 1 <= len(chunks) <= 3 and '"request_timeout"' in chunks[-1] and chunks[-1].endswith(SSE_DONE)
    assert body.cleaned_up_on_return


def test_closing_the_sse_stream_closes_its_chunks_at_once():
    body = Body()

    async def run() -> None:
        stream = sse_stream(context(None), body.generate(), lambda: None)
        assert await anext(stream) == "data: 0\n\n"
        await stream.aclose()
        assert body.cleaned_up  # before aclose() returned, not at garbage collection

    asyncio.run(run())


def test_the_done_event_goes_with_the_end_of_the_body():
    """[DONE] and the end of the chunked body go in one message (one write in
    uvicorn); a chunk after a [DONE] (not OpenAI's shape, but a body may) is
    still sent, in order."""

    async def body(chunks: list[str]) -> AsyncGenerator[str, None]:
        for chunk in chunks:
            yield chunk

    def run(chunks: list[str]) -> list[tuple[bytes, bool]]:
        client = Client()
        response = GuardedStreamingResponse(body(chunks), stall_timeout_s=STALL_S)
        asyncio.run(response({"type": "http"}, client.receive, client.send))
        return [(m["body"], m["more_body"]) for m in client.messages[1:]]

    assert run(["data: 1\n\n", "data: 2\n\n" + SSE_DONE]) == [
        (b"data: 1\n\n", True), (b"data: 2\n\n" + SSE_DONE.encode(), False)]
    assert run(["data: 1\n\n"]) == [(b"data: 1\n\n", True), (b"", False)]
    assert run([SSE_DONE, "data: late\n\n"]) == [(SSE_DONE.encode(), True), (b"data: late\n\n", True), (b"", False)]
    assert run([SSE_DONE, SSE_DONE]) == [(SSE_DONE.encode(), True), (SSE_DONE.encode(), False)]
