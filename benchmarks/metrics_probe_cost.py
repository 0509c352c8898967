"""What one router probe's /metrics fetch costs against a running replica, the
whole exposition against the three gauges a probe reads (``name[]``), as cited
in BENCHMARKS.md: sequential fetches on one kept-alive connection, three
alternated rounds. Serve a few requests first, so the histograms exist.

    python benchmarks/metrics_probe_cost.py --base-url http://127.0.0.1:8000 [--fetches 50]
"""

from __future__ import annotations

import argparse
import time

import httpx

LOAD_GAUGES = [("name[]", f"heron:{name}")
               for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--fetches", type=int, default=50)
    args = parser.parse_args()
    with httpx.Client(base_url=args.base_url) as client:
        for _ in range(3):
            for label, params in (("whole", None), ("three gauges", LOAD_GAUGES)):
                started = time.perf_counter()
                size = 0
                for _ in range(args.fetches):
                    size = len(client.get("/metrics", params=params).content)
                elapsed = (time.perf_counter() - started) / args.fetches * 1000
                print(f"{label}: {size} bytes, {elapsed:.2f} ms per fetch")


if __name__ == "__main__":
    main()
