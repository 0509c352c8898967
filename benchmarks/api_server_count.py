"""`heron serve --api-server-count M` side by side: the same workload through
one, two, ... API-server processes on one port (issue 18).

For each M: a fresh server with the given flags, then `heron bench serve` at a
fixed concurrency, split over ``--clients`` bench processes (one client's event
loop saturates a core near 25k streamed tokens/s, so a fast GPU engine needs
several to measure the servers rather than the client); reported per M: output
throughput, TTFT p50/p99, TPOT p50 (over all clients' requests), the CPU time
the API-server processes used per output token (the launcher's children other
than the engine cores) and the bench clients' CPU (% of one core).

    python benchmarks/api_server_count.py --counts 1,2 --out benchmarks/results/api-servers-cpu
    python benchmarks/api_server_count.py --counts 1,2,4 --concurrency 128 --clients 4 -- --model DIR --device cuda

Prints a markdown table and writes results.json into --out. Linux (reads /proc).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.process_cpu import cpu_ticks  # noqa: E402
from benchmarks.router_policies import bench_command  # noqa: E402
from tests.e2e.server_process import ServerProcess  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def api_server_pids(launcher: int, count: int) -> list[int]:
    """The processes serving HTTP: the launcher's API-server children, or the launcher itself when M is 1."""
    if count == 1:
        return [launcher]
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    if b"api_server_proc" in cmdline.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def bench_clients(base_url: str, out: Path, name: str, workload: list[str], clients: int) -> dict:
    """``clients`` bench processes at once, each with its share of the
    concurrency and prompts (``{seed}`` in ``workload`` is each client's own);
    their requests pooled."""
    processes = []
    for index in range(clients):
        args = [arg.replace("{seed}", str(index + 1)) for arg in workload]
        processes.append(subprocess.Popen(bench_command(base_url, out, f"{name}-client{index}", args),
                                          stdout=subprocess.DEVNULL))
    if any(process.wait() != 0 for process in processes):
        raise RuntimeError("a bench client failed")
    parts = [json.loads((out / f"{name}-client{index}.json").read_text()) for index in range(clients)]
    # from the first client's start to the last one's end (they start apart by their imports)
    duration = (max(part["started_at"] + part["duration"] for part in parts)
                - min(part["started_at"] for part in parts))
    # the per-request lists hold every request; a failed one has an error
    ttfts = [1000 * ttft for part in parts for ttft, error in zip(part["ttfts"], part["errors"], strict=True)
             if not error]
    # a request's time per output token after its first (several tokens may share one streamed event)
    tpots = [1000 * sum(itl) / (tokens - 1) for part in parts
             for itl, tokens in zip(part["itls"], part["output_lens"], strict=True) if tokens > 1]
    output_tokens = sum(part["total_output_tokens"] for part in parts)
    client_cpu_s = sum(part["client_cpu_s"] for part in parts)
    return {
        "output_throughput": output_tokens / duration,
        "ttft_p50_ms": float(np.percentile(ttfts, 50)),
        "ttft_p99_ms": float(np.percentile(ttfts, 99)),
        "tpot_p50_ms": float(np.percentile(tpots, 50)),
        "completed": sum(part["completed"] for part in parts),
        "failed": sum(part["failed"] for part in parts),
        "total_output_tokens": output_tokens,
        "duration_s": duration,
        "client_cpu_pct": 100 * client_cpu_s / duration,
    }


def run(count: int, server_args: list[str], workload: list[str], clients: int, out: Path) -> dict:
    server = ServerProcess("--api-server-count", str(count), *server_args, startup_timeout=600)
    try:
        pids = api_server_pids(server.process.pid, count)
        ticks = sum(cpu_ticks(pid) or 0 for pid in pids)
        result = bench_clients(server.base_url, out, f"api-servers-{count}", workload, clients)
        api_cpu_s = (sum(cpu_ticks(pid) or 0 for pid in pids) - ticks) / TICKS
        return {
            "api_server_count": count,
            "clients": clients,
            **result,
            "api_cpu_ms_per_output_token": 1000 * api_cpu_s / max(1, result["total_output_tokens"]),
            "api_cpu_pct": 100 * api_cpu_s / result["duration_s"],
        }
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--counts", default="1,2")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=192)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--range-ratio", type=float, default=0.0, help="lengths drawn in len x [1-r, 1+r]")
    parser.add_argument("--clients", type=int, default=1, help="bench processes sharing the concurrency")
    parser.add_argument("--tokenizer", default=None, help="the bench's tokenizer (default: the embedded model's)")
    parser.add_argument("server_args", nargs="*", help="more `heron serve` flags (after --)")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="heron-api-servers-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.concurrency % args.clients or args.num_prompts % args.clients:
        parser.error("--concurrency and --num-prompts must be multiples of --clients")
    workload = ["--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
                str(args.output_len), "--random-range-ratio", str(args.range_ratio),
                "--num-prompts", str(args.num_prompts // args.clients),
                "--max-concurrency", str(args.concurrency // args.clients), "--seed", "{seed}", "--ignore-eos",
                *(["--tokenizer", args.tokenizer] if args.tokenizer else [])]
    rows = [run(int(count), args.server_args, workload, args.clients, out) for count in args.counts.split(",")]
    (out / "results.json").write_text(json.dumps({"rows": rows, "workload": workload, "clients": args.clients,
                                                  "server_args": args.server_args}, indent=2))
    print("| API servers | output tok/s | TTFT p50 | TTFT p99 | TPOT p50 | API-server CPU per output token "
          "| API servers' CPU | bench clients' CPU |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['api_server_count']} | {row['output_throughput']:.1f} | {row['ttft_p50_ms']:.0f} ms | "
              f"{row['ttft_p99_ms']:.0f} ms | {row['tpot_p50_ms']:.1f} ms | "
              f"{row['api_cpu_ms_per_output_token']:.3f} ms | {row['api_cpu_pct']:.0f}% | "
              f"{row['client_cpu_pct']:.0f}% |")


if __name__ == "__main__":
    main()
