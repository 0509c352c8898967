"""Side-by-side table of several saved ``heron bench serve`` results."""

from __future__ import annotations

import json
from typing import Any

ROWS = [
    ("completed", "{:.0f}"), ("failed", "{:.0f}"), ("duration", "{:.1f}"),
    ("request_throughput", "{:.2f}"), ("output_throughput", "{:.1f}"), ("total_token_throughput", "{:.1f}"),
    ("median_ttft_ms", "{:.1f}"), ("p99_ttft_ms", "{:.1f}"), ("median_tpot_ms", "{:.1f}"), ("p99_tpot_ms", "{:.1f}"),
    ("median_itl_ms", "{:.1f}"), ("p99_itl_ms", "{:.1f}"), ("median_e2el_ms", "{:.1f}"), ("p99_e2el_ms", "{:.1f}"),
]


def load_results(paths: list[str]) -> list[dict[str, Any]]:
    """The saved results; ValueError naming a file that is not one."""
    results = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as handle:
                result = json.load(handle)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the result {path}: {exc}") from exc
        if not isinstance(result, dict) or "completed" not in result:
            raise ValueError(f"{path} is not a result of heron bench serve --save-result")
        if not result.get("label"):  # a run saved without --label has "label": null
            result["label"] = path
        results.append(result)
    return results


def comparison_table(results: list[dict[str, Any]]) -> str:
    """Markdown table; ratio columns compare every run with the first."""
    labels = [str(r.get("label") or r.get("model_id")) for r in results]
    header = ["metric", *labels] + [f"{label} / {labels[0]}" for label in labels[1:]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key, fmt in ROWS:
        # a run that completed nothing saved latencies of 0 (as vLLM does): none, not the fastest
        values = [None if key.endswith("_ms") and not r.get("completed") else r.get(key) for r in results]
        cells = [fmt.format(v) if isinstance(v, (int, float)) else "-" for v in values]
        base = values[0]
        ratios = [
            f"{v / base:.2f}x" if isinstance(v, (int, float)) and isinstance(base, (int, float)) and base else "-"
            for v in values[1:]
        ]
        lines.append("| " + " | ".join([key, *cells, *ratios]) + " |")
    return "\n".join(lines)
