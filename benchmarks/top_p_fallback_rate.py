"""How often top-p alone on the CPU must sort a row (its 1,024 largest logits
hold less than top_p), on the embedded model: random-token prompts (what
``bench serve``'s random dataset sends) and chat prompts, at two settings.

    PYTHONPATH=src python3 benchmarks/top_p_fallback_rate.py
"""

from __future__ import annotations

import random
from typing import Any

import heron.sample.top_k_top_p as top_k_top_p
from heron import LLM, SamplingParams

counts = {"rows": 0, "sorted": 0}
through_candidates, sort_rows = top_k_top_p._top_p_through_candidates, top_k_top_p._sorted_top_k_top_p


def counted_candidates(logits: Any, top_p: Any) -> Any:
    counts["rows"] += logits.shape[0]
    return through_candidates(logits, top_p)


def counted_sort(logits: Any, top_k: Any, top_p: Any) -> Any:
    counts["sorted"] += logits.shape[0]
    return sort_rows(logits, top_k, top_p)


def main() -> None:
    top_k_top_p._top_p_through_candidates = counted_candidates
    top_k_top_p._sorted_top_k_top_p = counted_sort
    llm = LLM()
    rng = random.Random(0)
    random_prompts = [{"prompt_token_ids": [rng.randrange(100, 49000) for _ in range(128)]} for _ in range(8)]
    questions = ["Write a short poem about the sea.", "Explain what a CPU cache is.", "Tell me a story about a fox.",
                 "What is the capital of France and why is it famous?"]
    chats = [[{"role": "user", "content": question}] for question in questions]
    for temperature, top_p in ((0.7, 0.9), (1.0, 0.95)):
        params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=128, ignore_eos=True)
        for name, run in (("random-token prompts", lambda p: llm.generate(random_prompts, p, use_tqdm=False)),
                          ("chat prompts", lambda p: llm.chat(chats, p, use_tqdm=False))):
            counts.update(rows=0, sorted=0)
            run(params)
            print(f"temperature {temperature}, top_p {top_p}, {name}: {counts['sorted']} of {counts['rows']} "
                  "rows sorted", flush=True)


if __name__ == "__main__":
    main()
