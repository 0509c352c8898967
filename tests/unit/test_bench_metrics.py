"""The bench result's shape where vLLM's tools read it: per-request lists that
line up (failed requests included), percentile keys, goodput bounds."""

from __future__ import annotations

import pytest

from heron.benchmarks.endpoint_client import RequestResult
from heron.benchmarks.metrics import parse_goodput
from heron.benchmarks.serve import format_report, summarize


def result(success: bool, ttft: float = 0.1) -> RequestResult:
    done = RequestResult(prompt_len=10)
    if success:
        done.success, done.ttft, done.latency, done.output_tokens = True, ttft, 1.0, 5
        done.itl, done.generated_text = [0.2] * 4, "a b c d e"
    else:
        done.error = "HTTP 500: boom"
    return done


def test_the_per_request_lists_line_up_failed_requests_included():
    results = [result(True, 0.1), result(False), result(True, 0.3)]
    summary = summarize(results, 2.0, {}, [50, 99, 99.9], {"label": "x"})
    for key in ("input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors"):
        assert len(summary[key]) == 3, key
    assert summary["errors"] == ["", "HTTP 500: boom", ""] and summary["output_lens"] == [5, 0, 5]
    assert summary["ttfts"] == [0.1, 0.0, 0.3] and summary["completed"] == 2
    assert "p99.9_ttft_ms" in summary and "p99_ttft_ms" in summary  # vLLM's names
    assert "P99.9 TTFT (ms):" in format_report(summary, [50, 99, 99.9])


@pytest.mark.parametrize("item", ["ttft:-5", "tpot:0", "e2el:nan", "ttft:"])
def test_a_goodput_bound_must_be_positive(item):
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput([item])
