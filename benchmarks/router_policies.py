"""Routing policies side by side on two replicas of the embedded model (issue 18).

For each workload and policy: two fresh `heron serve` replicas (empty caches,
KV events on, the machine's cores split between them), `heron router --policy
P` in front, and through the router either `heron bench serve` with a
shared-prefix workload (prefix-repetition: a few long system prompts, each
shared by many requests) at a fixed request rate, or multi-turn chats
(`benchmarks/multi_turn.py`: conversations started at a fixed rate, each
resending its history every turn; `session` joins the policies there).
Reported per policy:
the replicas' prefix-cache hit rate (from their own counters), TTFT p50/p99,
output throughput, and the router's CPU time per streamed output token. Then
the router's own cost: the proxy hop (a request the replica answers at once,
straight and through the router) and its hashing and choice per request.

    python benchmarks/router_policies.py --out benchmarks/results/router-issue18

Prints a markdown table and writes results.json into --out. Linux (reads /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.multi_turn import run_multi_turn  # noqa: E402
from benchmarks.process_cpu import cpu_ticks  # noqa: E402
from tests.e2e.router_process import RouterProcess  # noqa: E402
from tests.e2e.server_process import ServerProcess  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
KV_EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"})


def counter(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def bench_command(base_url: str, out: Path, name: str, args: list[str]) -> list[str]:
    """`heron bench serve` against ``base_url``, its result saved as ``out/name.json``."""
    return [sys.executable, "-m", "heron.entrypoints.cli", "bench", "serve", "--base-url", base_url,
            "--save-result", "--result-dir", str(out), "--result-filename", f"{name}.json", "--disable-tqdm", *args]


def bench(base_url: str, out: Path, name: str, args: list[str]) -> dict:
    subprocess.run(bench_command(base_url, out, name, args), check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / f"{name}.json").read_text())


def run_policy(policy: str, workload: Callable[[str], dict]) -> dict:
    """Two fresh replicas and a router with ``policy``; ``workload(router_url)``
    returns TTFT p50/p99 (ms), output throughput and its output token count."""
    # the machine's cores split between the replicas (torch would give each all of them)
    threads = str(max(1, (os.cpu_count() or 2) // 2))
    replicas = [ServerProcess("--kv-events-config", KV_EVENTS, "--max-num-seqs", "16",
                              env={"OMP_NUM_THREADS": threads}) for _ in range(2)]
    router = None
    try:
        router = RouterProcess([r.base_url for r in replicas], "--policy", policy)
        deadline = time.monotonic() + 30
        while not all(s["kv_events"] for s in router.replicas().values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        queries0 = sum(counter(r, "heron:prefix_cache_queries_total") for r in replicas)
        hits0 = sum(counter(r, "heron:prefix_cache_hits_total") for r in replicas)
        ticks0 = cpu_ticks(router.process.pid) or 0
        result = workload(router.base_url)
        router_cpu_s = ((cpu_ticks(router.process.pid) or 0) - ticks0) / TICKS
        queries = sum(counter(r, "heron:prefix_cache_queries_total") for r in replicas) - queries0
        hits = sum(counter(r, "heron:prefix_cache_hits_total") for r in replicas) - hits0
        per_replica = {url: state["requests"] for url, state in router.replicas().items()}
        return {
            "policy": policy,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            **{key: result[key] for key in ("ttft_p50_ms", "ttft_p99_ms", "output_throughput", "completed")},
            "router_cpu_ms_per_output_token": 1000 * router_cpu_s / max(1, result["output_tokens"]),
            "requests_per_replica": list(per_replica.values()),
        }
    finally:
        if router is not None:
            router.stop()
        for replica in replicas:
            replica.stop()


def shared_prefix_workload(out: Path, args: list[str]) -> Callable[[str], dict]:
    """``heron bench serve`` with the prefix-repetition dataset (shared system prompts)."""
    def run(base_url: str) -> dict:
        name = f"bench-{time.monotonic_ns()}"
        result = bench(base_url, out, name, args)
        return {"ttft_p50_ms": result["median_ttft_ms"], "ttft_p99_ms": result["p99_ttft_ms"],
                "output_throughput": result["output_throughput"], "completed": result["completed"],
                "output_tokens": result["total_output_tokens"]}

    return run


def multi_turn_workload(conversations: int, turns: int, rate: float) -> Callable[[str], dict]:
    """Conversations resending their history every turn (``benchmarks/multi_turn.py``)."""
    def run(base_url: str) -> dict:
        result = asyncio.run(run_multi_turn(base_url, conversations, turns, rate))
        return {**result, "completed": result["turns_completed"],
                "output_tokens": round(result["output_throughput"] * result["duration_s"])}

    return run


def router_latency(num_requests: int = 1000, router_nice: int | None = None,
                   replica_threads: int | None = None, replica_args: tuple[str, ...] = (),
                   router_args: tuple[str, ...] = ()) -> dict:
    """What the router adds to a request, straight and through the router in
    alternation on kept-alive connections (so both see the same machine; which
    goes first is drawn each time), as the p50 of the paired differences with
    a bootstrap 95% interval: the proxy hop on a request the replica answers at
    once (``GET /v1/models``, ``2 * num_requests`` pairs); the time to the first
    streamed token (the first event carrying text) of a two-token chat request
    (a ~1.3k-character system prompt: the router renders the chat template,
    tokenizes and hashes it) and of a completions request with the same text as
    its prompt (``num_requests`` pairs each); and the router's hashing and
    choice per chat request (its ``heron_router_decision_seconds``). The router
    probes at its default interval (1 s), as deployed; ``router_nice``: its
    scheduling priority (below 0 needs root or CAP_SYS_NICE); ``replica_threads``:
    the replica's OpenMP threads (default: torch's, one per core, so the router
    and the client wait for a core while the replica computes); ``replica_args``:
    more `heron serve` arguments (another model, a GPU replica's settings; the
    model needs a chat template); ``router_args``: more `heron router` arguments
    (its --model, when the replica's is not the embedded one)."""
    env = {"OMP_NUM_THREADS": str(replica_threads)} if replica_threads else None
    replica = ServerProcess("--kv-events-config", KV_EVENTS, *replica_args, env=env)
    router = None
    try:
        router = RouterProcess([replica.base_url], "--probe-interval", "1", *router_args)
        if router_nice is not None:
            os.setpriority(os.PRIO_PROCESS, router.process.pid, router_nice)
        with httpx.Client(timeout=10) as direct, httpx.Client(timeout=10) as routed:
            model = direct.get(f"{replica.base_url}/v1/models").json()["data"][0]["id"]
            hop = _paired(2 * num_requests, direct, routed, replica.base_url, router.base_url,
                          lambda client, base, _: _timed_get(client, f"{base}/v1/models"))
            before = _decision_totals(router)
            chat = _paired(num_requests, direct, routed, replica.base_url, router.base_url,
                           lambda client, base, index: _chat_ttft(client, base, index, model))
            total, count = (after - start for after, start in zip(_decision_totals(router), before, strict=True))
            completion = _paired(num_requests, direct, routed, replica.base_url, router.base_url,
                                 lambda client, base, index: _completion_ttft(client, base, index, model))
        return {"hop": hop, "chat_ttft": chat, "completion_ttft": completion, "decision_mean_ms": 1000 * total / count,
                "model": model, "replica_args": list(replica_args)}
    finally:
        if router is not None:
            router.stop()
        replica.stop()


def _paired(num_requests: int, direct: httpx.Client, routed: httpx.Client, direct_url: str, routed_url: str,
            timed: Callable[[httpx.Client, str, int], float]) -> dict:
    pairs = []
    order = random.Random(0)
    for index in range(num_requests + 20):
        if order.random() < 0.5:
            times = [timed(direct, direct_url, index), timed(routed, routed_url, index)]
        else:
            times = list(reversed([timed(routed, routed_url, index), timed(direct, direct_url, index)]))
        if index >= 20:  # warm-up
            pairs.append(times)
    added = [r - d for d, r in pairs]
    low, high = _median_interval(added)
    return {"direct_p50_ms": median(d for d, _ in pairs), "routed_p50_ms": median(r for _, r in pairs),
            "added_p50_ms": median(added), "added_p50_ci95_ms": [low, high], "pairs": len(pairs),
            "added_ms": [round(value, 4) for value in added]}  # kept, so that runs can be pooled


def _median_interval(values: list[float], resamples: int = 1000) -> tuple[float, float]:
    """A bootstrap 95% interval of the median of ``values``."""
    rng = random.Random(1)
    medians = sorted(median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def _timed_get(client: httpx.Client, url: str) -> float:
    started = time.perf_counter()
    client.get(url).raise_for_status()
    return 1000 * (time.perf_counter() - started)


SYSTEM = "You answer questions about estuary birds. " * 30


def _chat_ttft(client: httpx.Client, base: str, index: int, model: str) -> float:
    body = {"model": model, "max_tokens": 2, "temperature": 0, "stream": True, "ignore_eos": True,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"Which bird waits in the shallows? ({index % 7})"}]}
    return _first_event_ms(client, f"{base}/v1/chat/completions", body)


def _completion_ttft(client: httpx.Client, base: str, index: int, model: str) -> float:
    body = {"model": model, "max_tokens": 2, "temperature": 0, "stream": True, "ignore_eos": True,
            "prompt": f"{SYSTEM}Which bird waits in the shallows? ({index % 7})"}
    return _first_event_ms(client, f"{base}/v1/completions", body)


def _first_event_ms(client: httpx.Client, url: str, body: dict) -> float:
    started = time.perf_counter()
    first = None
    with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: {") and _has_text(json.loads(line[6:])):
                first = 1000 * (time.perf_counter() - started)
    assert first is not None, "no token in the stream"
    return first


def _has_text(event: dict) -> bool:
    """A streamed event carrying a token (not chat's opening role-only event)."""
    choice = event["choices"][0]
    return bool(choice.get("text") or choice.get("delta", {}).get("content"))


def _decision_totals(router: RouterProcess) -> tuple[float, float]:
    metrics = httpx.get(f"{router.base_url}/metrics", timeout=5).text
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("heron_router_decision_seconds_")}
    return values["heron_router_decision_seconds_sum"], values["heron_router_decision_seconds_count"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="directory for results.json and the bench results")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--request-rate", type=float, default=0.6)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--policies", default="round_robin,least_load,kv_aware")
    parser.add_argument("--conversations", type=int, default=16, help="multi-turn workload: conversations")
    parser.add_argument("--turns", type=int, default=4, help="multi-turn workload: turns per conversation")
    parser.add_argument("--conversation-rate", type=float, default=0.4, help="conversations started per second")
    parser.add_argument("--workloads", default="shared_prefix,multi_turn")
    parser.add_argument("--latency-only", action="store_true", help="only the router's own added latency")
    parser.add_argument("--latency-requests", type=int, default=1000,
                        help="paired requests per kind in the added-latency measurement")
    parser.add_argument("--router-nice", type=int, default=None,
                        help="the router's nice value in the added-latency measurement (below 0: root only)")
    parser.add_argument("--replica-threads", type=int, default=None,
                        help="the replica's OpenMP threads in the added-latency measurement (default: one per "
                             "core; fewer leaves the router and the client a core, as two replicas split them)")
    parser.add_argument("--replica-args", default="",
                        help="more `heron serve` arguments for the replica of the added-latency measurement, one "
                             "string (e.g. \"--model DIR --dtype bfloat16\" for a GPU replica)")
    parser.add_argument("--router-args", default="",
                        help="more `heron router` arguments there, one string (e.g. \"--model DIR\")")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="heron-router-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    shared = ["--dataset-name", "prefix-repetition", "--num-prompts", str(args.num_prompts),
              "--prefix-repetition-prefix-len", str(args.prefix_len), "--prefix-repetition-suffix-len", "32",
              "--prefix-repetition-num-prefixes", str(args.num_prefixes), "--prefix-repetition-output-len", "24",
              "--request-rate", str(args.request_rate), "--seed", "1", "--ignore-eos"]
    workloads = {"shared_prefix": shared_prefix_workload(out, shared),
                 "multi_turn": multi_turn_workload(args.conversations, args.turns, args.conversation_rate)}
    policies = args.policies.split(",")
    results: dict[str, list[dict]] = {}
    for name in [] if args.latency_only else args.workloads.split(","):
        # session pins a conversation: compared where there are conversations
        names = policies + (["session"] if name == "multi_turn" and "session" not in policies else [])
        results[name] = [run_policy(policy, workloads[name]) for policy in names]
    latency = router_latency(args.latency_requests, args.router_nice, args.replica_threads,
                             tuple(shlex.split(args.replica_args)), tuple(shlex.split(args.router_args)))
    (out / "results.json").write_text(json.dumps({
        "workloads": results, "router_latency": latency, "replica_threads": args.replica_threads,
        "shared_prefix_args": shared, "multi_turn": {"conversations": args.conversations, "turns": args.turns,
                                                     "conversation_rate": args.conversation_rate}}, indent=2))
    for name, rows in results.items():
        print(f"\n{name}:\n")
        print("| policy | prefix-cache hit rate | TTFT p50 | TTFT p99 | output tok/s | completed "
              "| requests per replica | router CPU per output token |")
        print("|---|---|---|---|---|---|---|---|")
        for row in rows:
            print(f"| {row['policy']} | {row['prefix_cache_hit_rate']:.1%} | {row['ttft_p50_ms']:.0f} ms | "
                  f"{row['ttft_p99_ms']:.0f} ms | {row['output_throughput']:.1f} | {row['completed']} | "
                  f"{row['requests_per_replica']} | {row['router_cpu_ms_per_output_token']:.2f} ms |")
    print_latency(latency)


def print_latency(latency: dict) -> None:
    hop = latency["hop"]
    print(f"\nrouter hop (GET /v1/models, p50 of paired differences): direct {hop['direct_p50_ms']:.2f} ms, "
          f"routed {hop['routed_p50_ms']:.2f} ms, added {_added(hop)}; hashing a chat request "
          f"and choosing: {latency['decision_mean_ms']:.2f} ms mean")
    for kind in ("chat_ttft", "completion_ttft"):
        row = latency[kind]
        print(f"{kind} (streamed, first token): direct {row['direct_p50_ms']:.2f} ms, routed "
              f"{row['routed_p50_ms']:.2f} ms, added {_added(row)} (p50 of {row['pairs']} paired differences)")


def _added(row: dict) -> str:
    low, high = row["added_p50_ci95_ms"]
    return f"{row['added_p50_ms']:+.2f} ms (95% interval {low:+.2f} to {high:+.2f})"


if __name__ == "__main__":
    main()
