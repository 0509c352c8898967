"""benchmarks/gpu_serve.py runs end to end on a CPU (tiny model, one low
concurrency): a live server, the bench's percentiles, and the CPU use of the
API server, engine core and bench client read from /proc."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
from benchmarks import gpu_serve
from benchmarks.host_overhead import build_tiny_model
from benchmarks.process_cpu import ProcessCpuSampler, cpu_ticks

from tests.e2e.server_process import free_port


@pytest.mark.slow
def test_gpu_serve_script_on_a_cpu(tmp_path, monkeypatch):
    model = tmp_path / "model"
    build_tiny_model(str(model))
    out = tmp_path / "serve.json"
    argv = ["gpu_serve.py", "--out", str(out), "--model-dir", str(model), "--dtype", "float32",
            "--concurrency", "2", "--input-len", "32", "--output-len", "8", "--port", str(free_port())]
    monkeypatch.setattr(sys, "argv", argv)
    gpu_serve.main()
    report = json.loads(out.read_text())
    result = report["concurrency_2"]
    assert result["completed"] == 16 and result["failed"] == 0
    assert result["p50_tpot_ms"] > 0
    cpu = result["process_cpu"]
    assert cpu["api_server_cpu_pct_mean"] > 0 and cpu["bench_client_cpu_pct_max_1s"] > 0
    assert "engine_core_cpu_pct_mean" in cpu


def test_the_cpu_sampler_sees_a_busy_process():
    assert cpu_ticks(os.getpid()) is not None and cpu_ticks(2**22 + 12345) is None
    with ProcessCpuSampler({"me": os.getpid()}, interval_s=0.05) as sampler:
        deadline = time.monotonic() + 0.6
        while time.monotonic() < deadline:
            pass  # spin: ~100% of a core
    report = sampler.report()
    assert 50 < report["me_cpu_pct_mean"] <= 110
