"""A multi-turn chat workload against any OpenAI-compatible server: conversations
that start at a fixed rate, each resending its whole history with a new
question every turn (after a short think time), over a few shared system
prompts. Each turn's prompt is the last turn's prompt plus the reply and the
new question, so a server (or router) that keeps a conversation where its
history is cached prefills only the new part.

    python benchmarks/multi_turn.py --base-url http://127.0.0.1:8080

Prints TTFT p50/p99 (streamed, to the first content token), output tokens per
second and the number of turns completed; ``run_multi_turn`` returns them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from statistics import median

import httpx

MODEL = "SmolLM2-135M-Instruct"
_WORDS = ("heron egret curlew godwit avocet plover dunlin knot sanderling redshank greenshank whimbrel "
          "mudflat saltmarsh estuary tide channel creek reed shallows lagoon shingle dune spit roost "
          "feeds probes wades waits dives skims nests migrates winters gathers").split()


@dataclass
class Turns:
    ttft_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    failed: int = 0


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words)).capitalize() + "."


async def _conversation(client: httpx.AsyncClient, base_url: str, name: str, system: str, user: str, turns: int,
                        max_tokens: int, think_s: float, rng: random.Random, results: Turns) -> None:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    for turn in range(turns):
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                "user": name}
        started = time.perf_counter()
        first: float | None = None
        reply: list[str] = []
        try:
            async with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    results.failed += 1
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        results.output_tokens += chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices", []):
                        piece = choice.get("delta", {}).get("content")
                        if piece:
                            if first is None:
                                first = time.perf_counter() - started
                            reply.append(piece)
        except httpx.HTTPError:
            results.failed += 1
            return
        if first is not None:
            results.ttft_s.append(first)
        messages += [{"role": "assistant", "content": "".join(reply)},
                     {"role": "user", "content": f"And {_text(rng, 6)} (turn {turn + 2})"}]
        await asyncio.sleep(think_s)


async def run_multi_turn(base_url: str, conversations: int = 16, turns: int = 4, rate: float = 0.5,
                         system_words: int = 220, num_systems: int = 4, max_tokens: int = 24,
                         think_s: float = 0.5, seed: int = 1) -> dict:
    """Conversations start ``rate`` per second; returns the workload's figures."""
    rng = random.Random(seed)
    systems = [f"You are guide number {index} to estuary birds. " + _text(rng, system_words)
               for index in range(num_systems)]
    results = Turns()
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=httpx.Limits(max_connections=None)) as client:
        tasks = []
        for index in range(conversations):
            await asyncio.sleep(max(0.0, started + index / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(_conversation(
                client, base_url, f"conversation-{index}", systems[index % num_systems],
                f"Question {index}: {_text(rng, 12)}", turns,
                max_tokens, think_s, random.Random(seed * 1000 + index), results)))
        await asyncio.gather(*tasks)
    duration = time.perf_counter() - started
    ttft = sorted(results.ttft_s)
    return {"turns_completed": len(ttft), "turns_failed": results.failed,
            "ttft_p50_ms": 1000 * median(ttft) if ttft else None,
            "ttft_p99_ms": 1000 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else None,
            "output_throughput": results.output_tokens / duration, "duration_s": duration}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--rate", type=float, default=0.5, help="conversations started per second")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run_multi_turn(args.base_url, args.conversations, args.turns, args.rate)), indent=2))


if __name__ == "__main__":
    main()
