"""Tail latency under mixed load: while N streams decode, a long prompt arrives;
how long do the running streams stall?

    python benchmarks/tail_latency.py --base-url http://127.0.0.1:8000 [--streams 4] [--prompt-tokens 1500]

Prints the streams' inter-token gaps before the long prompt arrives and while it
is being prefilled (the per-step token budget should bound the latter), and the
long prompt's time to first token, as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

from heron.benchmarks.datasets import WordTokens
from heron.loader.model_source import default_model_path
from heron.loader.tokenizer import load_gguf_tokenizer


async def stream(client: httpx.AsyncClient, url: str, body: dict, arrivals: list[float]) -> None:
    async with client.stream("POST", url, json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter())


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--decode-tokens", type=int, default=160)
    args = parser.parse_args()
    import random

    words = WordTokens(load_gguf_tokenizer(default_model_path()))
    rng = random.Random(0)
    url = args.base_url.rstrip("/") + "/v1/completions"
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(args.base_url.rstrip("/") + "/v1/models")).json()["data"][0]["id"]
        base = {"model": model, "temperature": 0, "stream": True, "ignore_eos": True}
        arrivals: list[list[float]] = [[] for _ in range(args.streams)]
        decoders = [
            asyncio.create_task(stream(client, url, {**base, "prompt": words.text_of_length(32, rng),
                                                     "max_tokens": args.decode_tokens}, arrivals[i]))
            for i in range(args.streams)
        ]
        while min(len(a) for a in arrivals) < 20:
            await asyncio.sleep(0.05)
        injected = time.perf_counter()
        long_arrivals: list[float] = []
        await stream(client, url, {**base, "prompt": words.text_of_length(args.prompt_tokens, rng), "max_tokens": 1},
                     long_arrivals)
        prefilled = long_arrivals[0]
        await asyncio.gather(*decoders)
    before, during = [], []
    for times in arrivals:
        for previous, current in zip(times, times[1:]):
            gap = current - previous
            if current <= injected:
                before.append(gap)
            elif previous <= prefilled:
                during.append(gap)
    print(json.dumps({
        "streams": args.streams,
        "long_prompt_tokens": args.prompt_tokens,
        "long_prompt_ttft_s": prefilled - injected,
        "itl_before_median_ms": statistics.median(before) * 1000,
        "itl_during_prefill_max_ms": max(during) * 1000 if during else None,
        "itl_during_prefill_median_ms": statistics.median(during) * 1000 if during else None,
    }, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
