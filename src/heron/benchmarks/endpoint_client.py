"""One streamed request to an OpenAI-compatible endpoint, timed chunk by chunk.

TTFT is the time to the first chunk carrying text (on the chat endpoint,
reasoning text too: ``reasoning_content``, or vLLM's newer ``reasoning``);
inter-token latencies are the gaps between later text chunks. Output tokens
come from the server's usage report when it sends one
(``stream_options.include_usage``), otherwise from tokenizing the generated
text (reasoning included); ``generated_text`` is the answer's content alone.
Input tokens too come from the usage report when it has them (on the chat
endpoint they include the chat template's), else from the dataset's count.

The client is aiohttp (its HTTP parsing and line splitting are C): at a few
tens of thousands of streamed events per second, one client process in pure
Python (httpx) would itself run out of CPU before the server does.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from heron.benchmarks.datasets import SampleRequest


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    generated_text: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0  # seconds since the benchmark started
    chunk_times: list[float] = field(default_factory=list)  # since the benchmark started
    error: str = ""
    finish_reason: str = ""  # as the server said it ("stop", "length", ...)


def request_body(
    model: str, sample: SampleRequest, chat: bool, ignore_eos: bool, sampling: dict[str, float]
) -> dict[str, Any]:
    """The streamed request for ``sample``; ``sampling`` holds the temperature and
    any of top_p, top_k and min_p the run asks for."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": sample.expected_output_len,
        **sampling,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if chat:
        body["messages"] = [{"role": "user", "content": sample.prompt}]
        body["max_completion_tokens"] = sample.expected_output_len
    else:
        body["prompt"] = sample.prompt
    return body


async def send_request(
    client: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    sample: SampleRequest,
    bench_start: float,
    headers: dict[str, str],
    count_tokens: Any,
    timeout_s: float = 6 * 3600.0,
) -> RequestResult:
    """One streamed request, timed; a failure (an HTTP error, an error event, a
    cut or malformed stream, no answer within ``timeout_s``) is the result's
    ``error``, never an exception."""
    result = RequestResult(prompt_len=sample.prompt_len)
    chat = "messages" in body
    started = time.perf_counter()
    result.start_time = started - bench_start
    last = started
    texts: list[str] = []
    reasoning: list[str] = []
    usage_tokens: int | None = None
    ended = False  # the stream said it was done ([DONE]): one that just stops was cut
    finished_at: float | None = None  # when a choice first carried its finish_reason
    try:
        async with asyncio.timeout(timeout_s), client.post(url, json=body, headers=headers) as response:
            result.error = await _refusal(response)
            if result.error:
                return result
            async for raw_line in response.content:
                if not raw_line.startswith(b"data:"):
                    continue
                data = raw_line[5:].strip()
                if data == b"[DONE]":
                    ended = True
                    break
                payload = json.loads(data)
                if not isinstance(payload, dict):
                    raise ValueError(f"an event that is not a JSON object: {data[:100]!r}")
                if payload.get("error"):  # an "error": null is no error
                    result.error = str(payload["error"])[:300]
                    return result
                if payload.get("usage"):
                    usage_tokens = _read_usage(payload["usage"], result, usage_tokens)
                text, thought, finish = _event_text(payload, chat)
                if finish and finished_at is None:
                    finished_at = time.perf_counter()
                result.finish_reason = finish or result.finish_reason
                if not text and not thought:
                    continue
                now = time.perf_counter()
                if not texts:  # the first timed chunk (each appends to both lists)
                    result.ttft = now - started
                else:
                    result.itl.append(now - last)
                last = now
                result.chunk_times.append(now - bench_start)
                texts.append(text)
                reasoning.append(thought)
        if not texts and finished_at is not None:
            # an answer of no text (an immediate end of sequence, a token that decodes to nothing) is an answer,
            # as vLLM's client counts it: its first and last token came with its finish
            last = finished_at
            result.ttft = finished_at - started
        # to the last token, as vLLM's client: not to a usage chunk or [DONE] that a server may send later
        result.latency = last - started
        result.generated_text = "".join(texts)
        result.output_tokens = (usage_tokens if usage_tokens is not None
                                else count_tokens("".join(reasoning) + result.generated_text))
        result.success = (bool(texts) or finished_at is not None) and ended
        if not texts and finished_at is None:
            result.error = "the server returned no text"
        elif not ended:
            result.error = "the stream ended without [DONE] (cut)"
    except TimeoutError:
        result.error = f"no whole answer within --request-timeout ({timeout_s:g} s)"
    except (aiohttp.ClientError, ValueError) as exc:  # ValueError: bad JSON, over-long line
        result.error = f"{type(exc).__name__}: {exc}"
    except (TypeError, AttributeError) as exc:  # JSON of another shape ("usage": 5, "choices": [null]): this one
        result.error = f"an event of an unexpected shape: {type(exc).__name__}: {exc}"
    return result


async def _refusal(response: aiohttp.ClientResponse) -> str:
    """Why an answer is no stream to measure (an error status; a 200 that is an HTML
    page or a non-streamed answer: a media type in any case, its parameters aside,
    as RFC 9110 reads it), or ""."""
    if response.status != 200:
        return f"HTTP {response.status}: {(await response.read()).decode(errors='replace')[:300]}"
    content_type = response.headers.get("Content-Type", "")
    if content_type.split(";")[0].strip().lower() != "text/event-stream":
        page = (await response.read()).decode(errors="replace")[:300]
        return f"HTTP 200 {content_type or 'with no Content-Type'}, not an event stream: {page}"
    return ""


def _event_text(payload: dict[str, Any], chat: bool) -> tuple[str, str, str]:
    """An event's answer text and reasoning text over its choices, and the finish reason of one that finished
    ("" if none did)."""
    text = thought = finish = ""
    for choice in payload.get("choices") or []:
        if chat:
            delta = choice.get("delta") or {}
            text += delta.get("content") or ""
            thought += delta.get("reasoning_content") or delta.get("reasoning") or ""
        else:
            text += choice.get("text") or ""
        finish = finish or str(choice.get("finish_reason") or "")
    return text, thought, finish


def _read_usage(usage: dict[str, Any], result: RequestResult, completion_tokens: int | None) -> int | None:
    """The completion tokens a usage report counts (else ``completion_tokens``);
    its prompt tokens, the prompt as the model saw it (a chat template's tokens
    too, as vLLM's client counts them), become ``result.prompt_len``."""
    result.prompt_len = _token_count(usage.get("prompt_tokens")) or result.prompt_len
    return _token_count(usage.get("completion_tokens", completion_tokens))


def _token_count(value: Any) -> int | None:
    """A usage count as sent: a whole number of at least 0 (or None), else a malformed event."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    raise ValueError(f"a usage count that is not a whole number of tokens: {value!r}")
