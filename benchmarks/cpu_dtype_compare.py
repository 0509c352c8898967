"""Unquantized float32 against bfloat16 on this CPU, offline, side by side in
one process: what ``--dtype auto`` should pick for ``--quantization none``.

"auto" picks bf16 where the CPU has AVX512-BF16 or AMX (config.cpu_has_native_bf16)
and float32 elsewhere; run this on such a CPU to check that bf16 is the faster
there (on an AVX2-only CPU bf16 GEMMs are emulated and measured ~6x slower).

    python benchmarks/cpu_dtype_compare.py [--model PATH] [--requests 32] [--output-len 64]

Prints one JSON object: the CPU (model name and flags), and per dtype the
batch-1 time per output token, the time to a 256-token prompt's first token and
the output throughput of N requests at once, then bf16's speed-up over float32.
"""

from __future__ import annotations

import argparse
import json
import time

from heron import LLM, SamplingParams
from heron.kernels.cpu.isa import cpu_summary


def measure(llm: LLM, requests: int, output_len: int) -> dict[str, float]:
    words = "the heron waits at the edge of the water for a fish to pass by " * 40
    prompt = llm.get_tokenizer().encode(words)[:256]
    greedy = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm up

    def best_of_3(params: SamplingParams) -> float:
        times = []
        for _ in range(3):
            started = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            times.append(time.perf_counter() - started)
        return min(times)

    # the same prompt to 1 and to output_len tokens: the difference is the decoding (best of 3 each,
    # so scheduling noise does not make it negative)
    ttft = best_of_3(SamplingParams(temperature=0, max_tokens=1))
    tpot = (best_of_3(greedy) - ttft) / (output_len - 1)
    prompts = [prompt[i % 7:] for i in range(requests)]  # (prefix caching is off: every prompt is computed)
    started = time.perf_counter()
    llm.generate(prompts, greedy, use_tqdm=False)
    throughput = requests * output_len / (time.perf_counter() - started)
    return {"tpot_ms_batch1": round(tpot * 1000, 2), "ttft_ms_256_tokens": round(ttft * 1000, 1),
            f"output_tok_per_s_{requests}_requests": round(throughput, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    result: dict[str, object] = {"cpu": cpu_summary()}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(args.model, dtype=dtype, quantization="none", max_model_len=1024, enable_prefix_caching=False)
        result[dtype] = measure(llm, args.requests, args.output_len)
        del llm
    fp32, bf16 = result["float32"], result["bfloat16"]
    result["bf16_speedup"] = {key: round(fp32[key] / bf16[key], 2) if "tok_per_s" not in key
                              else round(bf16[key] / fp32[key], 2) for key in fp32}  # type: ignore[index]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
