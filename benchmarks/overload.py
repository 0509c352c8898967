"""Overload: open-loop requests at twice the rate a server sustains, for as
long as asked, streaming and non-streaming mixed (issue #20, item 1).

    python benchmarks/overload.py --url http://127.0.0.1:8000 --duration 600 --out DIR

First a calibration: closed-loop requests at concurrency 8 for
``--calibrate`` seconds give the rate the server sustains on this workload;
then Poisson arrivals at ``--overload`` times that rate for ``--duration``
seconds. Every request must either complete or be turned away at once with a
429/503 carrying Retry-After; none may hang (a per-request deadline) or fail
otherwise. The server's RSS (its process and children) is sampled each second.
When the load stops, running and waiting requests and KV usage must return to
zero. Prints a JSON report (and writes it into --out); exits 1 if an invariant
failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import quantiles

import httpx

WORDS = "heron egret curlew godwit avocet plover dunlin knot sanderling redshank mudflat saltmarsh".split()


@dataclass
class Outcome:
    status: int | None  # None: no HTTP answer (a connection error or the deadline)
    stream: bool
    ttft: float | None = None  # seconds to the first token (completed streams)
    sent_at: float = 0.0  # seconds into the run
    retry_after: bool = False
    error: str | None = None


@dataclass
class Report:
    sustained_rate: float
    offered_rate: float
    duration: float
    counts: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    ttft_p50_ms: float | None = None  # completed streams
    ttft_p99_ms: float | None = None
    # p90 TTFT of the streams sent in the first and last thirds of the run: a
    # queue that grows without bound shows as a last third far above the first
    ttft_p90_first_third_ms: float | None = None
    ttft_p90_last_third_ms: float | None = None
    rss_mib: list[float] = field(default_factory=list)
    after: dict[str, float] = field(default_factory=dict)
    ok: bool = False


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def one_request(client: httpx.AsyncClient, url: str, text: str, max_tokens: int, stream: bool,
                      deadline: float) -> Outcome:
    body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    started = time.perf_counter()
    try:
        async with asyncio.timeout(deadline):
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    return Outcome(response.status_code, stream, retry_after="retry-after" in response.headers)
                ttft = None
                async for line in response.aiter_lines():
                    if ttft is None and line.strip():
                        ttft = time.perf_counter() - started
                    if line.startswith("data: ") and '"error"' in line:
                        return Outcome(200, stream, error=f"error event: {line[:200]}")
                return Outcome(200, stream, ttft=ttft if stream else None)
    except TimeoutError:
        return Outcome(None, stream, error=f"no answer within {deadline:.0f} s")
    except httpx.HTTPError as exc:
        return Outcome(None, stream, error=f"{type(exc).__name__}: {exc}")


async def calibrate(client: httpx.AsyncClient, url: str, seconds: float, words: int, max_tokens: int) -> float:
    """Completed requests per second at concurrency 8, closed loop."""
    rng = random.Random(1)
    done = 0
    stop_at = time.monotonic() + seconds

    async def worker() -> None:
        nonlocal done
        while time.monotonic() < stop_at:
            outcome = await one_request(client, url, prompt(rng, words), max_tokens, False, 120)
            done += outcome.status == 200
    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(8)))
    return done / (time.monotonic() - started)


def rss_mib(pid: int) -> float:
    """Resident memory of a process and its children, in MiB."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            if int(entry) != pid and int(fields[1]) != pid:
                continue
            with open(f"/proc/{entry}/status") as status:
                match = re.search(r"VmRSS:\s+(\d+) kB", status.read())
            total += int(match.group(1)) if match else 0
        except (OSError, ValueError):
            continue
    return total / 1024


def gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    wanted = {"heron:num_requests_running": "running", "heron:num_requests_waiting": "waiting",
              "heron:kv_cache_usage_perc": "kv_usage"}
    found: dict[str, float] = {}
    for line in text.splitlines():
        for metric, name in wanted.items():
            if line.startswith(metric + "{"):
                found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


async def overload(url: str, duration: float, factor: float, calibrate_s: float, words: int, max_tokens: int,
                   server_pid: int | None, deadline: float) -> Report:
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as client:
        sustained = await calibrate(client, url, calibrate_s, words, max_tokens)
        rate = max(sustained, 0.1) * factor
        report = Report(sustained_rate=sustained, offered_rate=rate, duration=duration)
        rng = random.Random(2)
        tasks: list[asyncio.Task[Outcome]] = []
        sampler_done = asyncio.Event()

        async def sample() -> None:
            while not sampler_done.is_set() and server_pid is not None:
                report.rss_mib.append(rss_mib(server_pid))
                await asyncio.sleep(1.0)
        sampler = asyncio.create_task(sample())
        begun = time.monotonic()
        sent_at: list[float] = []
        while time.monotonic() < begun + duration:
            sent_at.append(time.monotonic() - begun)
            tasks.append(asyncio.create_task(one_request(client, url, prompt(rng, words), max_tokens,
                                                         rng.random() < 0.5, deadline)))
            await asyncio.sleep(rng.expovariate(rate))
        outcomes = await asyncio.gather(*tasks)
        for outcome, at in zip(outcomes, sent_at, strict=True):
            outcome.sent_at = at
        sampler_done.set()
        await sampler
    _summarise(report, outcomes)
    report.after = await _settle(url)
    report.ok = (not report.failures and report.after.get("running") == 0 and report.after.get("waiting") == 0
                 and report.after.get("kv_usage") == 0)
    return report


def _summarise(report: Report, outcomes: list[Outcome]) -> None:
    for outcome in outcomes:
        key = f"{outcome.status}{' stream' if outcome.stream else ''}"
        report.counts[key] = report.counts.get(key, 0) + 1
        if outcome.error is not None:
            report.failures.append(outcome.error)
        elif outcome.status in (429, 503) and not outcome.retry_after:
            report.failures.append(f"{outcome.status} without Retry-After")
        elif outcome.status not in (200, 429, 503):
            report.failures.append(f"status {outcome.status}")
    ttfts = [o.ttft for o in outcomes if o.ttft is not None]
    if len(ttfts) >= 2:
        cuts = quantiles(ttfts, n=100)
        report.ttft_p50_ms, report.ttft_p99_ms = 1000 * cuts[49], 1000 * cuts[98]
    third = report.duration / 3
    first = [o.ttft for o in outcomes if o.ttft is not None and o.sent_at < third]
    last = [o.ttft for o in outcomes if o.ttft is not None and o.sent_at >= 2 * third]
    if len(first) >= 2 and len(last) >= 2:
        report.ttft_p90_first_third_ms = 1000 * quantiles(first, n=10)[8]
        report.ttft_p90_last_third_ms = 1000 * quantiles(last, n=10)[8]


async def _settle(url: str, timeout: float = 30.0) -> dict[str, float]:
    """The gauges once the server has drained (or as they are after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        values = await asyncio.to_thread(gauges, url)
        if all(values.get(name) == 0 for name in ("running", "waiting", "kv_usage")) or time.monotonic() > deadline:
            return values
        await asyncio.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--server-pid", type=int, default=None, help="sample this process's RSS (and its children's)")
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--overload", type=float, default=2.0, help="offered rate / sustained rate")
    parser.add_argument("--calibrate", type=float, default=20.0, help="seconds of closed-loop calibration")
    parser.add_argument("--prompt-words", type=int, default=120)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--deadline", type=float, default=300.0, help="seconds after which a request has hung")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = asyncio.run(overload(args.url, args.duration, args.overload, args.calibrate, args.prompt_words,
                                  args.max_tokens, args.server_pid, args.deadline))
    text = json.dumps(asdict(report), indent=2)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "overload.json").write_text(text)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
