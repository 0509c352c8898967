"""Engine configuration: small frozen dataclasses composed into one ``EngineConfig``.

Every knob a user can turn lives here with its default and its validation, so the
rest of the engine reads resolved, checked values and never re-validates them.
``EngineConfig.create`` is the one place that resolves "auto" values (dtype,
max_model_len, KV-cache size) against the model and the machine.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # imported where a value is resolved: the API server starts without torch
    import torch

logger = logging.getLogger(__name__)

SchedulingPolicy = Literal["fcfs", "priority"]
LOW_BIT_METHODS = ("int8", "int4")  # the CPU's weight formats with int8 inputs (models/quantization.py)
QUANTIZATION_CHOICES = ("auto", "none", *LOW_BIT_METHODS)

# user spellings -> torch dtype names
_DTYPE_NAMES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def cpu_has_native_bf16() -> bool:
    """True when the CPU has bf16 matrix instructions (AVX512-BF16 or AMX).

    Without them torch emulates bf16 GEMMs, which measured 6x slower than fp32 on an
    AVX2 machine, so "auto" picks float32 there.
    """
    from heron.kernels.cpu.isa import cpu_flags

    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _dtype_name(dtype: str | torch.dtype) -> str | None:
    """A user spelling or a torch.dtype as a torch dtype name (None: not a known spelling)."""
    if not isinstance(dtype, str):
        return str(dtype).removeprefix("torch.")
    return _DTYPE_NAMES.get(dtype)


def resolve_dtype(dtype: str | torch.dtype, device: str, quantization: str = "none") -> str:
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
    name = _dtype_name(dtype)
    if name is None:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(set(_DTYPE_NAMES))}, got {dtype!r}")
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unsupported dtype {name}; use float32, bfloat16 or float16")
    if quantization in LOW_BIT_METHODS and name != "float32":
        raise ValueError(
            f"quantization={quantization!r} runs its kernels on float32 activations; "
            f"use dtype 'auto' or 'float32' with it, or quantization 'none' for {name}"
        )
    return name


def resolve_quantization(quantization: str, dtype: str | torch.dtype, device: str, source: Any) -> str:
    """"auto": a GGUF whose linear layers are all Q4_0/Q4_1 runs in heron's int4
    format, all Q4_0/Q4_1/Q8_0 with some Q8_0 in int8; on a CPU with AVX2 (or
    better) only, with dtype "auto" or float32. Anything else: "none"."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {quantization!r}")
    if quantization != "auto":
        return quantization
    wants_float32 = dtype == "auto" or _dtype_name(dtype) == "float32"
    if device != "cpu" or source.format != "gguf" or not wants_float32:
        return "none"
    from heron.kernels.cpu.isa import supported_isas

    if "avx2" not in supported_isas():  # the low-bit kernels would run their (slow) portable reference
        logger.info("quantization auto: none (this CPU has no AVX2 for heron's low-bit kernels)")
        return "none"
    from heron.loader.gguf_file import open_gguf
    from heron.loader.gguf_model import linear_weight_types

    types = linear_weight_types(open_gguf(source.path))
    if types and types <= {"Q4_0", "Q4_1"}:
        method = "int4"
    elif types and types <= {"Q4_0", "Q4_1", "Q8_0"}:
        method = "int8"
    else:
        return "none"
    logger.info("quantization auto: %s (the GGUF's linear weights are %s)", method, "/".join(sorted(types)))
    return method


# device nodes of a GPU that torch may drive (NVIDIA, AMD ROCm, WSL)
_GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")


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


@dataclass(frozen=True)
class ModelConfig:
    """What model runs and how. ``hf_config`` is the transformers config object
    (from config.json or built from GGUF metadata)."""

    model: str  # resolved local path: an HF directory or a .gguf file
    served_model_name: str
    source_format: Literal["hf", "gguf"]
    hf_config: Any = field(repr=False)
    dtype_name: str  # "float32" | "bfloat16" | "float16" (a name: the API server never imports torch)
    max_model_len: int
    architecture: str  # the HF architecture name, e.g. "LlamaForCausalLM"
    model_impl: Literal["auto", "native", "transformers"] = "auto"
    quantization: str = "none"  # resolved: "none" | "int8" | "int4" (CPU, int8 inputs)
    seed: int = 0
    tokenizer: str | None = None  # override; defaults to the model's own

    @property
    def dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV-cache knobs.

    The pool size comes from, in order of precedence: ``num_kv_blocks``, then
    ``kv_cache_memory_bytes``, then (CPU) ``kv_cache_memory_fraction`` of the memory
    available after the weights are loaded, or (CUDA) what ``gpu_memory_utilization``
    of the device leaves after the weights and a profiled worst-case step.
    """

    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.25
    num_kv_blocks: int | None = None
    # CUDA: share of the device memory heron may use in all (weights, activations, KV)
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1]")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits and the admission policy (DESIGN.md §2, one scheduling rule)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    policy: SchedulingPolicy = "fcfs"
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")


@dataclass(frozen=True)
class ProfilerConfig:
    """Record engine steps ``[start_step, start_step + num_steps)`` with the torch
    profiler and write a Chrome trace into ``directory``."""

    directory: str | None = None
    num_steps: int = 32
    start_step: int = 0

    def __post_init__(self) -> None:
        if self.num_steps < 1 or self.start_step < 0:
            raise ValueError("profile steps must be >= 1 and the start step >= 0")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's keys. ``ngram``: propose the tokens that
    followed the latest earlier occurrence of the request's last
    ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens. ``draft_model``: a
    smaller model with the same tokenizer (``model``) proposes them, optionally
    int8-quantized (``quantization``)."""

    method: Literal["ngram", "draft_model"]
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None
    quantization: str | None = None  # the draft's; None: the target's

    @staticmethod
    def from_dict(value: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a dict such as {'method': 'ngram', 'num_speculative_tokens': 4}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model", "quantization"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens")
        method = value.get("method") or ("draft_model" if value.get("model") else None)
        return SpeculativeConfig(**{**value, "method": method})  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config.method must be 'ngram' or 'draft_model', got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("speculative_config.num_speculative_tokens must be an integer in [1, 16]")
        if self.method == "ngram" and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.quantization not in (None, "none", "int8", "int4"):
            raise ValueError(
                f"speculative_config.quantization must be 'none', 'int8' or 'int4', got {self.quantization!r}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.method 'draft_model' needs 'model' (the draft model's path)")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device_name: str  # "cpu", "cuda" or "cuda:N"
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    attention_backend: str = "auto"  # "auto" | "torch" | "triton"
    enforce_eager: bool = False  # no CUDA graphs
    compile_model: bool = False  # torch.compile the forward pass (exclusive with graphs)
    speculative: SpeculativeConfig | None = None
    draft_model: ModelConfig | None = None  # the draft model of speculative "draft_model"
    # schedule and prepare step N+1 while the device runs step N (see engine/core.py)
    async_scheduling: bool = False

    @property
    def device(self) -> torch.device:
        import torch

        return torch.device(self.device_name)

    def resolved_summary(self) -> dict[str, Any]:
        """The resolved values two processes resolving the same arguments must agree on."""
        model = self.model
        return {
            "model": model.model,
            "served_model_name": model.served_model_name,
            "max_model_len": model.max_model_len,
            "dtype": model.dtype_name,
            "quantization": model.quantization,
            "vocab_size": model.vocab_size,
            "device": self.device_name,
        }

    @staticmethod
    def create(
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        kv_cache_memory_bytes: int | None = None,
        kv_cache_memory_fraction: float = 0.25,
        num_kv_blocks: int | None = None,
        scheduling_policy: SchedulingPolicy = "fcfs",
        enable_chunked_prefill: bool = True,
        seed: int = 0,
        device: str | None = None,
        model_impl: str = "auto",
        served_model_name: str | None = None,
        profile_dir: str | None = None,
        profile_steps: int = 32,
        attention_backend: str = "auto",
        enforce_eager: bool = False,
        compile_model: bool = False,
        gpu_memory_utilization: float = 0.9,
        quantization: str = "auto",
        speculative_config: dict[str, Any] | SpeculativeConfig | None = None,
        async_scheduling: bool | None = None,
        usage: Literal["offline", "serve"] = "offline",
    ) -> EngineConfig:
        """Resolve a user's arguments against the model and machine, validating all."""
        from heron.loader.model_config import load_hf_config
        from heron.loader.model_source import resolve_model_source

        if attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {attention_backend!r}")
        if model_impl not in ("auto", "native", "transformers"):
            raise ValueError(
                f"model_impl must be 'auto', 'native' or 'transformers', got {model_impl!r}"
            )
        resolved_device = resolve_device(device)
        source = resolve_model_source(model)
        quantization = resolve_quantization(quantization, dtype, resolved_device, source)
        hf_config = load_hf_config(source, model_impl)
        model_max_len = _model_max_len(hf_config)
        if max_model_len is None:
            max_model_len = model_max_len
        elif max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        elif max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len={max_model_len} is larger than the model's maximum "
                f"context length ({model_max_len})"
            )
        if max_num_seqs is None:
            # a GPU step reads the weights once for the whole batch: wide batches are
            # nearly free there (vLLM's default is 256 too); a CPU step's cost grows with it
            max_num_seqs = 256 if resolved_device.startswith("cuda") else 64
        if max_num_batched_tokens is None:
            # Serving on a CPU: the budget bounds how long running decodes wait behind
            # a new prompt; a 512-token step takes about a second and keeps 95% of the
            # prefill rate of 2048-token steps. Offline, nobody waits: take the rate.
            serving_cpu = usage == "serve" and resolved_device == "cpu"
            max_num_batched_tokens = max(512 if serving_cpu else 2048, max_num_seqs)
        architectures = getattr(hf_config, "architectures", None) or []
        model_config = ModelConfig(
            model=source.path,
            served_model_name=served_model_name or source.name,
            source_format=source.format,
            hf_config=hf_config,
            dtype_name=resolve_dtype(dtype, resolved_device, quantization),
            max_model_len=max_model_len,
            architecture=architectures[0] if architectures else "",
            model_impl=model_impl,  # type: ignore[arg-type]
            quantization=quantization,
            seed=seed,
            tokenizer=tokenizer,
        )
        from heron.models.implementation import select_implementation

        select_implementation(model_config)  # unsupported architectures fail here, early
        speculative = SpeculativeConfig.from_dict(speculative_config)
        draft_model = _draft_model_config(speculative, model_config, model_impl) if speculative else None
        if draft_model is not None and draft_model.quantization != "none" and resolved_device != "cpu":
            raise ValueError(f"speculative_config.quantization={draft_model.quantization!r} runs on the CPU only")
        if quantization != "none" and resolved_device != "cpu":
            raise ValueError(f"quantization={quantization!r} runs on the CPU only; use bfloat16 on CUDA")
        if async_scheduling and speculative is not None:
            raise ValueError("async_scheduling does not support speculative decoding yet; turn one of them off")
        if async_scheduling is None:
            # overlapping needs a device that runs beside the host: on a CPU both are the same cores
            async_scheduling = resolved_device.startswith("cuda") and speculative is None
        return EngineConfig(
            model=model_config,
            cache=CacheConfig(
                block_size=block_size,
                enable_prefix_caching=enable_prefix_caching,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                kv_cache_memory_fraction=kv_cache_memory_fraction,
                num_kv_blocks=num_kv_blocks,
                gpu_memory_utilization=gpu_memory_utilization,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                policy=scheduling_policy,
                enable_chunked_prefill=enable_chunked_prefill,
            ),
            device_name=resolved_device,
            profiler=ProfilerConfig(directory=profile_dir, num_steps=profile_steps),
            attention_backend=attention_backend,
            enforce_eager=enforce_eager or compile_model,
            compile_model=compile_model,
            speculative=speculative,
            draft_model=draft_model,
            async_scheduling=async_scheduling,
        )


def _draft_model_config(speculative: SpeculativeConfig, target: ModelConfig, model_impl: str) -> ModelConfig | None:
    """The draft model's config: same dtype and context as the target, and a
    vocabulary the target can verify."""
    if speculative.method != "draft_model":
        return None
    from dataclasses import replace

    from heron.loader.model_config import load_hf_config
    from heron.loader.model_source import resolve_model_source

    source = resolve_model_source(speculative.model)
    hf_config = load_hf_config(source, model_impl)
    if getattr(hf_config, "vocab_size", None) != target.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({getattr(hf_config, 'vocab_size', None)} tokens) differs from the "
            f"target's ({target.vocab_size}): speculative decoding needs the same tokenizer"
        )
    draft_max_len = _model_max_len(hf_config)
    if draft_max_len < target.max_model_len + speculative.num_speculative_tokens:
        raise ValueError(
            f"the draft model's context ({draft_max_len} tokens) is shorter than max_model_len "
            f"({target.max_model_len}) plus the drafts; lower max_model_len"
        )
    architectures = getattr(hf_config, "architectures", None) or []
    return replace(
        target,
        model=source.path,
        served_model_name=source.name,
        source_format=source.format,
        hf_config=hf_config,
        architecture=architectures[0] if architectures else "",
        quantization=speculative.quantization or target.quantization,
    )


def _model_max_len(hf_config: Any) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048

