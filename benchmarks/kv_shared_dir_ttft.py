"""The disk KV tier on a directory elsewhere: a local disk against a network
file system (issue 19). For each place, two figures, TTFT of a long prompt
with a new ending (streamed, to the first token), median of --rounds:

- "restart": the prompt was sent to a server that then stopped; the first
  request of a new server on the same directory;
- "other replica": two servers run at once on the same directory, each
  through its own path to it (two mounts of one export stand for two hosts);
  the prompt goes to the first, then, with a new ending, to the second while
  the second streams another completion: the longest gap between that
  stream's tokens while the prompt is looked up and loaded is reported beside
  the median gap before it.

A place is ``LABEL=PATH`` or ``LABEL=PATH:OTHER_PATH`` (OTHER_PATH: the same
directory as the second server sees it; PATH for both when absent). Each
round uses a fresh sub-directory, so nothing is in the tier but this prompt.
Also reported: the TTFT of the prompt with no tier (recomputed), and the
blocks the second server loaded from the tier.

    python benchmarks/kv_shared_dir_ttft.py --place local=/var/tmp/kv \\
        --place sshfs=/mnt/a:/mnt/b --out benchmarks/results/kv-shared-dir
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from statistics import median

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kv_offload_ttft import MODEL, _metric, text, ttft  # noqa: E402
from tests.e2e.server_process import ServerProcess  # noqa: E402

LOADED = "heron:kv_offload_loaded_blocks_total"


def parse_place(spec: str) -> tuple[str, Path, Path]:
    label, _, paths = spec.partition("=")
    first, _, second = paths.partition(":")
    if not label or not first:
        raise SystemExit(f"--place {spec!r}: expected LABEL=PATH or LABEL=PATH:OTHER_PATH")
    return label, Path(first), Path(second or first)


def fresh_subdir(first: Path, second: Path) -> tuple[str, str]:
    name = f"heron-kv-{uuid.uuid4().hex[:8]}"
    (first / name).mkdir()
    return str(first / name), str(second / name)


def restart_round(first: Path, second: Path, prompt: str, ending: str) -> tuple[float, float, dict]:
    directory, _ = fresh_subdir(first, second)
    writer = ServerProcess("--max-model-len", "2048", "--kv-offloading-dir", directory)
    try:
        ttft(writer.base_url, prompt + " first")
    finally:
        writer.stop()
    reader = ServerProcess("--max-model-len", "2048", "--kv-offloading-dir", directory)
    try:
        return ttft(reader.base_url, prompt + ending), _metric(reader, LOADED), {}
    finally:
        reader.stop()


class TokenTimes(threading.Thread):
    """A long streamed completion's token arrival times (the reader's other work)."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.times: list[float] = []
        self.started_streaming = threading.Event()

    def run(self) -> None:
        body = {"model": MODEL, "prompt": "Tell me about herons.", "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{self.base_url}/v1/completions", json=body, timeout=300) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    self.times.append(time.perf_counter())
                    if len(self.times) == 20:
                        self.started_streaming.set()

    def gaps_ms(self, start: float, end: float) -> list[float]:
        return [1000 * (later - earlier) for earlier, later in zip(self.times, self.times[1:])
                if start <= later and earlier <= end]


def other_replica_round(first: Path, second: Path, prompt: str, ending: str) -> tuple[float, float, dict]:
    """Also the reader's inter-token gaps of a streamed completion while the
    prompt arrives (the lookup and load of the prompt's blocks must not stall it)."""
    first_dir, second_dir = fresh_subdir(first, second)
    writer = ServerProcess("--max-model-len", "2048", "--kv-offloading-dir", first_dir)
    reader = ServerProcess("--max-model-len", "2048", "--kv-offloading-dir", second_dir)
    try:
        ttft(writer.base_url, prompt + " first")
        stream = TokenTimes(reader.base_url)
        stream.start()
        stream.started_streaming.wait(120)
        sent = time.perf_counter()
        seconds = ttft(reader.base_url, prompt + ending)
        stream.join(300)
        during = stream.gaps_ms(sent, sent + seconds)
        before = stream.gaps_ms(0.0, sent)
        return seconds, _metric(reader, LOADED), {"max_gap_ms_during": max(during, default=0.0),
                                                  "median_gap_ms_before": median(before)}
    finally:
        writer.stop()
        reader.stop()


def recompute_rounds(prompt: str, rounds: int) -> list[float]:
    server = ServerProcess("--max-model-len", "2048")
    try:
        ttft(server.base_url, "warm up " + text(random.Random(1), 50))
        return [ttft(server.base_url, f"{index} " + prompt) for index in range(rounds)]  # a new first block each
    finally:
        server.stop()


def summary(times: list[float], loaded: list[float]) -> dict:
    return {"ttft_p50_ms": 1000 * median(times), "ttft_all_ms": [round(1000 * t, 1) for t in times],
            "tier_loaded_blocks": loaded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--place", action="append", required=True, help="LABEL=PATH[:OTHER_PATH]")
    parser.add_argument("--out", default=None)
    parser.add_argument("--prefix-words", type=int, default=1100, help="about 1,500 tokens")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="heron-kv-shared-dir-"))
    out.mkdir(parents=True, exist_ok=True)
    prompt = text(random.Random(5), args.prefix_words)
    rows: dict[str, dict] = {"no tier (recomputed)": summary(recompute_rounds(prompt, args.rounds), [])}
    places = [parse_place(spec) for spec in args.place]
    for round_index in range(args.rounds):  # places alternate within each round
        for label, first, second in places:
            for kind, run_round in (("restart", restart_round), ("other replica", other_replica_round)):
                started = time.perf_counter()
                seconds, loaded, gaps = run_round(first, second, prompt, f" ending {round_index}")
                row = rows.setdefault(f"{kind}, {label}", {"times": [], "loaded": [], "gaps": []})
                row["times"].append(seconds)
                row["loaded"].append(loaded)
                row["gaps"].append(gaps)
                print(f"round {round_index} {kind}, {label}: {1000 * seconds:.0f} ms, {loaded:.0f} blocks, "
                      f"{gaps} ({time.perf_counter() - started:.0f} s)", flush=True)
    for name, row in rows.items():
        if "times" in row:
            rows[name] = {**summary(row["times"], row["loaded"]), "stream_gaps": row["gaps"]}
    (out / "results.json").write_text(json.dumps({"rows": rows, "places": args.place,
                                                  "prefix_words": args.prefix_words}, indent=2))
    print("| case | TTFT p50 | each round | blocks loaded from the tier | another stream's longest gap meanwhile |")
    print("|---|---|---|---|---|")
    for name, row in rows.items():
        loaded = ", ".join(f"{value:.0f}" for value in row["tier_loaded_blocks"]) or "-"
        each = ", ".join(f"{value:.0f}" for value in row["ttft_all_ms"])
        gaps = ", ".join(f"{gap['max_gap_ms_during']:.0f} (median {gap['median_gap_ms_before']:.0f})"
                         for gap in row.get("stream_gaps", []) if gap) or "-"
        print(f"| {name} | {row['ttft_p50_ms']:.0f} ms | {each} | {loaded} | {gaps} |")


if __name__ == "__main__":
    main()
