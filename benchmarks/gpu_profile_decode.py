"""Where a decode step's time goes on the GPU: host phases vs device time.

    PYTHONPATH=src:. python3 benchmarks/gpu_profile_decode.py [--batch 1 64] [--max-num-seqs N] \\
        [--no-async-scheduling] [--kernels] [--sampled]

``--kernels`` also lists the GPU kernels of a step (CUPTI sees inside CUDA
graphs): how many run per step and which take the device's time.
"""

from __future__ import annotations

import argparse
import time

import torch
from benchmarks.gpu_bench import LLAMA_1B, build_model, random_prompts

from heron import LLM, SamplingParams
from heron.profiling import phase_times_ms


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", default="/tmp/llama-1b-random")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: the largest --batch")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--kernels", action="store_true", help="also profile the device kernels of a step")
    parser.add_argument("--sampled", action="store_true", help="temperature 0.8, top-p 0.95, top-k 50 (not greedy)")
    args = parser.parse_args()
    build_model(args.model_dir)
    llm = LLM(args.model_dir, dtype="bfloat16", max_model_len=2048, max_num_seqs=args.max_num_seqs or max(args.batch),
              async_scheduling=args.async_scheduling)
    engine = llm.engine
    for batch in args.batch:
        prompts = random_prompts(batch, 128, 128, LLAMA_1B["vocab_size"], seed=batch)
        sampling = dict(temperature=0.8, top_p=0.95, top_k=50) if args.sampled else dict(temperature=0)
        params = SamplingParams(**sampling, max_tokens=400, ignore_eos=True)
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
        table = phase_times_ms(engine.step, 30)
        print(f"batch {batch}: {per_step:.2f} ms per LLMEngine.step; host ms per phase: "
              + ", ".join(f"{name} {ms:.2f}" for name, ms in table.items()), flush=True)
        if args.kernels:
            print_kernels(engine, batch)
        for index in range(batch):
            engine.abort_request(f"p{batch}-{index}")


def print_kernels(engine, batch: int, steps: int = 20, top: int = 15) -> None:
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    # record_function ranges ("forward", "sample") also show on the device, as annotation
    # spans around their kernels: count kernels only
    kernels = [e for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.count > 0
               and not getattr(e, "is_user_annotation", False)]
    kernels.sort(key=lambda e: e.device_time_total, reverse=True)
    launches = sum(e.count for e in kernels) / steps
    device_ms = sum(e.device_time_total for e in kernels) / steps / 1000
    print(f"batch {batch}: {launches:.0f} kernels per step, {device_ms:.2f} ms of kernel time per step")
    for e in kernels[:top]:
        print(f"  {e.device_time_total / steps / 1000:7.3f} ms  {e.count / steps:6.1f}x  {e.key[:100]}")


if __name__ == "__main__":
    main()
