"""A prompt's prefill (max_tokens=1, the embedded model with heron's defaults) with
the last layer run for the sampled row alone (what the model runner does) against
every row, alternated in one process, with prefix caching off so every run
computes the whole prompt:

    PYTHONPATH=src python benchmarks/last_layer_rows_ab.py [PROMPT_TOKENS=250] [ROUNDS=20]
"""

from __future__ import annotations

import statistics
import sys
import time

from heron import LLM, SamplingParams
from heron.benchmarks.datasets import random_dataset


def main() -> None:
    prompt_tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 250
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    llm = LLM(enable_prefix_caching=False)
    runner = llm.engine.engine_core.model_runner
    sampled_rows_only = runner._output_rows
    prompt = random_dataset(llm.get_tokenizer(), 1, prompt_tokens, 1, 0.0, seed=3)[0].prompt
    params = SamplingParams(max_tokens=1, temperature=0)
    times: dict[str, list[float]] = {"all rows": [], "sampled rows": []}
    for index in range(rounds):
        for name in ("all rows", "sampled rows") if index % 2 else ("sampled rows", "all rows"):
            runner._output_rows = sampled_rows_only if name == "sampled rows" else (lambda step: None)
            start = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            times[name].append((time.perf_counter() - start) * 1000)
    for name, values in times.items():
        print(f"{name}: median {statistics.median(values):.1f} ms, min {min(values):.1f} ms ({rounds} runs)")


if __name__ == "__main__":
    main()
