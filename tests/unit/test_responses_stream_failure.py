"""A Responses stream the server cannot finish ends with the Responses API's own
``response.failed`` event (the response so far, ``status: "failed"``, the
error), numbered after the events before it, and no ``data: [DONE]``: it sent
chat's error line and [DONE], which the official client turns into an
exception. (The live check, through --request-timeout, is in
tests/e2e/test_gateway.py.)

An output of no text streams an empty message item, as the answer not streamed
holds one: the stream had no item at all, and its final and stored response
an empty ``output``."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from heron.entrypoints.openai.protocol_responses import ResponsesRequest
from heron.entrypoints.openai.serving_common import sse_stream
from heron.entrypoints.openai.serving_responses import ResponseBuilder
from heron.outputs import CompletionOutput, RequestOutput


def test_a_stream_past_the_request_timeout_ends_with_response_failed():
    aborts: list[str] = []
    ctx = SimpleNamespace(request_timeout_s=0.2, count_abort=aborts.append, served_model_name="m",
                          responses=None)
    request = ResponsesRequest(model="m", input="hi", stream=True, store=False)
    builder = ResponseBuilder(ctx, request, "resp_1", None, [])  # type: ignore[arg-type]

    async def never_answers():
        await asyncio.sleep(30)
        yield None

    async def collect() -> list[str]:
        stream = sse_stream(ctx, builder.events([never_answers()]), lambda: None,  # type: ignore[arg-type]
                            failure=builder.failed_event, done="")
        return [chunk async for chunk in stream]

    chunks = asyncio.run(asyncio.wait_for(collect(), 10))
    assert not any("[DONE]" in chunk for chunk in chunks)
    events = [json.loads(line[6:]) for chunk in chunks for line in chunk.splitlines() if line.startswith("data: ")]
    assert [event["type"] for event in events] == ["response.created", "response.in_progress", "response.failed"]
    assert [event["sequence_number"] for event in events] == [0, 1, 2]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and "did not finish within 0.2 s" in failed["error"]["message"]
    assert aborts == ["request_timeout"]


def test_an_output_of_no_text_streams_an_empty_message():
    ctx = SimpleNamespace(request_timeout_s=0, served_model_name="m", responses=None)
    request = ResponsesRequest(model="m", input="hi", stream=True, store=False)
    builder = ResponseBuilder(ctx, request, "resp_1", None, [])  # type: ignore[arg-type]

    async def end_at_once():
        yield RequestOutput("resp_1", None, [1, 2], [CompletionOutput(0, "", [2], finish_reason="stop")], True)

    async def collect() -> list[str]:
        return [chunk async for chunk in builder.events([end_at_once()])]  # type: ignore[list-item]

    chunks = asyncio.run(asyncio.wait_for(collect(), 10))
    events = [json.loads(line[6:]) for chunk in chunks for line in chunk.splitlines() if line.startswith("data: ")]
    assert [event["type"] for event in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    [message] = events[-1]["response"]["output"]
    assert message["type"] == "message" and message["status"] == "completed"
    assert message["content"][0]["text"] == ""
