"""Where a CPU step's time goes, as cited in BENCHMARKS.md: milliseconds per
decode step (``LLMEngine.step``) at a batch size, a torch-profiler table of the
busiest ops over 20 steps, and the time (and busiest ops) of a prefill of
``--prefill-len`` tokens.

    python benchmarks/cpu_step_profile.py --quantization int4 [--batch 1] [--prefill-len 250]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from heron import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", default="int4", choices=["none", "int8", "int4"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prefill-len", type=int, default=250)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    llm = LLM(max_model_len=1024, quantization=args.quantization, enable_prefix_caching=False)
    rng = random.Random(0)

    # prefill: one request of --prefill-len random tokens, max_tokens=1 (best of 5 after a warm-up)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prefill_len)] for _ in range(6)]
    first = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(prompts[:1], first, use_tqdm=False)
    times = []
    for prompt in prompts[1:]:
        started = time.perf_counter()
        llm.generate([prompt], first, use_tqdm=False)
        times.append(time.perf_counter() - started)
    print(f"prefill of {args.prefill_len} tokens: {min(times) * 1000:.0f} ms (best of 5; all: "
          + ", ".join(f"{t * 1000:.0f}" for t in times) + ")")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        llm.generate(prompts[1:2], first, use_tqdm=False)
    print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))

    # decode: --batch requests decoding together
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.steps + 100, ignore_eos=True)
    for index in range(args.batch):
        prompt = engine.input_processor.process_prompt(f"Tell me story {index} about a dragon " * 5)
        engine.add_request(f"decode-{index}", prompt, params)
    for _ in range(10):  # prefill and warm up
        engine.step()
    started = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    print(f"decode step at batch {args.batch}: {(time.perf_counter() - started) / args.steps * 1000:.2f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for _ in range(20):
            engine.step()
    print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
