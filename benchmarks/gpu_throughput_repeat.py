"""How much gpu_bench.py's offline throughput figure moves on one engine: the
same 256-request workload again and again on one LLM, and again after each of
gpu_bench's decode-latency runs (each of which empties the prefix cache).

    PYTHONPATH=src:. python3 benchmarks/gpu_throughput_repeat.py

A run straight after another one finds its prompts in the prefix cache (no
prefill); one after a decode-latency run does not.
"""

from __future__ import annotations

import gc

from benchmarks.gpu_bench import build_model, decode_itl, heron_throughput

from heron import LLM


def main() -> None:
    build_model("/tmp/llama-1b-random")
    llm = LLM("/tmp/llama-1b-random", dtype="bfloat16", max_model_len=2048, max_num_seqs=256)

    def throughput(tag: str) -> None:
        result = heron_throughput(llm)
        print(f"{tag:28s} {result['output_tok_per_s']:8.0f} tok/s  gc counts {gc.get_count()}", flush=True)

    throughput("fresh 1")
    throughput("fresh 2")
    print("itl batch 1 ms", decode_itl(llm, 1) * 1000)
    throughput("after itl batch 1")
    print("itl batch 64 ms", decode_itl(llm, 64) * 1000)
    throughput("after itl batch 64")
    print("sampled ms", decode_itl(llm, 64, temperature=0.8, top_p=0.95, top_k=50) * 1000)
    throughput("after sampled 64")
    throughput("after sampled 64 again")
    print("ctx1700 ms", decode_itl(llm, 1, prompt_len=1700, steps=128) * 1000)
    throughput("after ctx1700")
    gc.collect()
    throughput("after gc.collect")


if __name__ == "__main__":
    main()
