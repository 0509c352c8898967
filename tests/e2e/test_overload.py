"""Overload for a minute (issue #20, item 1; benchmarks/overload.py runs the
ten-minute version): open-loop requests at twice the rate the server
sustains, streamed and not, against `heron serve --max-waiting-requests 8`.
Every request completes or is turned away at once with 429/503 and
Retry-After; none hangs or fails otherwise; the TTFT of admitted streams does
not grow over the run (the waiting bound holds the queue); memory is flat;
afterwards nothing runs or waits and every KV block is free."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from tests.e2e.server_process import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import overload  # noqa: E402


def test_twice_the_sustainable_rate_for_a_minute():
    server = ServerProcess("--max-waiting-requests", "8")
    try:
        report = asyncio.run(overload.overload(server.base_url, duration=60, factor=2.0, calibrate_s=10,
                                               words=120, max_tokens=32, server_pid=server.process.pid,
                                               deadline=120))
    finally:
        server.stop()
    assert report.failures == [], report.failures[:5]
    turned_away = sum(n for key, n in report.counts.items() if key.startswith(("429", "503")))
    completed = sum(n for key, n in report.counts.items() if key.startswith("200"))
    assert completed > 0 and turned_away > 0, report.counts  # it was overloaded, and still served
    assert report.ttft_p90_last_third_ms is not None and report.ttft_p90_first_third_ms is not None
    assert report.ttft_p90_last_third_ms < 2 * report.ttft_p90_first_third_ms + 2000, report
    half = len(report.rss_mib) // 2
    assert max(report.rss_mib[half:]) < max(report.rss_mib[:half]) + 64, report.rss_mib
    assert report.after == {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}, report.after
    assert report.ok
