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
    # a GPU, the random-weight Llama-3.2-1B shape of gpu_bench.py (its tokenizer knows the words w3 ... wN)
    python benchmarks/kv_offload_ttft.py --word-vocabulary 4000 --prefix-words 1500 \
        --server-args "--model /tmp/llama-1b-random --dtype bfloat16 --enforce-eager --max-num-seqs 16"

Prints a markdown table and writes results.json into --out.
"""

from __future__ import annotations

import argparse
import functools
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

WORDS = ("heron egret curlew godwit avocet plover dunlin knot sanderling redshank mudflat saltmarsh estuary tide "
         "channel creek reed shallows lagoon shingle dune spit roost feeds probes wades").split()


def modes(pool: str, tier_gib: str, warm_pool: str) -> dict[str, list[str]]:
    """Each mode's `heron serve` flags: a pool too small to keep the prefix
    (``pool``) alone or with a tier in front, or one that keeps it (``warm_pool``)."""
    return {
        "recompute (small pool)": ["--kv-cache-memory-bytes", pool],
        f"host tier (small pool + {tier_gib} GiB tier)": ["--kv-cache-memory-bytes", pool,
                                                          "--kv-offloading-size", tier_gib],
        "disk tier (small pool + --kv-offloading-dir)": ["--kv-cache-memory-bytes", pool,
                                                          "--kv-offloading-dir", "{dir}"],
        "warm pool (large pool)": ["--kv-cache-memory-bytes", warm_pool],
    }


RESTART_MODE = "first request after a restart (disk tier)"


def text(rng: random.Random, words: int, vocabulary: list[str]) -> str:
    return " ".join(rng.choice(vocabulary) for _ in range(words))


@functools.cache
def served_model(base_url: str) -> str:
    return httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]


def ttft(base_url: str, prompt: str) -> float:
    body = {"model": served_model(base_url), "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}
    started = time.perf_counter()
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.perf_counter() - started
    raise RuntimeError("no token came back")


def run_mode(flags: list[str], prefix_words: int, rounds: int, server_args: list[str], vocabulary: list[str]) -> dict:
    directory = tempfile.mkdtemp(prefix="heron-kv-disk-")
    server = ServerProcess(*server_args, *[flag.replace("{dir}", directory) for flag in flags])
    rng = random.Random(5)
    prefix = text(rng, prefix_words, vocabulary)
    fillers = [text(rng, prefix_words, vocabulary) for _ in range(2)]
    try:
        ttft(server.base_url, prefix + " first")
        times = []
        for round_index in range(rounds):
            for filler in fillers:
                ttft(server.base_url, filler + f" {round_index}")
            times.append(ttft(server.base_url, prefix + f" ending {round_index}"))
        tokens = httpx.post(f"{server.base_url}/tokenize", json={"model": served_model(server.base_url),
                                                                 "prompt": prefix},
                            timeout=30).json().get("count")
        loaded = _metric(server, "heron:kv_offload_loaded_blocks_total")
        return {"ttft_p50_ms": 1000 * median(times), "ttft_all_ms": [1000 * t for t in times],
                "prefix_tokens": tokens, "tier_loaded_blocks": loaded,
                "prefix_cache_hits": _metric(server, "heron:prefix_cache_hits_total")}
    finally:
        server.stop()


def run_restarts(prefix_words: int, rounds: int, server_args: list[str], vocabulary: list[str]) -> dict:
    directory = tempfile.mkdtemp(prefix="heron-kv-disk-")
    flags = [*server_args, "--kv-offloading-dir", directory]
    prefix = text(random.Random(5), prefix_words, vocabulary)
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
    parser.add_argument("--server-args", default="", help="more `heron serve` flags for every server")
    parser.add_argument("--max-model-len", default="2048")
    parser.add_argument("--pool", default="110MiB", help="the small pool: one request fits, the prefix is pushed out")
    parser.add_argument("--tier-size", default="1", help="GiB of host tier")
    parser.add_argument("--warm-pool", default="1GiB", help="a pool that keeps the prefix")
    parser.add_argument("--word-vocabulary", type=int, default=0,
                        help="prompts of the words w3 ... wN (a word-level test tokenizer) instead of English")
    args = parser.parse_args()
    vocabulary = [f"w{i}" for i in range(3, args.word_vocabulary)] if args.word_vocabulary else WORDS
    server_args = ["--max-model-len", args.max_model_len, *args.server_args.split()]
    flags = modes(args.pool, args.tier_size, args.warm_pool)
    out = Path(args.out or tempfile.mkdtemp(prefix="heron-kv-offload-"))
    out.mkdir(parents=True, exist_ok=True)
    rows = {mode: run_mode(mode_flags, args.prefix_words, args.rounds, server_args, vocabulary)
            for mode, mode_flags in flags.items()}
    rows[RESTART_MODE] = run_restarts(args.prefix_words, args.rounds, server_args, vocabulary)
    (out / "results.json").write_text(json.dumps({"modes": rows, "flags": flags, "server_args": server_args,
                                                  "prefix_words": args.prefix_words}, indent=2))
    print("| mode | TTFT p50 | blocks loaded from the tier | prefix tokens |")
    print("|---|---|---|---|")
    for mode, row in rows.items():
        print(f"| {mode} | {row['ttft_p50_ms']:.0f} ms | {row['tier_loaded_blocks']:.0f} | {row['prefix_tokens']} |")


if __name__ == "__main__":
    main()
