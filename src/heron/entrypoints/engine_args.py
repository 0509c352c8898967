"""Command-line flags that configure the engine, shared by every subcommand
(named like vLLM's so commands carry over)."""

from __future__ import annotations

import argparse
from typing import Any

from heron.config import QUANTIZATION_CHOICES, EngineConfig


def parse_size(text: str) -> int:
    """'4GiB', '512MB', '1e9' -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    lowered = text.strip().lower()
    for suffix, factor in units.items():
        if lowered.endswith(suffix):
            return int(float(lowered[: -len(suffix)]) * factor)
    return int(float(lowered))


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None, help="HF directory, .gguf file or hub id (default: the embedded SmolLM2-135M-Instruct)")
    group.add_argument("--tokenizer", default=None, help="tokenizer to use instead of the model's own")
    group.add_argument("--served-model-name", default=None, help="model name reported by the API")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--max-num-seqs", type=int, default=None, help="running sequences per step (default: 256 on CUDA, 64 on CPU)")
    group.add_argument("--max-num-batched-tokens", type=int, default=None)
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    group.add_argument("--kv-cache-memory-bytes", type=parse_size, default=None, help="KV-cache budget, e.g. 2GiB")
    group.add_argument("--kv-cache-memory-fraction", type=float, default=0.25, help="share of available memory for the KV cache")
    group.add_argument("--num-kv-blocks", type=int, default=None)
    group.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    group.add_argument("--model-impl", default="auto", choices=["auto", "native", "transformers"])
    group.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    group.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    group.add_argument("--compile", action="store_true", help="torch.compile the forward pass (instead of CUDA graphs)")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    group.add_argument("--quantization", default="auto", choices=list(QUANTIZATION_CHOICES),
                       help="CPU low-bit weights with int8 inputs: int8 per output channel, or int4 in blocks of 32 "
                            "(the LM head int8); auto (default): the format matching a GGUF's Q4_0/Q4_1/Q8_0 "
                            "weights on the CPU, else none")
    group.add_argument("--speculative-config", type=_json_dict, default=None, metavar="JSON",
                       help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="schedule step N+1 while the device runs step N (default: on for CUDA without "
                            "speculative decoding)")


def _json_dict(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def engine_kwargs_from_args(args: argparse.Namespace, usage: str = "offline") -> dict[str, Any]:
    """``EngineConfig.create``'s keyword arguments from the flags (nothing resolved yet)."""
    return dict(
        model=args.model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        num_kv_blocks=args.num_kv_blocks,
        scheduling_policy=args.scheduling_policy,
        enable_chunked_prefill=args.enable_chunked_prefill,
        seed=args.seed,
        device=args.device,
        model_impl=args.model_impl,
        served_model_name=args.served_model_name,
        profile_dir=getattr(args, "profile", None),
        profile_steps=getattr(args, "profile_steps", 32),
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        compile_model=args.compile,
        gpu_memory_utilization=args.gpu_memory_utilization,
        quantization=args.quantization,
        speculative_config=args.speculative_config,
        async_scheduling=args.async_scheduling,
        usage=usage,
    )


def engine_config_from_args(args: argparse.Namespace, usage: str = "offline") -> EngineConfig:
    return EngineConfig.create(**engine_kwargs_from_args(args, usage))


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens)
    group.add_argument("--temperature", type=float, default=0.7)
    group.add_argument("--top-p", type=float, default=0.9)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--sampling-seed", type=int, default=None, help="seed for this request's sampling")
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
