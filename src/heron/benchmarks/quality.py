"""``heron bench quality``: what a fast mode changes, measured on a fixed text.

Teacher-forced over the bundled passage (data/quality.txt), it reports the
perplexity of the text and, against a reference configuration (float32), the
fraction of positions where both pick the same next token (top-1 agreement),
plus the agreement of free-running greedy continuations of a few prompts.
"""

from __future__ import annotations

import math
from importlib import resources
from typing import Any

from heron.engine.llm import LLM
from heron.sampling_params import SamplingParams

GREEDY_PROMPTS = [
    "The grey heron stands at the edge of",
    "A scheduler decides, at every step,",
    "Memory is cut into small pages of",
    "Herons live on every continent except",
]


def quality_text() -> str:
    return resources.files("heron.benchmarks").joinpath("data/quality.txt").read_text(encoding="utf-8")


def teacher_forced(llm: LLM, text: str) -> tuple[float, list[int]]:
    """(perplexity, the top-1 token predicted at every position)."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0)
    [output] = llm.generate([text], params, use_tqdm=False)
    assert output.prompt_logprobs is not None
    logprobs = []
    top1 = []
    for token_id, entry in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]):
        assert entry is not None
        logprobs.append(entry[token_id].logprob)
        top1.append(next(tid for tid, lp in entry.items() if lp.rank == 1))
    return math.exp(-sum(logprobs) / len(logprobs)), top1


def greedy_runs(llm: LLM, max_tokens: int = 32) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(GREEDY_PROMPTS, params, use_tqdm=False)]


def compare(reference: LLM, candidate: LLM) -> dict[str, Any]:
    text = quality_text()
    ref_ppl, ref_top1 = teacher_forced(reference, text)
    ppl, top1 = teacher_forced(candidate, text)
    ref_greedy, greedy = greedy_runs(reference), greedy_runs(candidate)
    same_prefix = []
    for a, b in zip(ref_greedy, greedy):
        length = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same_prefix.append(length)
    return {
        "num_tokens": len(top1) + 1,
        "reference_perplexity": ref_ppl,
        "perplexity": ppl,
        "top1_agreement": sum(a == b for a, b in zip(ref_top1, top1)) / len(top1),
        "greedy_identical_prefix_tokens": same_prefix,
        "greedy_tokens_per_prompt": len(ref_greedy[0]),
    }
