"""TTFT of a long prefix the pool cannot keep: recomputed, loaded from the host
offload tier or the disk tier, or found in a pool large enough to keep it; and
the first request after a restart, from the disk tier (issue 19).

For each mode a fresh `heron serve` of the embedded model: the long prompt is
sent once, then filler prompts that push it out of a small pool, then the long
prompt again with a new ending; the TTFT of that last request (streamed, to
the first token) is what each mode is about. Repeated with fresh endings,
median reported. The restart mode sends the long prompt to one server, stops
it, and times the first request (the prompt with a new ending) of a new server
on the same directory, once per round. Block files are then in the OS page
cache (written moments before): what a restart costs on a warm machine.

    python benchmarks/kv_offload_ttft.py --out benchmarks/results/kv-offload-cpu

Prints a markdown table and writes results.json into --out.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.e2e.server_process import ServerProcess  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
WORDS = ("heron egret curlew godwit avocet plover dunlin knot sanderling redshank mudflat saltmarsh estuary tide "
         "channel creek reed shallows lagoon shingle dune spit roost feeds probes wades").split()
MODES = {
    "recompute (small pool)": ["--kv-cache-memory-bytes", "110MiB"],
    "host tier (small pool + 1 GiB tier)": ["--kv-cache-memory-bytes", "110MiB", "--kv-offloading-size", "1"],
    "disk tier (small pool + --kv-offloading-dir)": ["--kv-cache-memory-bytes", "110MiB",
                                                      "--kv-offloading-dir", "{dir}"],
    "warm pool (large pool)": ["--kv-cache-memory-bytes", "1GiB"],
}
RESTART_MODE = "first request after a restart (disk tier)"


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def ttft(base_url: str, prompt: str) -> float:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}
    started = time.perf_counter()
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.perf_counter() - started
    raise RuntimeError("no token came back")


def run_mode(flags: list[str], prefix_words: int, rounds: int) -> dict:
    directory = tempfile.mkdtemp(prefix="heron-kv-disk-")
    server = ServerProcess("--max-model-len", "2048", *[flag.replace("{dir}", directory) for flag in flags])
    rng = random.Random(5)
    prefix = text(rng, prefix_words)
    fillers = [text(rng, prefix_words) for _ in range(2)]
    try:
        ttft(server.base_url, prefix + " first")
        times = []
        for round_index in range(rounds):
            for filler in fillers:
                ttft(server.base_url, filler + f" {round_index}")
            times.append(ttft(server.base_url, prefix + f" ending {round_index}"))
        tokens = httpx.post(f"{server.base_url}/tokenize", json={"model": MODEL, "prompt": prefix},
                            timeout=30).json().get("count")
        loaded = _metric(server, "heron:kv_offload_loaded_blocks_total")
        return {"ttft_p50_ms": 1000 * median(times), "ttft_all_ms": [1000 * t for t in times],
                "prefix_tokens": tokens, "tier_loaded_blocks": loaded,
                "prefix_cache_hits": _metric(server, "heron:prefix_cache_hits_total")}
    finally:
        server.stop()


def run_restarts(prefix_words: int, rounds: int) -> dict:
    directory = tempfile.mkdtemp(prefix="heron-kv-disk-")
    flags = ["--max-model-len", "2048", "--kv-offloading-dir", directory]
    prefix = text(random.Random(5), prefix_words)
    first = ServerProcess(*flags)
    try:
        ttft(first.base_url, prefix + " first")
    finally:
        first.stop()
    times, loaded = [], []
    for round_index in range(rounds):
        server = ServerProcess(*flags)
        try:
            times.append(ttft(server.base_url, prefix + f" ending {round_index}"))
            loaded.append(_metric(server, "heron:kv_offload_loaded_blocks_total"))
        finally:
            server.stop()
    return {"ttft_p50_ms": 1000 * median(times), "ttft_all_ms": [1000 * t for t in times],
            "tier_loaded_blocks": median(loaded), "prefix_tokens": None}


def _metric(server: ServerProcess, name: str) -> float:
    text_ = httpx.get(f"{server.base_url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text_.splitlines() if line.startswith(name + "{"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--prefix-words", type=int, default=1100, help="about 1,500 tokens")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="heron-kv-offload-"))
    out.mkdir(parents=True, exist_ok=True)
    rows = {mode: run_mode(flags, args.prefix_words, args.rounds) for mode, flags in MODES.items()}
    rows[RESTART_MODE] = run_restarts(args.prefix_words, args.rounds)
    (out / "results.json").write_text(json.dumps({"modes": rows, "flags": MODES,
                                                  "prefix_words": args.prefix_words}, indent=2))
    print("| mode | TTFT p50 | blocks loaded from the tier | prefix tokens |")
    print("|---|---|---|---|")
    for mode, row in rows.items():
        print(f"| {mode} | {row['ttft_p50_ms']:.0f} ms | {row['tier_loaded_blocks']:.0f} | {row['prefix_tokens']} |")


if __name__ == "__main__":
    main()
