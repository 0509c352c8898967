"""Decode-step time of the default (int4) engine with a float16 against a float32
KV cache, as cited in BENCHMARKS.md: --batch requests of --context random prompt
tokens decode together; after 40 warm-up steps, five runs of 10 steps each.

    python benchmarks/kv_cache_dtype_step.py --kv-cache-dtype float32 [--batch 32] [--context 300]

Run the two dtypes alternately, in separate processes, several times: the
machines here move by tens of percent between processes.
"""

from __future__ import annotations

import argparse
import random
import time

from heron import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=300)
    args = parser.parse_args()
    llm = LLM(max_model_len=1024, kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=False)
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for index in range(args.batch):
        prompt = [rng.randrange(100, 40000) for _ in range(args.context)]
        engine.add_request(f"r{index}", engine.input_processor.process_prompt(prompt), params)
    for _ in range(40):  # prefills, then warm decode steps
        engine.step()
    times = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(10):
            engine.step()
        times.append((time.perf_counter() - started) / 10 * 1000)
    print(f"kv_cache_dtype={args.kv_cache_dtype} batch={args.batch} context={args.context}: step ms "
          + " ".join(f"{t:.1f}" for t in times) + f" (best {min(times):.1f})")


if __name__ == "__main__":
    main()
