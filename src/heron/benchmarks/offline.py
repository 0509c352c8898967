"""``heron bench throughput`` and ``heron bench latency``: offline, through ``LLM``."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import numpy as np
from tqdm import tqdm

from heron.benchmarks.datasets import SampleRequest, WordTokens
from heron.engine.llm import LLM
from heron.sampling_params import SamplingParams, StructuredOutputsParams


def run_throughput(
    llm: LLM,
    samples: list[SampleRequest],
    temperature: float = 1.0,
    use_tqdm: bool = True,
    structured_outputs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """All requests at once; returns vLLM's throughput fields. With
    ``structured_outputs`` every request is constrained by it (a request whose
    grammar terminates early stops there, so output totals may differ)."""
    params = [
        SamplingParams(
            temperature=temperature,
            top_p=1.0,
            ignore_eos=True,
            max_tokens=s.expected_output_len,
            structured_outputs=StructuredOutputsParams(**structured_outputs) if structured_outputs else None,
        )
        for s in samples
    ]
    started = time.perf_counter()
    outputs = llm.generate([s.prompt for s in samples], params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - started
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "elapsed_time": elapsed,
        "num_requests": len(samples),
        "total_num_tokens": prompt_tokens + output_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_second": len(samples) / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }


def format_throughput(result: dict[str, Any]) -> str:
    return (
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s "
        f"({result['num_requests']} requests, {result['total_output_tokens']} output tokens "
        f"in {result['elapsed_time']:.2f} s)"
    )


def run_latency(
    llm: LLM, batch_size: int, input_len: int, output_len: int, num_iters_warmup: int, num_iters: int,
    seed: int = 0, use_tqdm: bool = True,
) -> dict[str, Any]:
    """Time one fixed batch end to end, repeatedly."""
    rng = random.Random(seed)
    words = WordTokens(llm.get_tokenizer())
    prompts = [[rng.choice(words.word_ids) for _ in range(input_len)] for _ in range(batch_size)]
    params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len)

    def once() -> float:
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - started

    for _ in tqdm(range(num_iters_warmup), desc="warmup", disable=not use_tqdm):
        once()
    latencies = np.array([once() for _ in tqdm(range(num_iters), desc="iterations", disable=not use_tqdm)])
    percentiles = [10, 25, 50, 75, 90, 99]
    return {
        "batch_size": batch_size,
        "input_len": input_len,
        "output_len": output_len,
        "avg_latency": float(latencies.mean()),
        "latencies": latencies.tolist(),
        "percentiles": {str(p): float(np.percentile(latencies, p)) for p in percentiles},
    }


def format_latency(result: dict[str, Any]) -> str:
    lines = [
        f"Avg latency: {result['avg_latency']:.4f} s (batch {result['batch_size']}, "
        f"input {result['input_len']}, output {result['output_len']} tokens)"
    ]
    lines += [f"{p}% percentile latency: {value:.4f} s" for p, value in result["percentiles"].items()]
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: str | None) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=2)
