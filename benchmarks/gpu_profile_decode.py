"""Where a decode step's time goes on the GPU: host phases vs device time.

    PYTHONPATH=src:. python3 benchmarks/gpu_profile_decode.py [--batch 1 64] [--no-async-scheduling]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.gpu_bench import LLAMA_1B, build_model, random_prompts
from heron import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", default="/tmp/llama-1b-random")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    build_model(args.model_dir)
    llm = LLM(args.model_dir, dtype="bfloat16", max_model_len=2048, max_num_seqs=64,
              async_scheduling=args.async_scheduling)
    engine = llm.engine
    for batch in args.batch:
        prompts = random_prompts(batch, 128, 128, LLAMA_1B["vocab_size"], seed=batch)
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        for index, prompt in enumerate(prompts):
            engine.add_request(f"p{batch}-{index}", engine.input_processor.process_prompt(prompt), params)
        for _ in range(20):
            engine.step()
        torch.cuda.synchronize()
        started = time.perf_counter()
        steps = 100
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        per_step = (time.perf_counter() - started) / steps * 1000
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(30):
                engine.step()
        names = ("schedule", "prepare_inputs", "forward", "sample", "wait_for_output", "update_from_output")
        table = {e.key: e.cpu_time_total / 30 / 1000 for e in prof.key_averages() if e.key in names}
        print(f"batch {batch}: {per_step:.2f} ms per LLMEngine.step; host ms per phase: "
              + ", ".join(f"{k} {table.get(k, 0):.2f}" for k in names), flush=True)
        for index in range(batch):
            engine.abort_request(f"p{batch}-{index}")


if __name__ == "__main__":
    main()
