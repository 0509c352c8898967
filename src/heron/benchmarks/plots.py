"""PNG charts of benchmark results (matplotlib, imported only when plotting)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from heron.benchmarks.endpoint_client import RequestResult


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - an optional dependency
        raise RuntimeError("plotting needs matplotlib: pip install matplotlib") from exc
    return plt


def plot_run(results: list[RequestResult], prefix: str, title: str) -> list[str]:
    """Latency CDFs (TTFT, TPOT, ITL, E2E) and output tokens over time."""
    plt = _pyplot()
    done = [r for r in results if r.success]
    series = {
        "TTFT": [r.ttft * 1000 for r in done],
        "TPOT": [(r.latency - r.ttft) / (r.output_tokens - 1) * 1000 for r in done if r.output_tokens > 1],
        "ITL": [x * 1000 for r in done for x in r.itl],
        "E2E latency": [r.latency * 1000 for r in done],
    }
    figure, axes = plt.subplots(2, 2, figsize=(10, 7))
    for axis, (name, values) in zip(axes.flat, series.items()):
        if values:
            data = np.sort(np.asarray(values))
            axis.plot(data, np.arange(1, len(data) + 1) / len(data))
        axis.set_xlabel(f"{name} (ms)")
        axis.set_ylabel("fraction of requests" if name != "ITL" else "fraction of tokens")
        axis.grid(alpha=0.3)
    figure.suptitle(f"{title}: latency CDFs")
    figure.tight_layout()
    cdf_path = f"{prefix}-latency-cdf.png"
    figure.savefig(cdf_path, dpi=110)
    plt.close(figure)

    times = np.sort(np.asarray([t for r in done for t in r.chunk_times]))
    figure, axis = plt.subplots(figsize=(8, 4))
    if times.size:
        axis.plot(times, np.arange(1, times.size + 1))
    axis.set_xlabel("time since start (s)")
    axis.set_ylabel("output chunks received")
    axis.set_title(f"{title}: output over time")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    tokens_path = f"{prefix}-tokens-over-time.png"
    figure.savefig(tokens_path, dpi=110)
    plt.close(figure)
    return [cdf_path, tokens_path]


def plot_comparison(results: list[dict[str, Any]], path: str) -> str:
    """Side-by-side bars of throughput and median/p99 latencies."""
    plt = _pyplot()
    labels = [r.get("label") or r.get("model_id") or f"run {i}" for i, r in enumerate(results)]
    panels = [
        ("Output throughput (tok/s)", ["output_throughput"]),
        ("TTFT (ms)", ["median_ttft_ms", "p99_ttft_ms"]),
        ("TPOT (ms)", ["median_tpot_ms", "p99_tpot_ms"]),
        ("ITL (ms)", ["median_itl_ms", "p99_itl_ms"]),
    ]
    figure, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4))
    for axis, (title, keys) in zip(axes, panels):
        width = 0.8 / len(keys)
        for k, key in enumerate(keys):
            values = [float(r.get(key) or 0.0) for r in results]
            axis.bar(np.arange(len(results)) + k * width, values, width, label=key.split("_")[0])
        axis.set_xticks(np.arange(len(results)) + width * (len(keys) - 1) / 2, labels, rotation=20)
        axis.set_title(title)
        if len(keys) > 1:
            axis.legend()
    figure.tight_layout()
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
