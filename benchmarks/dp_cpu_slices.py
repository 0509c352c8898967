"""`heron serve --data-parallel-size 2` on one host: each engine core on a slice
of the CPUs of its own (heron's default, engine/cpu_slices.py) against every
engine core on every CPU (what heron did before: set here by OMP_NUM_THREADS
to the CPU count, which also turns the slicing off), and one engine core for
scale. Each configuration is a fresh server on the embedded model (started as
the tests start one: tests/e2e/server_process.py, a 256 MiB KV pool), measured by
``heron bench serve`` (random prompts of 128 tokens, 64 output tokens, 48
prompts at concurrency 8 after 4 warm-ups), the configurations interleaved.

    python benchmarks/dp_cpu_slices.py [--rounds 2] [--port 31900] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.e2e.server_process import ServerProcess  # noqa: E402

CONFIGS = {
    "dp2-slices": (["--data-parallel-size", "2"], {}),
    "dp2-every-cpu": (["--data-parallel-size", "2"], {"OMP_NUM_THREADS": str(len(os.sched_getaffinity(0)))}),
    "dp1": ([], {}),
}
FIELDS = ("output_throughput", "median_ttft_ms", "median_tpot_ms")


def serve_and_bench(flags: list[str], env: dict[str, str], port: int, result: str) -> dict[str, float]:
    # a variable this process has (a user's OMP_NUM_THREADS) would turn the slicing off: only the run's own apply
    os.environ.pop("OMP_NUM_THREADS", None)
    server = ServerProcess(*flags, env=env, port=port)
    try:
        subprocess.run([sys.executable, "-m", "heron.entrypoints.cli", "bench", "serve", "--base-url", server.base_url,
                        "--dataset-name", "random", "--num-prompts", "48", "--random-input-len", "128",
                        "--random-output-len", "64", "--max-concurrency", "8", "--ignore-eos", "--num-warmups", "4",
                        "--save-result", "--result-filename", result], check=True, capture_output=True)
        Path(result + ".log").write_text(server.read_log())
    finally:
        server.stop()
    with open(result) as handle:
        figures = json.load(handle)
    return {field: round(figures[field], 2) for field in FIELDS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=31900)
    parser.add_argument("--out", default="dp-cpu-slices")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for round_number in range(args.rounds):
        for name, (flags, env) in CONFIGS.items():
            figures = serve_and_bench(flags, env, args.port, os.path.join(args.out, f"{name}-{round_number}.json"))
            print(round_number, name, figures, flush=True)


if __name__ == "__main__":
    main()
