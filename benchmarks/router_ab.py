"""Two routers side by side on one replica: the router of another source tree
(``--base-src``, e.g. a ``git worktree`` of an earlier commit) and this tree's,
each as its own process, with requests straight to the replica, through one
router and through the other in a drawn order each time, so all three see the
same machine. Prints the p50 of the paired differences (router minus direct)
with a bootstrap 95% interval for the proxy hop (``GET /v1/models``) and the
time to the first streamed token of the chat and completions requests of
``router_policies.router_latency``.

    git worktree add /tmp/base HEAD~1
    python benchmarks/router_ab.py --base-src /tmp/base/src [--requests 1000]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections.abc import Callable
from pathlib import Path
from statistics import median

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.router_policies import (  # noqa: E402
    KV_EVENTS,
    _chat_ttft,
    _completion_ttft,
    _median_interval,
    _timed_get,
)
from tests.e2e.router_process import RouterProcess  # noqa: E402
from tests.e2e.server_process import ServerProcess  # noqa: E402

Timed = Callable[[httpx.Client, str, int], float]


def _hop(client: httpx.Client, base: str, _: int) -> float:
    return _timed_get(client, f"{base}/v1/models")


def compare(base_src: str, requests: int) -> dict[str, dict[str, float]]:
    replica = ServerProcess("--kv-events-config", KV_EVENTS)
    routers: dict[str, RouterProcess] = {}
    saved = os.environ.get("PYTHONPATH")
    try:
        for name, src in (("base", base_src), ("this", str(Path(__file__).resolve().parent.parent / "src"))):
            os.environ["PYTHONPATH"] = src  # the router process imports heron from there
            routers[name] = RouterProcess([replica.base_url], "--probe-interval", "1")
        urls = {"direct": replica.base_url, **{name: router.base_url for name, router in routers.items()}}
        clients = {name: httpx.Client(timeout=10) for name in urls}
        kinds: list[tuple[str, Timed, int]] = [("hop", _hop, 2 * requests), ("chat_ttft", _chat_ttft, requests),
                                               ("completion_ttft", _completion_ttft, requests)]
        order = random.Random(0)
        results = {}
        for kind, timed, count in kinds:
            rows = []
            for index in range(count + 20):
                names = list(urls)
                order.shuffle(names)
                times = {name: timed(clients[name], urls[name], index) for name in names}
                if index >= 20:  # warm-up
                    rows.append(times)
            results[kind] = {"direct_p50_ms": median(row["direct"] for row in rows)}
            for name in routers:
                added = [row[name] - row["direct"] for row in rows]
                low, high = _median_interval(added)
                results[kind] |= {f"{name}_added_p50_ms": median(added), f"{name}_ci95_low_ms": low,
                                  f"{name}_ci95_high_ms": high}
        return results
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
        for router in routers.values():
            router.stop()
        replica.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-src", required=True, help="the other tree's src/ directory")
    parser.add_argument("--requests", type=int, default=1000,
                        help="triplets per streamed kind (twice that for the hop)")
    args = parser.parse_args()
    for kind, row in compare(args.base_src, args.requests).items():
        parts = [f"{name}: {row[f'{name}_added_p50_ms']:+.2f} ms ({row[f'{name}_ci95_low_ms']:+.2f} to "
                 f"{row[f'{name}_ci95_high_ms']:+.2f})" for name in ("base", "this")]
        print(f"{kind}: direct p50 {row['direct_p50_ms']:.2f} ms; added, p50 [95% interval]: " + "; ".join(parts))


if __name__ == "__main__":
    main()
