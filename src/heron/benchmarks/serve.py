"""``heron bench serve``: load-test any OpenAI-compatible server.

Requests leave at Poisson times (``--burstiness 1``) or gamma-distributed times
(lower burstiness = burstier) at ``--request-rate`` per second (``inf``: all at
once), at most ``--max-concurrency`` in flight.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import aiohttp
from tqdm.asyncio import tqdm

from heron.benchmarks.datasets import SampleRequest
from heron.benchmarks.endpoint_client import RequestResult, request_body, send_request
from heron.benchmarks.metrics import compute_metrics, percentile_label

PRINTED = [
    ("Successful requests:", "completed", "{:d}"),
    ("Failed requests:", "failed", "{:d}"),
    ("Maximum request concurrency:", "max_concurrency", "{}"),
    ("Request rate configured (RPS):", "request_rate", "{}"),
    ("Benchmark duration (s):", "duration", "{:.2f}"),
    ("Total input tokens:", "total_input_tokens", "{:d}"),
    ("Total generated tokens:", "total_output_tokens", "{:d}"),
    ("Request throughput (req/s):", "request_throughput", "{:.2f}"),
    ("Request goodput (req/s):", "request_goodput", "{:.2f}"),
    ("Output token throughput (tok/s):", "output_throughput", "{:.2f}"),
    ("Total token throughput (tok/s):", "total_token_throughput", "{:.2f}"),
]


async def arrivals(
    samples: list[SampleRequest], rate: float, burstiness: float, seed: int
) -> AsyncIterator[SampleRequest]:
    """The samples at their send times: gaps drawn from a gamma distribution of
    mean 1/rate (shape = burstiness; 1 = a Poisson process), added up into a
    schedule from the first send. Each waits for its own time, not a gap after
    the send before it: time the client spends elsewhere is made up, and the
    rate asked for is the rate sent (gaps slept one after another lost it: 121
    of 200 requests/s with 2 ms of client work per send)."""
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    start, due = loop.time(), 0.0
    for sample in samples:
        if (delay := start + due - loop.time()) > 0:
            await asyncio.sleep(delay)
        yield sample
        if rate != float("inf"):
            due += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


async def run_load(
    base_url: str,
    endpoint: str,
    model: str,
    samples: list[SampleRequest],
    *,
    request_rate: float,
    burstiness: float,
    max_concurrency: int | None,
    ignore_eos: bool,
    sampling: dict[str, float],
    api_key: str | None,
    count_tokens: Any,
    seed: int,
    show_progress: bool,
    request_timeout_s: float = 6 * 3600.0,
    num_warmups: int = 0,
) -> tuple[list[RequestResult], float, bool]:
    """The results of the requests that finished, the run's duration, and
    whether it was interrupted (Ctrl-C: the requests under way are dropped,
    and what finished is still a result). ``num_warmups`` requests go first,
    one at a time, untimed (a cold server's first answers include its warm-up)."""
    url = base_url.rstrip("/") + endpoint
    chat = "chat" in endpoint
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    progress = tqdm(total=len(samples), disable=not show_progress, desc="requests")
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)  # 0: no limit on connections
    # no session-wide total: aiohttp's default (300 s for a whole request) cut every request longer than that,
    # reported as over --request-timeout; each request is bounded by request_timeout_s (send_request). A
    # connection still has aiohttp's 30 s to be made (a silent address fails then, not at the kernel's give-up)
    unbounded = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(connector=connector, trust_env=True, timeout=unbounded) as client:
        for index in range(num_warmups):
            sample = samples[index % len(samples)]
            warmup = await send_request(client, url, request_body(model, sample, chat, ignore_eos, sampling), sample,
                                        time.perf_counter(), headers, count_tokens, request_timeout_s)
            if not warmup.success:
                print(f"warm-up request {index + 1} failed: {warmup.error}")
        start = time.perf_counter()

        async def one(sample: SampleRequest) -> RequestResult:
            body = request_body(model, sample, chat, ignore_eos, sampling)
            if semaphore is None:
                result = await send_request(client, url, body, sample, start, headers, count_tokens, request_timeout_s)
            else:
                async with semaphore:
                    result = await send_request(client, url, body, sample, start, headers, count_tokens,
                                                request_timeout_s)
            progress.update(1)
            return result

        tasks: list[asyncio.Task[RequestResult]] = []
        interrupted = False
        try:
            async for sample in arrivals(samples, request_rate, burstiness, seed):
                tasks.append(asyncio.create_task(one(sample)))
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:  # Ctrl-C (asyncio.run cancels this task; a second one stops at once)
            interrupted = True
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        duration = time.perf_counter() - start
    progress.close()
    return [task.result() for task in tasks if task.done() and not task.cancelled()], duration, interrupted


async def fetch_model_name(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout, trust_env=True) as client:
        async with client.get(base_url.rstrip("/") + "/v1/models", headers=headers) as response:
            response.raise_for_status()
            return (await response.json())["data"][0]["id"]


def build_result(
    metrics: dict[str, Any], results: list[RequestResult], settings: dict[str, Any]
) -> dict[str, Any]:
    # one entry per request, in the order they were sent, as vLLM's result has them (a failed request: no
    # output tokens, its error in "errors"; a successful one: an empty error)
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai",
        **settings,
        **metrics,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens if r.success else 0 for r in results],
        "ttfts": [r.ttft if r.success else 0.0 for r in results],
        "itls": [r.itl if r.success else [] for r in results],
        "start_times": [r.start_time for r in results],
        "generated_texts": [r.generated_text if r.success else "" for r in results],
        "errors": [r.error if not r.success else "" for r in results],
        "finish_reasons": [r.finish_reason if r.success else "" for r in results],
    }


def format_report(result: dict[str, Any], percentiles: list[float]) -> str:
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]
    if result.get("label"):
        lines.append(f"{'Label:':<44}{result['label']}")
    for title, key, fmt in PRINTED:
        value = result.get(key)
        if value is None:
            continue
        text = fmt.format(value) if not isinstance(value, str) else value
        lines.append(f"{title:<44}{text}")
    # with no request completed the saved latencies are 0, as vLLM saves them: printed as none, not as fastest
    latency = "{:.2f}" if result.get("completed") else "-"
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append("{s:{c}^60}".format(s=f" {title} ", c="-"))
        lines.append(f"{'Mean ' + name.upper() + ' (ms):':<44}{latency.format(result[f'mean_{name}_ms'])}")
        lines.append(f"{'Median ' + name.upper() + ' (ms):':<44}{latency.format(result[f'median_{name}_ms'])}")
        for p in percentiles:
            label = percentile_label(p)
            lines.append(f"{f'P{label} ' + name.upper() + ' (ms):':<44}{latency.format(result[f'p{label}_{name}_ms'])}")
    lines.append("=" * 60)
    return "\n".join(lines)


def default_result_filename(result: dict[str, Any]) -> str:
    concurrency = result.get("max_concurrency") or "inf"
    model = str(result.get("model_id", "model")).replace("/", "_")
    return f"heron-bench-{model}-rate{result['request_rate']}-conc{concurrency}-{result['date']}.json"


def check_result_dir(directory: str) -> None:
    """Make ``directory`` (as saving would) and check it takes files: ValueError
    if not, so that a run is not measured only to lose its result."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot save the result in {directory!r}: {exc.strerror or exc}") from exc
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"cannot save the result in {directory!r}: not writable")


def save_result(result: dict[str, Any], directory: str | None, filename: str | None) -> str:
    filename = filename or default_result_filename(result)
    path = os.path.join(directory, filename) if directory else filename
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2)
    return path


def summarize(
    results: list[RequestResult], duration: float, goodput: dict[str, float], percentiles: list[float],
    settings: dict[str, Any],
) -> dict[str, Any]:
    return build_result(compute_metrics(results, duration, goodput, percentiles), results, settings)
