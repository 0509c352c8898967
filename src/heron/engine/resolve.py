"""Resolving a user's "auto" values against the model and the machine: the
device, the dtype, the quantization, the context length and the draft model.

Torch-free unless a CUDA device is asked about (the API server process resolves
the same arguments as the engine core and never imports torch). Everything
here reads files or the CPU, which is why it is not in the ``config`` leaf.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from heron.config import (
    LOW_BIT_METHODS,
    ModelConfig,
    Quantization,
    ResolvedDType,
    ResolvedQuantization,
    SpeculativeConfig,
    check_choice,
)
from heron.loader.model_config import load_hf_config, model_context_length
from heron.loader.model_source import ModelSource, resolve_model_source

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# user spellings -> torch dtype names
_DTYPE_NAMES: dict[str, ResolvedDType] = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}

def dtype_flag(text: str) -> str:
    """A ``--dtype`` / ``--kv-cache-dtype`` value in any spelling heron takes
    (vLLM's ``half`` and ``float`` too: the CLI refused what ``LLM()`` took), as
    its canonical name; an argparse error otherwise."""
    name = "auto" if text == "auto" else _DTYPE_NAMES.get(text)
    if name is None:
        raise argparse.ArgumentTypeError(f"expected auto or one of {', '.join(_DTYPE_NAMES)}, got {text!r}")
    return name


# device nodes of a GPU that torch may drive (NVIDIA, AMD ROCm, WSL)
_GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")


def cpu_has_native_bf16() -> bool:
    """True when the CPU has bf16 matrix instructions (AVX512-BF16 or AMX).

    Without them torch emulates bf16 GEMMs, which measured 6x slower than fp32 on an
    AVX2 machine, so "auto" picks float32 there.
    """
    from heron.kernels.cpu.isa import cpu_flags

    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def dtype_name(dtype: str | torch.dtype) -> ResolvedDType | None:
    """A user spelling or a torch.dtype as a torch dtype name (None: not a known spelling)."""
    if not isinstance(dtype, str):
        return _DTYPE_NAMES.get(str(dtype).removeprefix("torch."))
    return _DTYPE_NAMES.get(dtype)


def resolve_dtype(dtype: str | torch.dtype, device: str, quantization: str = "none") -> ResolvedDType:
    """A user dtype ("auto", "float32", torch.bfloat16, ...) as a torch dtype name, for
    ``device`` (a ``resolve_device`` name). The CPU's low-bit modes (``quantization``
    int8 / int4) run on float32 activations. Imports torch only for CUDA's "auto"."""
    if dtype == "auto":
        if device.startswith("cuda"):
            import torch

            return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        if quantization in LOW_BIT_METHODS:
            return "float32"
        return "bfloat16" if cpu_has_native_bf16() else "float32"
    name = dtype_name(dtype)
    if name is None:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(set(_DTYPE_NAMES))}, got {dtype!r}")
    if quantization in LOW_BIT_METHODS and name != "float32":
        raise ValueError(
            f"quantization={quantization!r} runs its kernels on float32 activations; "
            f"use dtype 'auto' or 'float32' with it, or quantization 'none' for {name}"
        )
    return name


def resolve_kv_cache_dtype(kv_cache_dtype: str | torch.dtype, device: str, model: ModelConfig,
                           attention_backend: str = "auto") -> ResolvedDType | None:
    """What the KV cache holds, or None for the model's own dtype. "auto": float16
    for the CPU's low-bit modes (their attention kernel reads half the bytes; the
    activations it stores are float32 rounded to int8 at the next layer anyway),
    the model's dtype elsewhere. On CUDA only the model's dtype is supported, and
    so with the Triton kernel in the CPU's interpreter (its dots take one dtype:
    a float16 cache under float32 activations failed at the first step)."""
    triton_on_cpu = device == "cpu" and attention_backend == "triton"
    if kv_cache_dtype == "auto":
        return "float16" if device == "cpu" and not triton_on_cpu and model.quantization in LOW_BIT_METHODS else None
    name = dtype_name(kv_cache_dtype)
    if name is None:
        raise ValueError(f"kv_cache_dtype must be 'auto' or one of {sorted(set(_DTYPE_NAMES))}, got {kv_cache_dtype!r}")
    if name == model.dtype_name:
        return None
    if device != "cpu" or triton_on_cpu:
        where = "with attention_backend 'triton'" if triton_on_cpu else "supported on the CPU only"
        raise ValueError(f"kv_cache_dtype={name!r} differs from the model's dtype ({model.dtype_name}): "
                         f"{'not supported ' if triton_on_cpu else ''}{where}")
    return name


def resolve_quantization(
    quantization: str | None, dtype: str | torch.dtype, device: str, source: ModelSource
) -> ResolvedQuantization:
    """"auto": a GGUF whose linear layers are all Q4_0/Q4_1 runs in heron's int4
    format, all Q4_0/Q4_1/Q8_0 with some Q8_0 in int8; on a CPU with AVX2 (or
    better) only, with dtype "auto" or float32. Anything else: "none". None is
    "auto" (vLLM's default None means "as the model says": code written for it
    passed it and was refused)."""
    if quantization is None:
        quantization = "auto"
    check_choice("quantization", quantization, Quantization)
    if quantization != "auto":
        return quantization  # type: ignore[return-value]  # checked: not "auto"
    wants_float32 = dtype == "auto" or dtype_name(dtype) == "float32"
    if device != "cpu" or source.format != "gguf" or not wants_float32:
        return "none"
    from heron.kernels.cpu.isa import supported_isas

    if "avx2" not in supported_isas():  # the low-bit kernels would run their (slow) portable reference
        logger.info("quantization auto: none (this CPU has no AVX2 for heron's low-bit kernels)")
        return "none"
    from heron.loader.gguf_file import open_gguf
    from heron.loader.gguf_model import linear_weight_types

    types = linear_weight_types(open_gguf(source.path))
    method: ResolvedQuantization
    if types and types <= {"Q4_0", "Q4_1"}:
        method = "int4"
    elif types and types <= {"Q4_0", "Q4_1", "Q8_0"}:
        method = "int8"
    else:
        return "none"
    logger.info("quantization auto: %s (the GGUF's linear weights are %s)", method, "/".join(sorted(types)))
    return method


def resolve_device(device: str | None) -> str:
    """"cpu", "cuda" or "cuda:N". "auto" on a machine without GPU device nodes is
    "cpu" without importing torch (so the API server starts without it); elsewhere
    torch decides."""
    if device in (None, "auto"):
        if not any(os.path.exists(node) for node in _GPU_DEVICE_NODES):
            return "cpu"
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return "cpu"
    import torch

    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}") from exc
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but no CUDA device is available")
    return str(resolved)


def resolve_max_model_len(requested: int | None, hf_config: Any) -> int:
    """The context length: the model's own unless a shorter one is asked for."""
    model_max_len = model_context_length(hf_config)
    if requested is None:
        return model_max_len
    if requested < 2:
        raise ValueError(f"max_model_len must be >= 2, got {requested}")
    if requested > model_max_len:
        raise ValueError(
            f"max_model_len={requested} is larger than the model's maximum context length ({model_max_len})"
        )
    return requested


def architecture_of(hf_config: Any) -> str:
    architectures = getattr(hf_config, "architectures", None) or []
    return architectures[0] if architectures else ""


def draft_model_config(speculative: SpeculativeConfig, target: ModelConfig) -> ModelConfig | None:
    """The draft model's config: same dtype and context as the target, and a
    vocabulary the target can verify."""
    if speculative.method != "draft_model":
        return None
    source = resolve_model_source(speculative.model)
    hf_config = load_hf_config(source, target.model_impl)
    if getattr(hf_config, "vocab_size", None) != target.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({getattr(hf_config, 'vocab_size', None)} tokens) differs from the "
            f"target's ({target.vocab_size}): speculative decoding needs the same tokenizer"
        )
    draft_max_len = model_context_length(hf_config)
    # drafts never run past max_model_len (the proposer and the slots stop there): the draft's context need only hold it
    if draft_max_len < target.max_model_len:
        raise ValueError(
            f"the draft model's context ({draft_max_len} tokens) is shorter than max_model_len "
            f"({target.max_model_len}); lower max_model_len"
        )
    quantization = speculative.quantization or target.quantization
    if quantization in LOW_BIT_METHODS and target.dtype_name != "float32":
        # the draft runs in the target's dtype: a low-bit draft under bf16 took a slow path with a warning only
        raise ValueError(f"speculative_config.quantization={quantization!r} runs its kernels on float32 "
                         f"activations, and the draft runs in the target's dtype ({target.dtype_name}): use dtype "
                         "'auto' or 'float32', or leave the draft's quantization out")
    return replace(
        target,
        model=source.path,
        served_model_name=source.name,
        source_format=source.format,
        hf_config=hf_config,
        architecture=architecture_of(hf_config),
        quantization=quantization,
    )
