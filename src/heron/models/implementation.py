"""Which implementation runs a model: heron's native one (the Llama family) or
transformers' modeling code. Torch-free: the API server resolves its config
with it without importing torch."""

from __future__ import annotations

from typing import Any, Protocol

from heron.loader.arch_config import NATIVE_ROPE_TYPES, computed_natively
from heron.loader.model_config import rope_parameters


class ModelDescription(Protocol):
    """What the choice reads (config.ModelConfig has it; no import of config here,
    which imports this module)."""

    @property
    def architecture(self) -> str: ...
    @property
    def hf_config(self) -> Any: ...
    @property
    def model_impl(self) -> str: ...
    @property
    def source_format(self) -> str: ...


NATIVE_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("heron.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("heron.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("heron.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("heron.models.llama", "LlamaForCausalLM"),
}
_NATIVE_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                       "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def native_architecture(model_config: ModelDescription) -> str | None:
    if model_config.architecture in NATIVE_ARCHITECTURES:
        return model_config.architecture
    return _NATIVE_MODEL_TYPES.get(getattr(model_config.hf_config, "model_type", ""))


def select_implementation(model_config: ModelDescription) -> str:
    """"native" or "transformers", or a ValueError naming what is supported. A
    native family whose RoPE type heron does not compute ("dynamic",
    "longrope"...) runs through transformers under "auto"."""
    native = native_architecture(model_config)
    rope_type = rope_parameters(model_config.hf_config)["rope_type"]
    if model_config.model_impl == "native" and native is not None and rope_type not in NATIVE_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported natively (native: "
                         f"{', '.join(NATIVE_ROPE_TYPES)}); use model_impl='transformers' or 'auto'")
    # a checkpoint quantized by a method of its own (FP8 with block scales, GPTQ, AWQ...): native layers read
    # float weights only (an FP8 one failed as "tensor ...weight_scale_inv has no place", as if damaged)
    quant_method = checkpoint_quant_method(model_config.hf_config)
    if model_config.model_impl == "native" and native is not None and quant_method is not None:
        raise ValueError(f"the checkpoint is quantized with quant_method {quant_method!r}, which heron's native "
                         "layers do not read; use model_impl='transformers' or 'auto'")
    activation = getattr(model_config.hf_config, "hidden_act", "silu")
    if model_config.model_impl == "native" and native is not None and activation != "silu":
        raise ValueError(f"hidden_act {activation!r} is not supported natively (native: silu); use "
                         "model_impl='transformers' or 'auto'")
    if (model_config.model_impl != "transformers" and native is not None and quant_method is None
            and computed_natively(rope_type, activation)):
        return "native"
    supported = ", ".join(sorted(NATIVE_ARCHITECTURES))
    if model_config.model_impl == "native":
        raise ValueError(
            f"architecture {model_config.architecture!r} has no native heron implementation "
            f"(native: {supported}); use model_impl='transformers' or 'auto'"
        )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(model_config.hf_config, "model_type", "")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"architecture {model_config.architecture or model_type!r} is not supported: heron runs "
            f"causal language models, natively for {supported}, and any other causal LM "
            "that transformers implements through transformers' modeling code"
        )
    if model_config.source_format != "hf":
        raise ValueError(f"{model_type!r} models load from Hugging Face directories only, not GGUF")
    return "transformers"


def checkpoint_quant_method(hf_config: Any) -> str | None:
    """config.json's ``quantization_config.quant_method``, or None for a float checkpoint."""
    quantization = getattr(hf_config, "quantization_config", None)
    if quantization is None:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(
        quantization, "quant_method", None)
    return str(method or "unknown")
