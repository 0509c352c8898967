"""Unquantized float32 against bfloat16 on this CPU, offline, side by side in
one process: what ``--dtype auto`` should pick for ``--quantization none``.

"auto" picks bf16 where the CPU has AVX512-BF16 or AMX (engine/resolve.cpu_has_native_bf16)
and float32 elsewhere; run this on such a CPU to check that bf16 is the faster
there (on an AVX2-only CPU bf16 GEMMs are emulated and measured ~6x slower).

    python benchmarks/cpu_dtype_compare.py [--model PATH] [--requests 32] [--output-len 64]

Prints one JSON object: the CPU (model name and flags), and per dtype the
batch-1 time per output token (between the first token and the last, as the
engine emits them), the time to a 256-token prompt's first token and
the output throughput of N requests at once, then bf16's speed-up over float32.
"""

from __future__ import annotations

import argparse
import json
import time

from heron import LLM, SamplingParams
from heron.kernels.cpu.isa import cpu_summary
from heron.sampling_params import RequestOutputKind


def decode_time_per_token(llm: LLM, prompt: list[int], output_len: int) -> float:
    """Seconds per output token after the first, from the times the tokens came
    out of the engine's steps (one request alone)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    engine.add_request(engine.next_request_id(), engine.input_processor.process_prompt(prompt), params)
    arrivals: list[tuple[float, int]] = []  # (time, tokens so far)
    count = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.outputs[0].token_ids:
                count += len(output.outputs[0].token_ids)
                arrivals.append((time.perf_counter(), count))
    (first_time, first_count), (last_time, last_count) = arrivals[0], arrivals[-1]
    return (last_time - first_time) / max(1, last_count - first_count)


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

    ttft = best_of_3(SamplingParams(temperature=0, max_tokens=1))
    tpot = min(decode_time_per_token(llm, prompt, output_len) for _ in range(3))
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
