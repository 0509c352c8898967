"""Summary statistics of a serving benchmark, with vLLM's field names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from heron.benchmarks.endpoint_client import RequestResult

GOODPUT_KEYS = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2el", "e2e": "e2el"}


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, _, value = item.partition(":")
        key = GOODPUT_KEYS.get(name.strip().lower())
        try:
            bound = float(value) if key is not None else None
        except ValueError:
            bound = None
        if key is None or bound is None:
            raise ValueError(f"--goodput expects NAME:MS with NAME in ttft, tpot, e2el; got {item!r}")
        slos[key] = bound
        if not slos[key] > 0:  # NaN too
            raise ValueError(f"--goodput {name}: the bound must be a positive number of milliseconds, got {value!r}")
    return slos


def percentile_label(p: float) -> str:
    """A percentile's name in result keys, as vLLM writes it: ``99``, ``99.9``."""
    return str(int(p)) if int(p) == p else str(p)


@dataclass
class RequestTimes:
    ttft_ms: float
    tpot_ms: float | None
    e2el_ms: float


def per_request(result: RequestResult) -> RequestTimes:
    tpot = None
    if result.output_tokens > 1:
        tpot = (result.latency - result.ttft) / (result.output_tokens - 1) * 1000
    return RequestTimes(result.ttft * 1000, tpot, result.latency * 1000)


def _summary(name: str, values: list[float], percentiles: list[float]) -> dict[str, float]:
    array = np.asarray(values, dtype=np.float64) if values else np.zeros(1)
    summary = {
        f"mean_{name}_ms": float(array.mean()),
        f"median_{name}_ms": float(np.median(array)),
        f"std_{name}_ms": float(array.std()),
    }
    for p in percentiles:
        summary[f"p{percentile_label(p)}_{name}_ms"] = float(np.percentile(array, p))
    return summary


def compute_metrics(
    results: list[RequestResult], duration_s: float, goodput_slos: dict[str, float], percentiles: list[float]
) -> dict[str, Any]:
    done = [r for r in results if r.success]
    times = [per_request(r) for r in done]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_tokens for r in done)
    good = 0
    for t in times:
        ok = (
            t.ttft_ms <= goodput_slos.get("ttft", float("inf"))
            and (t.tpot_ms or 0.0) <= goodput_slos.get("tpot", float("inf"))
            and t.e2el_ms <= goodput_slos.get("e2el", float("inf"))
        )
        good += ok
    metrics: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "request_goodput": good / duration_s if goodput_slos else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    metrics.update(_summary("ttft", [t.ttft_ms for t in times], percentiles))
    metrics.update(_summary("tpot", [t.tpot_ms for t in times if t.tpot_ms is not None], percentiles))
    metrics.update(_summary("itl", [x * 1000 for r in done for x in r.itl], percentiles))
    metrics.update(_summary("e2el", [t.e2el_ms for t in times], percentiles))
    return metrics
