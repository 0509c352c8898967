"""The bench's streaming client against a stub server: text chunks, usage,
[DONE], HTTP errors and error events (aiohttp on both sides, in-process)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp import web

from heron.benchmarks.datasets import SampleRequest
from heron.benchmarks.endpoint_client import request_body, send_request


def sse(payload: object) -> bytes:
    return f"data: {json.dumps(payload)}\r\n\r\n".encode()


async def stream_handler(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    if body["prompt"] == "fail":
        await response.write(sse({"error": {"message": "engine died"}}))
        return response
    if body["prompt"] == "odd shape":  # JSON, but not an event's shape: that request fails, not the run
        await response.write(sse({"choices": [None], "usage": 5}))
        return response
    if body["prompt"] == "usage as text":  # a count that is no number: that request fails, not the run
        await response.write(sse({"choices": [{"index": 0, "text": "x"}], "usage": {"completion_tokens": "7"}}))
        return response
    if body["prompt"] == "stall":  # a server that never answers
        await asyncio.sleep(3)  # (longer than the timeout; the stub waits for it as it stops)
    if body["prompt"] == "null error":  # "error": null is no error
        await response.write(sse({"error": None, "choices": [{"index": 0, "text": "fine"}]}))
    for piece in ["Hello", "", " world"]:
        await response.write(sse({"choices": [{"index": 0, "text": piece}]}))
        await asyncio.sleep(0.01)
    if body["prompt"] == "cut":  # ends cleanly, but without saying it is done
        return response
    if body["prompt"] == "late end":
        await asyncio.sleep(0.5)  # a server (or proxy) that sends its usage and [DONE] late
    await response.write(sse({"choices": [], "usage": {"completion_tokens": 3}}))
    await response.write(b"data: [DONE]\r\n\r\n")
    return response


async def chat_handler(request: web.Request) -> web.StreamResponse:
    """A reasoning model: 5 reasoning chunks, then 2 of content."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
    for index in range(5):
        field = "reasoning_content" if index % 2 else "reasoning"  # vLLM's older and newer names
        await response.write(sse({"choices": [{"index": 0, "delta": {field: f"step {index} "}}]}))
        await asyncio.sleep(0.1)
    for piece in ["The answer", " is 4."]:
        await response.write(sse({"choices": [{"index": 0, "delta": {"content": piece}}]}))
    await response.write(b"data: [DONE]\r\n\r\n")
    return response


async def unauthorized(request: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "bad key"}}, status=401)


async def upper_case_stream(request: web.Request) -> web.StreamResponse:
    """An event stream whose media type is not in lower case (case does not matter in one)."""
    response = web.StreamResponse(headers={"Content-Type": "Text/Event-Stream; charset=UTF-8"})
    await response.prepare(request)
    await response.write(sse({"choices": [{"index": 0, "text": "Hi", "finish_reason": "length"}]}))
    await response.write(b"data: [DONE]\r\n\r\n")
    return response


async def html_page(request: web.Request) -> web.Response:
    return web.Response(text="<!doctype html><title>Sign in</title>", content_type="text/html")


def run_against_stub(prompt: str, path: str, timeout_s: float = 60.0):
    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", stream_handler)
        app.router.add_post("/v1/chat/completions", chat_handler)
        app.router.add_post("/denied", unauthorized)
        app.router.add_post("/portal", html_page)
        app.router.add_post("/upper", upper_case_stream)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        sample = SampleRequest(prompt=prompt, prompt_len=1, expected_output_len=3)
        try:
            async with aiohttp.ClientSession() as client:
                return await send_request(
                    client, f"http://127.0.0.1:{port}{path}",
                    request_body("m", sample, "chat" in path, True, {"temperature": 0.0}),
                    sample, time.perf_counter(), {}, lambda text: len(text.split()), timeout_s,
                )
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def test_text_chunks_are_timed_and_usage_counts_the_tokens():
    result = run_against_stub("hi", "/v1/completions")
    assert result.success and not result.error
    assert result.generated_text == "Hello world"
    assert result.output_tokens == 3  # from the usage chunk, not the text
    assert len(result.itl) == 1 and result.ttft > 0 and result.latency >= result.ttft


def test_errors_are_reported_not_raised():
    denied = run_against_stub("hi", "/denied")
    assert not denied.success and denied.error.startswith("HTTP 401") and "bad key" in denied.error
    failed = run_against_stub("fail", "/v1/completions")
    assert not failed.success and "engine died" in failed.error
    # a 200 that is no event stream (a proxy's sign-in page) said "the server returned no text"
    page = run_against_stub("hi", "/portal")
    assert not page.success and page.error == ("HTTP 200 text/html; charset=utf-8, not an event stream: "
                                               "<!doctype html><title>Sign in</title>"), page.error
    upper = run_against_stub("hi", "/upper")
    assert upper.success and upper.generated_text == "Hi" and upper.finish_reason == "length", upper.error


def test_a_stream_that_ends_without_done_is_a_failure():
    # it counted as a success: a short E2E latency and a partial output in the statistics
    cut = run_against_stub("cut", "/v1/completions")
    assert not cut.success and "[DONE]" in cut.error


def test_the_latency_ends_at_the_last_token():
    # as vLLM's client: a usage chunk or [DONE] sent late is not the model's time (it made TPOT 6x here)
    late = run_against_stub("late end", "/v1/completions")
    assert late.success and late.latency < 0.3



def test_arrivals_keep_the_rate_when_the_client_is_busy(monkeypatch):
    """Each send waits for its own time in a schedule, so time the client spends
    elsewhere is made up (gaps slept one after another lost it: 121 of 200/s).
    On a virtual clock: timed by the wall clock, a loaded machine's oversleeping
    failed it although the schedule was kept."""
    import random
    from types import SimpleNamespace

    from heron.benchmarks import serve

    clock = [0.0]

    async def sleep(seconds: float) -> None:
        clock[0] += seconds

    monkeypatch.setattr(serve, "asyncio", SimpleNamespace(
        get_running_loop=lambda: SimpleNamespace(time=lambda: clock[0]), sleep=sleep))
    samples = [SampleRequest(prompt="x", prompt_len=1, expected_output_len=1) for _ in range(100)]
    draws = random.Random(0)
    due = [0.0]
    for _ in range(99):
        due.append(due[-1] + draws.gammavariate(1.0, 1.0 / 200.0))
    expected = [0.0]  # each send at its due time, or at once once the client's work made it late
    for when in due[1:]:
        expected.append(max(when, expected[-1] + 0.004))

    async def main() -> list[float]:
        sends = []
        async for _ in serve.arrivals(samples, 200.0, 1.0, seed=0):
            sends.append(clock[0])
            clock[0] += 0.004  # the client's own work per send (0.4 s in all, most of the 0.5 s schedule)
        return sends

    assert asyncio.run(main()) == pytest.approx(expected, abs=1e-9)


def test_an_event_of_another_shape_fails_its_request_and_a_null_error_is_none():
    """``"usage": 5`` or ``"choices": [null]`` raised AttributeError out of the
    run (every result lost); ``"error": null`` failed a good request."""
    odd = run_against_stub("odd shape", "/v1/completions")
    assert not odd.success and "unexpected shape" in odd.error
    fine = run_against_stub("null error", "/v1/completions")
    assert fine.success and fine.generated_text == "fineHello world", fine.error


def test_reasoning_chunks_are_tokens_for_the_timings_and_not_the_answer():
    """A reasoning model's first token is its first reasoning chunk: TTFT was
    taken at the first content chunk, after all of them, and TPOT shrank."""
    result = run_against_stub("q", "/v1/chat/completions")
    assert result.success and result.generated_text == "The answer is 4."
    assert result.ttft < 0.3 and len(result.itl) == 6  # 7 timed chunks (the content came after 0.5 s)
    assert result.output_tokens == len("step 0 step 1 step 2 step 3 step 4 The answer is 4.".split())


def test_a_usage_count_that_is_no_number_fails_its_request():
    """completion_tokens "7" crashed the whole run at the report (every result lost)."""
    result = run_against_stub("usage as text", "/v1/completions")
    assert not result.success and "not a whole number" in result.error


def test_a_request_with_no_answer_fails_at_its_timeout():
    """One stalled request held the whole run for the client's 6 hours."""
    started = time.perf_counter()
    result = run_against_stub("stall", "/v1/completions", timeout_s=0.5)
    assert not result.success and "--request-timeout (0.5 s)" in result.error
    assert time.perf_counter() - started < 8
