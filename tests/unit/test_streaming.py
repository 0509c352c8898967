"""The SSE wrapper of streamed responses (serving_common.sse_stream): its
request timeout and its closing, driven directly: no server, no engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any

from heron.entrypoints.openai.serving_common import SSE_DONE, ServingContext, sse_stream


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
