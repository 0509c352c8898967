"""GPU benchmark of heron on a random-weight Llama-3.2-1B-shaped model (bf16).

    PYTHONPATH=src python3 benchmarks/gpu_bench.py --out results.json [--skip-hf]

Measures, on the device it runs on:
* the HBM floor of one decode step: weight bytes / measured device copy bandwidth;
* decode inter-token latency at batch 1 and 64, with CUDA graphs (async
  scheduling on, the default, and off) and eager; and at batch 64 with
  top-k/top-p sampling (a host sync in the sampler would show here), and at
  batch 1 after a 1,700-token prompt (how attention scales with context);
* batch 1 at both context lengths without split-KV decode attention
  (``HERON_ATTENTION_MAX_KV_SPLITS=1``), as a ratio;
* offline throughput (256 requests, input 128-1024, output 128-512, ignore_eos)
  for heron and for Hugging Face transformers (its continuous-batching
  ``generate_batch`` when present, else length-sorted padded batches).
Writes everything, with device, torch and CUDA versions, to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.gpu.conftest import word_tokenizer  # noqa: E402

from heron import LLM, SamplingParams  # noqa: E402

LLAMA_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    bos_token_id=1, eos_token_id=2,
)


def build_model(directory: str) -> int:
    from transformers import AutoModelForCausalLM, LlamaConfig

    if not os.path.exists(os.path.join(directory, "config.json")):
        config = LlamaConfig(**LLAMA_1B)
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(directory)
        word_tokenizer(LLAMA_1B["vocab_size"]).save_pretrained(directory)
        del model
        torch.cuda.empty_cache()
    from safetensors import safe_open

    total = 0
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), framework="pt") as handle:
                total += sum(math.prod(handle.get_slice(k).get_shape()) * 2 for k in handle.keys())  # noqa: SIM118
    return total


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy, read + write counted."""
    src = torch.randn(256 << 20, device="cuda", dtype=torch.float32)  # 1 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 4 * 20 / (start.elapsed_time(end) / 1000)


def random_prompts(count: int, low: int, high: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]


def decode_itl(llm: LLM, batch: int, prompt_len: int = 128, steps: int = 256, **sampling) -> float:
    """Seconds per decode step at ``batch``: (time for 1 + steps tokens - time for 1) / steps."""
    prompts = random_prompts(batch, prompt_len, prompt_len, LLAMA_1B["vocab_size"], seed=batch)

    def timed(max_tokens: int) -> float:
        params = SamplingParams(**{"temperature": 0, **sampling}, max_tokens=max_tokens, ignore_eos=True)
        torch.cuda.synchronize()
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - started

    timed(4)  # warm-up
    prefill = min(timed(1) for _ in range(3))
    full = min(timed(1 + steps) for _ in range(2))
    llm.engine.engine_core.reset_prefix_cache()
    return (full - prefill) / steps


def throughput_workload(seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = random_prompts(256, 128, 1024, LLAMA_1B["vocab_size"], seed)
    outputs = [rng.randint(128, 512) for _ in prompts]
    return prompts, outputs


def heron_throughput(llm: LLM) -> dict:
    prompts, outputs = throughput_workload()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    started = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    generated = sum(len(r.outputs[0].token_ids) for r in results)
    assert generated == sum(outputs)
    return {"elapsed_s": elapsed, "output_tokens": generated, "output_tok_per_s": generated / elapsed,
            "total_tok_per_s": (generated + sum(map(len, prompts))) / elapsed}


def hf_throughput(directory: str, time_limit_s: float) -> dict:
    """transformers' best: generate_batch (continuous batching) if it exists, else
    padded batches of 64 sorted by output length; only requested tokens count."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    prompts, outputs = throughput_workload()
    results: dict = {}
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).cuda().eval()
    errors = []
    implementations = ("paged|sdpa", "paged|flash_attention_2", "paged|eager")
    for implementation in implementations if hasattr(model, "generate_batch") else ():
        try:
            paged = AutoModelForCausalLM.from_pretrained(
                directory, dtype=torch.bfloat16, attn_implementation=implementation).cuda().eval()
            config = GenerationConfig(max_new_tokens=max(outputs), do_sample=False, eos_token_id=-1, pad_token_id=0)
            torch.cuda.synchronize()
            started = time.perf_counter()
            paged.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - started
            generated = len(prompts) * max(outputs)
            results["generate_batch"] = {
                "attn_implementation": implementation, "elapsed_s": elapsed,
                "output_tok_per_s": generated / elapsed,
                "note": f"all requests generate max_new_tokens={max(outputs)}; every generated token counted",
            }
            del paged
            break
        except Exception as exc:  # noqa: BLE001 - report why and try the next
            errors.append(f"{implementation}: {type(exc).__name__}: {exc}"[:300])
    if errors:
        results["generate_batch_errors"] = errors
    order = sorted(range(len(prompts)), key=lambda i: outputs[i])
    started = time.perf_counter()
    done_tokens = 0
    for begin in range(0, len(order), 64):
        batch = order[begin : begin + 64]
        width = max(len(prompts[i]) for i in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(batch):  # left padding
            ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]):] = 1
        new_tokens = max(outputs[i] for i in batch)
        model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        done_tokens += sum(outputs[i] for i in batch)
        if time.perf_counter() - started > time_limit_s:
            break
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    results["padded_generate"] = {"elapsed_s": elapsed, "output_tok_per_s": done_tokens / elapsed,
                                  "requests": min(len(order), begin + 64)}
    best = max(v["output_tok_per_s"] for v in results.values() if isinstance(v, dict))
    results["best_output_tok_per_s"] = best
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model-dir", default="/tmp/llama-1b-random")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--hf-time-limit", type=float, default=150.0)
    parser.add_argument("--hf-only", action="store_true", help="measure transformers only")
    parser.add_argument("--modes", default="cuda_graphs,cuda_graphs_sync,eager,no_split_kv",
                        help="comma-separated: cuda_graphs (async scheduling), cuda_graphs_sync, eager, "
                             "no_split_kv (cuda_graphs without split-KV decode attention: batch 1 only)")
    args = parser.parse_args()
    report: dict = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "model": "random-weight Llama-3.2-1B shape, bf16",
    }

    def save() -> None:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=2)

    weight_bytes = build_model(args.model_dir)
    if args.hf_only:
        report["hf"] = hf_throughput(args.model_dir, args.hf_time_limit)
        save()
        print(json.dumps(report["hf"], indent=1))
        return
    bandwidth = copy_bandwidth()
    report.update(weight_bytes=weight_bytes, copy_bandwidth_bytes_per_s=bandwidth,
                  hbm_floor_ms=weight_bytes / bandwidth * 1000)
    save()
    modes = {  # name -> engine settings
        "cuda_graphs": dict(enforce_eager=False, async_scheduling=True),  # the CUDA default
        "cuda_graphs_sync": dict(enforce_eager=False, async_scheduling=False),
        "eager": dict(enforce_eager=True, async_scheduling=True),
        "no_split_kv": dict(enforce_eager=False, async_scheduling=True),
    }
    for mode in args.modes.split(","):
        if mode == "no_split_kv":
            os.environ["HERON_ATTENTION_MAX_KV_SPLITS"] = "1"
        llm = LLM(args.model_dir, dtype="bfloat16", max_model_len=2048, max_num_seqs=256, **modes[mode])
        os.environ.pop("HERON_ATTENTION_MAX_KV_SPLITS", None)
        report[f"itl_batch1_ms_{mode}"] = decode_itl(llm, 1) * 1000
        if mode == "no_split_kv":  # split-KV only changes decode steps of few sequences
            report["itl_batch1_ctx1700_ms_no_split_kv"] = decode_itl(llm, 1, prompt_len=1700, steps=128) * 1000
            save()
            del llm
            torch.cuda.empty_cache()
            continue
        report[f"itl_batch64_ms_{mode}"] = decode_itl(llm, 64) * 1000
        save()
        if mode == "cuda_graphs":
            report["itl_batch64_ms_sampled"] = decode_itl(llm, 64, temperature=0.8, top_p=0.95, top_k=50) * 1000
            # a long context at batch 1: the attention grid is (sequences x KV heads), 8 programs here
            report["itl_batch1_ctx1700_ms"] = decode_itl(llm, 1, prompt_len=1700, steps=128) * 1000
        if mode.startswith("cuda_graphs"):
            report[f"heron_throughput_{mode}"] = heron_throughput(llm)
            save()
        del llm
        torch.cuda.empty_cache()
    report["heron_throughput"] = report.get("heron_throughput_cuda_graphs")
    split_kv_pairs = {  # case -> (ITL with split-KV decode, without)
        "batch1": ("itl_batch1_ms_cuda_graphs", "itl_batch1_ms_no_split_kv"),
        "batch1_ctx1700": ("itl_batch1_ctx1700_ms", "itl_batch1_ctx1700_ms_no_split_kv"),
    }
    for case, (split, unsplit) in split_kv_pairs.items():
        if report.get(split) and report.get(unsplit):
            report[f"split_kv_speedup_{case}"] = report[unsplit] / report[split]
    for batch in (1, 64):
        graphs = report.get(f"itl_batch{batch}_ms_cuda_graphs")
        if graphs and f"itl_batch{batch}_ms_eager" in report:
            report[f"graphs_speedup_batch{batch}"] = report[f"itl_batch{batch}_ms_eager"] / graphs
        if graphs and f"itl_batch{batch}_ms_cuda_graphs_sync" in report:
            report[f"async_speedup_batch{batch}"] = report[f"itl_batch{batch}_ms_cuda_graphs_sync"] / graphs
        if graphs:
            report[f"itl_batch{batch}_over_floor"] = graphs / report["hbm_floor_ms"]
    save()
    if not args.skip_hf:
        report["hf"] = hf_throughput(args.model_dir, args.hf_time_limit)
        report["heron_over_hf"] = report["heron_throughput"]["output_tok_per_s"] / report["hf"]["best_output_tok_per_s"]
        save()
    print(json.dumps({k: v for k, v in report.items() if not isinstance(v, dict)}, indent=1))
    for mode in args.modes.split(","):
        print(mode, json.dumps(report.get(f"heron_throughput_{mode}")))
    print(json.dumps(report.get("hf"), indent=1))


if __name__ == "__main__":
    main()
