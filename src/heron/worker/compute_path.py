"""What code a loaded engine runs each step, stated once at start-up: in the
log, and in /metrics as the ``heron:compute_path_info`` gauge's labels.

A fast path that is off (no C compiler, a bf16 model, a layer the native decode
step does not cover) shows here with its reason, so it is never off silently.
"""

from __future__ import annotations

import torch
from torch import nn

from heron.config import EngineConfig
from heron.models.base import CausalLM
from heron.models.quantization import Int8WeightOnlyLinear, low_bit_layers

# the labels, in order (every value a short string)
COMPUTE_PATH_KEYS = ("device", "dtype", "quantization", "cpu_isa", "linear", "attention", "decode", "cpu")


def _linear_path(model: nn.Module, quantization: str) -> str:
    """Who computes the linear layers; under a low-bit mode, how many of them
    (layers it leaves to torch, such as an input size no multiple of 32 or a
    transformers Conv1D, said it covered them all)."""
    low_bit = low_bit_layers(model)
    if not low_bit:
        return "torch"
    if all(module.uses_native_kernel for module in low_bit):
        path = f"heron {quantization} C kernels"
    else:
        path = f"torch fallback for {quantization} (no native kernels)"
    others = sum(1 for module in model.modules() if _is_other_linear(module))
    if others:
        path += f" ({len(low_bit)} of {len(low_bit) + others} linear layers; the rest in torch)"
    return path


def _is_other_linear(module: nn.Module) -> bool:
    """A linear layer the low-bit kernels do not run: int8 weight-only, or any
    other module owning a float matrix (or a stack of them) that is no embedding:
    nn.Linear, transformers' Conv1D, the experts of its MoE blocks."""
    if isinstance(module, Int8WeightOnlyLinear):
        return True
    if isinstance(module, nn.Embedding):
        return False
    return any(param.dim() >= 2 and param.is_floating_point() for param in module.parameters(recurse=False))


def _decode_path(model: nn.Module, device: torch.device, use_cuda_graphs: bool, kv_cache_dtype: torch.dtype) -> str:
    if device.type == "cuda":
        return "cuda graphs" if use_cuda_graphs else "eager"
    if getattr(model, "native_decoder", None) is not None:
        return "native (one C call per step)"
    if not low_bit_layers(model):
        return "torch"
    if not hasattr(model, "native_decoder"):
        return "torch (not a native Llama-family model)"
    from heron.models.native_decode import NativeLowBitDecoder

    return f"torch ({NativeLowBitDecoder.unsupported_reason(model, kv_cache_dtype)})"


def _attention_path(model: CausalLM, backend_name: str, device: torch.device, dtype: torch.dtype,
                    kv_cache_dtype: torch.dtype) -> str:
    """What attends, by the test the torch backend makes each step (``can_run_paged_decode``)."""
    if device.type != "cpu" or backend_name != "torch":
        return backend_name
    if getattr(model, "native_decoder", None) is not None:
        return "heron C paged (every step)"
    from heron.kernels.cpu.ops import supports_paged_decode, supports_paged_kv_cache

    spec = model.attention_layers()[0].spec
    paged = (supports_paged_decode(dtype, spec.num_heads) and supports_paged_kv_cache(kv_cache_dtype)
             and spec.logits_soft_cap is None)
    return "torch prefill, heron C paged decode" if paged else "torch"


def describe_compute_path(
    config: EngineConfig, model: CausalLM, backend_name: str, use_cuda_graphs: bool
) -> dict[str, str]:
    """The compute path as label -> value (``COMPUTE_PATH_KEYS``)."""
    device = config.device
    path = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(config.model.dtype).removeprefix("torch."),
        "quantization": config.model.quantization,
        "cpu_isa": "none",
        "cpu": "",
    }
    if device.type == "cpu":
        from heron.kernels.cpu.isa import cpu_summary
        from heron.kernels.cpu.library import native_isa

        path["cpu_isa"] = native_isa() or "none"
        path["cpu"] = cpu_summary()
    path["linear"] = _linear_path(model, config.model.quantization)
    path["attention"] = _attention_path(model, backend_name, device, config.model.dtype, config.kv_cache_dtype)
    if config.kv_cache_dtype != config.model.dtype:
        path["attention"] += f", {str(config.kv_cache_dtype).removeprefix('torch.')} KV cache"
    path["decode"] = _decode_path(model, device, use_cuda_graphs, config.kv_cache_dtype)
    return {key: path[key] for key in COMPUTE_PATH_KEYS}


def format_compute_path(path: dict[str, str]) -> str:
    return ", ".join(f"{key}={value}" for key, value in path.items() if value)
