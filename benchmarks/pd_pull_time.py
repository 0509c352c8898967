"""How long a decode engine takes to its first token when a long prompt's KV is
pulled from a prefill engine (prefill/decode disaggregation, issue 19), both
engines in this process on the embedded model, as cited in BENCHMARKS.md:

    python benchmarks/pd_pull_time.py --label new [--prompt-tokens 1500] [--repeats 6]

Each repeat prefills a fresh random prompt on the prefill engine (one token,
blocks kept for the decode engine), then times the decode engine's one-token
request that pulls them. Compare trees by running this script from each
(PYTHONPATH=<worktree>/src), alternated: the machines here move by tens of
percent between processes.
"""

from __future__ import annotations

import argparse
import random
import time

from heron import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    max_model_len = args.prompt_tokens + 64
    prefill = LLM(max_model_len=max_model_len, kv_transfer_config={"kv_role": "kv_producer"})
    decode = LLM(max_model_len=max_model_len, kv_transfer_config={"kv_role": "kv_consumer"})
    rng = random.Random(3)
    keep = SamplingParams(max_tokens=1, temperature=0, kv_transfer_params={"do_remote_decode": True})
    times = []
    for _ in range(args.repeats):
        prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)]
        prefilled, = prefill.generate([{"prompt_token_ids": prompt}], keep, use_tqdm=False)
        pull = SamplingParams(max_tokens=1, temperature=0, kv_transfer_params=prefilled.kv_transfer_params)
        started = time.perf_counter()
        decoded, = decode.generate([{"prompt_token_ids": prompt}], pull, use_tqdm=False)
        times.append((time.perf_counter() - started) * 1000)
        assert decoded.num_cached_tokens >= args.prompt_tokens - 16, "the prompt was computed, not pulled"
    ordered = sorted(times)
    print(f"{args.label} {args.prompt_tokens}-token prompt pulled, first token ms: "
          + " ".join(f"{t:.0f}" for t in times) + f" (median {ordered[len(ordered) // 2]:.0f})")


if __name__ == "__main__":
    main()
