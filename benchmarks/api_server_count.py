"""`heron serve --api-server-count M` side by side: the same workload through
one, two, ... API-server processes on one port (issue 18).

For each M: a fresh server with the given flags, then `heron bench serve` at a
fixed concurrency; reported per M: output throughput, TTFT p50/p99, TPOT p50,
and the CPU time the API-server processes used per output token (the
launcher's children other than the engine cores).

    python benchmarks/api_server_count.py --counts 1,2 --out benchmarks/results/api-servers-cpu
    python benchmarks/api_server_count.py --counts 1,2,4 --concurrency 128 -- --model DIR --device cuda

Prints a markdown table and writes results.json into --out. Linux (reads /proc).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.process_cpu import cpu_ticks  # noqa: E402
from benchmarks.router_policies import bench  # noqa: E402
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


def run(count: int, server_args: list[str], workload: list[str], out: Path) -> dict:
    server = ServerProcess("--api-server-count", str(count), *server_args)
    try:
        pids = api_server_pids(server.process.pid, count)
        ticks = sum(cpu_ticks(pid) or 0 for pid in pids)
        result = bench(server.base_url, out, f"api-servers-{count}", workload)
        api_cpu_s = (sum(cpu_ticks(pid) or 0 for pid in pids) - ticks) / TICKS
        return {
            "api_server_count": count,
            "output_throughput": result["output_throughput"],
            "ttft_p50_ms": result["median_ttft_ms"],
            "ttft_p99_ms": result["p99_ttft_ms"],
            "tpot_p50_ms": result["median_tpot_ms"],
            "completed": result["completed"],
            "api_cpu_ms_per_output_token": 1000 * api_cpu_s / max(1, result["total_output_tokens"]),
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
    parser.add_argument("server_args", nargs="*", help="more `heron serve` flags (after --)")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="heron-api-servers-"))
    out.mkdir(parents=True, exist_ok=True)
    workload = ["--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
                str(args.output_len), "--num-prompts", str(args.num_prompts), "--max-concurrency",
                str(args.concurrency), "--seed", "1", "--ignore-eos"]
    rows = [run(int(count), args.server_args, workload, out) for count in args.counts.split(",")]
    (out / "results.json").write_text(json.dumps({"rows": rows, "workload": workload,
                                                  "server_args": args.server_args}, indent=2))
    print("| API servers | output tok/s | TTFT p50 | TTFT p99 | TPOT p50 | API-server CPU per output token |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['api_server_count']} | {row['output_throughput']:.1f} | {row['ttft_p50_ms']:.0f} ms | "
              f"{row['ttft_p99_ms']:.0f} ms | {row['tpot_p50_ms']:.1f} ms | "
              f"{row['api_cpu_ms_per_output_token']:.3f} ms |")


if __name__ == "__main__":
    main()
