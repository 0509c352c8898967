"""heron bench against a live heron server, and the offline benchmarks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from heron.entrypoints.cli import main

VLLM_FIELDS = [
    "completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
    "total_input_tokens", "total_output_tokens",
    *[f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "p99")],
]


def test_bench_serve_reports_every_field(server, tmp_path, capsys):
    rc = main([
        "bench", "serve", "--base-url", server.base_url, "--dataset-name", "random", "--num-prompts", "12",
        "--random-input-len", "48", "--random-output-len", "16", "--random-range-ratio", "0.25",
        "--request-rate", "20", "--burstiness", "0.5", "--max-concurrency", "6", "--ignore-eos",
        "--goodput", "ttft:60000", "tpot:60000", "--save-result", "--result-dir", str(tmp_path),
        "--result-filename", "run.json", "--plot", "--disable-tqdm", "--label", "heron",
    ])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Mean TTFT (ms)" in printed
    result = json.loads((tmp_path / "run.json").read_text())
    for field in VLLM_FIELDS:
        assert field in result, field
    assert result["completed"] == 12 and result["failed"] == 0
    assert (result["total_output_tokens"] == sum(result["output_lens"])
            and 12 * 12 <= result["total_output_tokens"] <= 12 * 20)
    assert 0 < result["median_ttft_ms"] <= result["p99_ttft_ms"] < result["p99_e2el_ms"]
    assert 0 < result["median_tpot_ms"] < 10_000 and result["median_itl_ms"] > 0
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["model_id"] == "SmolLM2-135M-Instruct" and result["max_concurrency"] == 6
    for chart in ("run-latency-cdf.png", "run-tokens-over-time.png"):
        assert (tmp_path / chart).stat().st_size > 10_000

    # a second run on the chat endpoint, then the side-by-side comparison
    rc = main([
        "bench", "serve", "--base-url", server.base_url, "--endpoint", "/v1/chat/completions",
        "--num-prompts", "6", "--random-input-len", "32", "--random-output-len", "8", "--ignore-eos",
        "--result-dir", str(tmp_path), "--result-filename", "chat.json", "--disable-tqdm", "--label", "chat",
    ])
    assert rc == 0
    capsys.readouterr()
    assert main(["bench", "compare", str(tmp_path / "run.json"), str(tmp_path / "chat.json"),
                 "--plot", str(tmp_path / "compare.png")]) == 0
    table = capsys.readouterr().out
    assert "| output_throughput |" in table and "chat / heron" in table
    assert (tmp_path / "compare.png").stat().st_size > 10_000


def test_bench_serve_counts_failures(tmp_path, capsys):
    rc = main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "x", "--num-prompts", "3",
               "--random-input-len", "8", "--random-output-len", "4", "--disable-tqdm",
               "--result-dir", str(tmp_path), "--result-filename", "down.json"])
    assert rc == 1  # nothing measured: a script must see it
    result = json.loads((tmp_path / "down.json").read_text())
    assert result["completed"] == 0 and result["failed"] == 3 and len(result["errors"]) == 3


def test_offline_throughput_and_latency_with_profile(tmp_path):
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    common = ["--max-model-len", "256", "--num-kv-blocks", "64", "--disable-tqdm"]
    throughput = subprocess.run(
        [sys.executable, "-m", "heron.entrypoints.cli", "bench", "throughput", "--num-prompts", "8",
         "--input-len", "32", "--output-len", "8", "--output-json", str(tmp_path / "t.json"),
         "--profile", str(tmp_path / "trace"),
         "--profile-steps", "3", *common], capture_output=True, text=True, env=env, timeout=300)
    assert throughput.returncode == 0, throughput.stderr
    assert "output tokens/s" in throughput.stdout
    result = json.loads((tmp_path / "t.json").read_text())
    assert result["num_requests"] == 8 and result["total_output_tokens"] == 64 and result["requests_per_second"] > 0
    [trace] = os.listdir(tmp_path / "trace")
    events = json.loads((tmp_path / "trace" / trace).read_text())["traceEvents"]
    names = {event.get("name") for event in events}
    assert {"schedule", "prepare_inputs", "forward", "sample"} <= names
    latency = subprocess.run(
        [sys.executable, "-m", "heron.entrypoints.cli", "bench", "latency", "--batch-size", "2", "--input-len", "16",
         "--output-len", "4", "--num-iters", "2", "--num-iters-warmup", "1", "--output-json", str(tmp_path / "l.json"),
         *common], capture_output=True, text=True, env=env, timeout=300)
    assert latency.returncode == 0, latency.stderr
    result = json.loads((tmp_path / "l.json").read_text())
    assert len(result["latencies"]) == 2 and result["percentiles"]["50"] > 0
    assert "Avg latency" in latency.stdout


def test_bench_serve_measures_a_local_model_with_its_own_tokenizer(tmp_path, monkeypatch):
    """With --model naming a local model and no --tokenizer, the prompts are made
    with that model's tokenizer, as vLLM does (it used the embedded model's)."""
    from heron.entrypoints import bench_cli

    asked: list[str | None] = []
    embedded = bench_cli._load_tokenizer(None)
    monkeypatch.setattr(bench_cli, "_load_tokenizer", lambda name: asked.append(name) or embedded)
    args = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1", "--random-input-len", "8",
            "--random-output-len", "4", "--disable-tqdm", "--result-dir", str(tmp_path)]
    # no server there: each run measures nothing (exit 1), but its prompts were made first
    assert main([*args, "--model", str(tmp_path)]) == 1
    assert main([*args, "--model", "served-name"]) == 1
    assert main([*args, "--model", str(tmp_path), "--tokenizer", "other"]) == 1
    assert asked == [str(tmp_path), None, "other"]
