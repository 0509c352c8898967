"""The engine's host time per decode step, on the CPU, with a model so small
that the forward pass is a few dozen microseconds of torch ops: what is left is
scheduling, input preparation, sampling bookkeeping and output processing, the
Python work that on a GPU must hide behind the device's step (at batch 1 with
CUDA graphs it is the inter-token latency once the graph is fast).

    PYTHONPATH=src:. python3 benchmarks/host_overhead.py [--batch 1 8 64] [--async-scheduling] [--profile]

``--profile`` prints heron's functions by cumulative time (cProfile); ``--phases``
the host milliseconds per step of each engine phase (torch profiler ranges, far
less overhead than cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.gpu.conftest import word_tokenizer  # noqa: E402
from tests.model.conftest import build_tiny_model as save_tiny_model  # noqa: E402

from heron import LLM, SamplingParams  # noqa: E402
from heron.profiling import phase_times_ms  # noqa: E402
from heron.sampling_params import RequestOutputKind  # noqa: E402

# the tests' tiny Llama (64 wide), one layer, a 512-word vocabulary
TINY = dict(model_type="llama", vocab_size=512, num_hidden_layers=1, max_position_embeddings=4096)


def build_tiny_model(directory: str) -> None:
    if not os.path.exists(os.path.join(directory, "config.json")):
        save_tiny_model(directory, TINY, word_tokenizer(TINY["vocab_size"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--phases", action="store_true", help="milliseconds per step of each engine phase")
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "heron-host-overhead-model"))
    args = parser.parse_args()
    build_tiny_model(args.model_dir)
    llm = LLM(args.model_dir, dtype="float32", max_model_len=4096, max_num_seqs=max(args.batch),
              async_scheduling=args.async_scheduling)
    engine = llm.engine
    # as LLM.generate asks (the server asks DELTA or FINAL_ONLY too)
    params = SamplingParams(temperature=0, max_tokens=3 * args.steps + 100, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    prompt = list(range(3, 131))  # 128 tokens
    for batch in args.batch:
        for index in range(batch):
            engine.add_request(f"b{batch}-{index}", engine.input_processor.process_prompt(prompt), params)
        for _ in range(20):  # prefill, then a few decode steps
            engine.step()
        started = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        per_step_ms = (time.perf_counter() - started) / args.steps * 1000
        print(f"batch {batch:3d} (async scheduling {args.async_scheduling}): {per_step_ms:.3f} ms per LLMEngine.step",
              flush=True)
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.steps):
                engine.step()
            profiler.disable()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats("heron", 30)
        if args.phases:
            table = phase_times_ms(engine.step, args.steps)
            print("    ms per step: " + ", ".join(f"{name} {ms:.3f}" for name, ms in table.items()), flush=True)
        for index in range(batch):
            engine.abort_request(f"b{batch}-{index}")
        while engine.has_unfinished_requests():
            engine.step()


if __name__ == "__main__":
    main()
