"""Single-stream decode speed with and without speculative decoding.

Two workloads on the embedded model (greedy, one request at a time, the chat
template applied):

* ``copy``: "repeat / edit this text" requests whose answer copies the input,
  where n-gram drafts match often;
* ``free``: open-ended questions whose answers rarely repeat the prompt.

For each it reports decode tokens/s (output tokens after the first / time from
the first token to the last), the draft acceptance rate, and whether the greedy
tokens equal the run without speculation.

    python benchmarks/spec_decode_bench.py --speculative-config \\
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}' [--quantization int8]
    python benchmarks/spec_decode_bench.py --speculative-config \\
        '{"method": "draft_model", "model": "embedded", "quantization": "int8", "num_speculative_tokens": 3}'
"""

from __future__ import annotations

import argparse
import json
import time

from heron import LLM, SamplingParams

PASSAGES = [
    "The Industrial Revolution began in Great Britain in the late eighteenth century. Steam engines, "
    "powered by coal, drove new machines in textile mills, and railways soon connected the growing cities. "
    "Workers moved from farms to factories, and the pace of daily life changed for ever.",
    "To make a simple tomato sauce, warm two tablespoons of olive oil in a pan, add one chopped onion and cook "
    "it slowly until soft. Stir in two cloves of garlic, a tin of chopped tomatoes and a pinch of salt, then "
    "simmer for twenty minutes and finish with fresh basil.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make glucose "
    "and oxygen. It takes place in the chloroplasts, which contain the green pigment chlorophyll.",
]
COPY = [
    "Repeat the following text exactly, word for word:\n\n" + PASSAGES[0],
    "Copy this recipe exactly as written:\n\n" + PASSAGES[1],
    "Rewrite this code, renaming the function fibonacci to fib and keeping everything else the same:\n\n" + PASSAGES[2],
    "Repeat this paragraph exactly:\n\n" + PASSAGES[3],
]
FREE = [
    "Write a short poem about the autumn wind.",
    "What are three good habits for staying healthy?",
    "Explain why the sky is blue in simple words.",
    "Tell me a short story about a lost kitten.",
]


def run(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Decode tokens/s over the prompts run one by one, and their tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    decode_tokens, decode_time, tokens = 0, 0.0, []
    for prompt in prompts:
        messages = [{"role": "user", "content": prompt}]
        llm.chat([messages], params, use_tqdm=False)  # warm: the prefix cache holds the prompt
        started = time.perf_counter()
        llm.chat([messages], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        first_token = time.perf_counter() - started  # (prefix-cached) time to the first token
        started = time.perf_counter()
        output = llm.chat([messages], params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - started
        count = len(output.outputs[0].token_ids)
        decode_tokens += count - 1
        decode_time += elapsed - first_token
        tokens.append(output.outputs[0].token_ids)
    return decode_tokens / decode_time, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--speculative-config", type=json.loads, required=True)
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if args.speculative_config.get("model") == "embedded":  # the default model as its own (e.g. int8) draft
        from heron.loader.model_source import default_model_path

        args.speculative_config["model"] = default_model_path()
    results = {}
    base = LLM(max_model_len=1024, quantization=args.quantization)
    baseline = {name: run(base, prompts, args.max_tokens) for name, prompts in (("copy", COPY), ("free", FREE))}
    del base
    spec = LLM(max_model_len=1024, quantization=args.quantization, speculative_config=args.speculative_config)
    for name, prompts in (("copy", COPY), ("free", FREE)):
        counters = spec.engine.engine_core.scheduler.spec_stats
        before = (counters.num_draft_tokens, counters.num_accepted_tokens)
        rate, tokens = run(spec, prompts, args.max_tokens)
        drafted = counters.num_draft_tokens - before[0]
        accepted = counters.num_accepted_tokens - before[1]
        base_rate, base_tokens = baseline[name]
        results[name] = {
            "baseline_decode_tok_s": round(base_rate, 2),
            "spec_decode_tok_s": round(rate, 2),
            "speedup": round(rate / base_rate, 3),
            "draft_tokens": drafted,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            "identical_to_baseline": tokens == base_tokens,
        }
        print(f"{name}: {base_rate:.1f} -> {rate:.1f} tok/s ({rate / base_rate:.2f}x), "
              f"acceptance {results[name]['acceptance_rate']}, identical {tokens == base_tokens}")
    results["config"] = {"speculative_config": args.speculative_config, "quantization": args.quantization,
                         "max_tokens": args.max_tokens}
    if args.output_json:
        with open(args.output_json, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
