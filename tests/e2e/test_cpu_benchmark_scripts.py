"""The CPU benchmark scripts behind BENCHMARKS.md's start-up and dtype figures
keep running: each on a small setting, checking the shape of what it prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.e2e.server_process import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_startup_time_waits_for_a_successful_completion():
    port = free_port()
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "startup_time.py"), "--url", f"http://127.0.0.1:{port}",
         "--timeout", "180", "--", sys.executable, "-m", "heron.entrypoints.cli", "serve", "--port", str(port),
         "--kv-cache-memory-bytes", "256MiB", "--max-model-len", "1024"],
        capture_output=True, text=True, timeout=240, check=True,
    )
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert 0 < figures["seconds_to_models"] <= figures["seconds_to_first_completion"] < 180


def test_dtype_compare_reports_both_dtypes():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cpu_dtype_compare.py"), "--requests", "2", "--output-len", "16"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    figures = json.loads(result.stdout)
    assert set(figures) == {"cpu", "float32", "bfloat16", "bf16_speedup"}
    assert all(value > 0 for value in figures["bf16_speedup"].values())


def test_multi_turn_workload_resends_each_conversations_history():
    from tests.e2e.server_process import ServerProcess

    server = ServerProcess()
    try:
        result = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "multi_turn.py"), "--base-url", server.base_url,
             "--conversations", "2", "--turns", "3", "--rate", "4"],
            capture_output=True, text=True, timeout=240, check=True,
        )
        figures = json.loads(result.stdout)
        assert figures["turns_completed"] == 6 and figures["turns_failed"] == 0, figures
        assert 0 < figures["ttft_p50_ms"] <= figures["ttft_p99_ms"] and figures["output_throughput"] > 0
        # every later turn found its conversation's history in the prefix cache
        assert server.metric("heron:prefix_cache_hits_total") >= 4 * 16
    finally:
        server.stop()
