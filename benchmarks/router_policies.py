"""Routing policies side by side on two replicas of the embedded model (issue 18).

For each policy: two fresh `heron serve` replicas (empty caches, KV events on),
`heron router --policy P` in front, and `heron bench serve` through the router
with a shared-prefix workload (prefix-repetition: a few long system prompts,
each shared by many requests) at a fixed request rate. Reported per policy:
the replicas' prefix-cache hit rate (from their own counters), TTFT p50/p99,
output throughput, and the router's CPU time per streamed output token. Then
the router's own latency: TTFT p50 of sequential short requests straight to a
replica and through the router.

    python benchmarks/router_policies.py --out benchmarks/results/router-issue18

Prints a markdown table and writes results.json into --out. Linux (reads /proc).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.process_cpu import cpu_ticks  # noqa: E402
from tests.e2e.router_process import RouterProcess  # noqa: E402
from tests.e2e.server_process import ServerProcess  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
KV_EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"})


def counter(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def bench(base_url: str, out: Path, name: str, args: list[str]) -> dict:
    command = [sys.executable, "-m", "heron.entrypoints.cli", "bench", "serve", "--base-url", base_url,
               "--save-result", "--result-dir", str(out), "--result-filename", f"{name}.json", "--disable-tqdm",
               *args]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / f"{name}.json").read_text())


def run_policy(policy: str, workload: list[str], out: Path) -> dict:
    replicas = [ServerProcess("--kv-events-config", KV_EVENTS, "--max-num-seqs", "16") for _ in range(2)]
    router = None
    try:
        router = RouterProcess([r.base_url for r in replicas], "--policy", policy)
        deadline = time.monotonic() + 30
        while not all(s["kv_events"] for s in router.replicas().values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        queries0 = sum(counter(r, "heron:prefix_cache_queries_total") for r in replicas)
        hits0 = sum(counter(r, "heron:prefix_cache_hits_total") for r in replicas)
        ticks0 = cpu_ticks(router.process.pid) or 0
        result = bench(router.base_url, out, policy, workload)
        router_cpu_s = ((cpu_ticks(router.process.pid) or 0) - ticks0) / TICKS
        queries = sum(counter(r, "heron:prefix_cache_queries_total") for r in replicas) - queries0
        hits = sum(counter(r, "heron:prefix_cache_hits_total") for r in replicas) - hits0
        per_replica = {url: state["requests"] for url, state in router.replicas().items()}
        return {
            "policy": policy,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "ttft_p50_ms": result["median_ttft_ms"],
            "ttft_p99_ms": result["p99_ttft_ms"],
            "output_throughput": result["output_throughput"],
            "completed": result["completed"],
            "router_cpu_ms_per_output_token": 1000 * router_cpu_s / max(1, result["total_output_tokens"]),
            "requests_per_replica": list(per_replica.values()),
        }
    finally:
        if router is not None:
            router.stop()
        for replica in replicas:
            replica.stop()


def router_latency(out: Path, num_prompts: int) -> dict:
    """TTFT p50 of sequential short requests: straight to a replica, then through the router."""
    replica = ServerProcess("--kv-events-config", KV_EVENTS)
    router = None
    try:
        router = RouterProcess([replica.base_url])
        def sequential(seed: int) -> list[str]:  # different seeds: no request hits the other's cache
            return ["--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "8",
                    "--num-prompts", str(num_prompts), "--max-concurrency", "1", "--seed", str(seed), "--ignore-eos"]

        bench(replica.base_url, out, "warmup", sequential(6))
        direct = bench(replica.base_url, out, "direct", sequential(7))
        routed = bench(router.base_url, out, "routed", sequential(8))
        return {"direct_ttft_p50_ms": direct["median_ttft_ms"], "routed_ttft_p50_ms": routed["median_ttft_ms"],
                "added_ttft_p50_ms": routed["median_ttft_ms"] - direct["median_ttft_ms"]}
    finally:
        if router is not None:
            router.stop()
        replica.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="directory for results.json and the bench results")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--request-rate", type=float, default=1.5)
    parser.add_argument("--prefix-len", type=int, default=384)
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument("--policies", default="round_robin,least_load,kv_aware")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="heron-router-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    workload = ["--dataset-name", "prefix-repetition", "--num-prompts", str(args.num_prompts),
                "--prefix-repetition-prefix-len", str(args.prefix_len), "--prefix-repetition-suffix-len", "32",
                "--prefix-repetition-num-prefixes", str(args.num_prefixes), "--prefix-repetition-output-len", "24",
                "--request-rate", str(args.request_rate), "--seed", "1", "--ignore-eos"]
    rows = [run_policy(policy, workload, out) for policy in args.policies.split(",")]
    latency = router_latency(out, 40)
    (out / "results.json").write_text(json.dumps({"policies": rows, "router_latency": latency,
                                                  "workload": workload}, indent=2))
    print("| policy | prefix-cache hit rate | TTFT p50 | TTFT p99 | output tok/s | requests per replica |"
          " router CPU per output token |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['policy']} | {row['prefix_cache_hit_rate']:.1%} | {row['ttft_p50_ms']:.0f} ms | "
              f"{row['ttft_p99_ms']:.0f} ms | {row['output_throughput']:.1f} | {row['requests_per_replica']} | "
              f"{row['router_cpu_ms_per_output_token']:.2f} ms |")
    print(f"\nTTFT p50, sequential short requests: direct {latency['direct_ttft_p50_ms']:.1f} ms, through the "
          f"router {latency['routed_ttft_p50_ms']:.1f} ms (+{latency['added_ttft_p50_ms']:.2f} ms)")


if __name__ == "__main__":
    main()
