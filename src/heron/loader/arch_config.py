"""A light model config for the natively implemented families, read straight from
config.json (or GGUF metadata) without importing transformers' config classes,
which alone cost about 2 s of start-up in each process.

Missing fields take the same defaults as transformers' config class of that
family (the family tests build checkpoints with transformers, whose config.json
omits fields at their defaults, and compare the outputs).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

_COMMON: dict[str, Any] = dict(
    hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
    head_dim=None, num_key_value_heads=None, sliding_window=None, bos_token_id=None, eos_token_id=None,
    pad_token_id=None,
)
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(_COMMON, vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2),
    "mistral": dict(_COMMON, vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096 * 32,
                    sliding_window=4096, bos_token_id=1, eos_token_id=2),
    "qwen2": dict(_COMMON, vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=32768,
                  use_sliding_window=False, sliding_window=4096, max_window_layers=28),
    "qwen3": dict(_COMMON, vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128, max_position_embeddings=32768,
                  use_sliding_window=False, sliding_window=4096, max_window_layers=28),
}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


class ArchConfig(SimpleNamespace):
    """Attribute access like a transformers config, for the fields heron reads."""

    def get_text_config(self) -> ArchConfig:
        return self

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def to_transformers(self) -> Any:
        """The equivalent transformers config (for exporting an HF directory)."""
        from transformers import AutoConfig

        values = {k: v for k, v in vars(self).items() if k != "model_type" and not k.startswith("heron_")}
        return AutoConfig.for_model(self.model_type, **values)


# the RoPE types heron computes itself (models/layers/rotary.py); a native family with another runs
# through transformers under model_impl "auto"
NATIVE_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def computed_natively(rope_type: str, hidden_act: str) -> bool:
    """Whether heron's native layers compute a native family's configuration:
    a RoPE type of ``NATIVE_ROPE_TYPES`` and SiLU MLPs (any other runs through
    transformers under model_impl "auto")."""
    return rope_type in NATIVE_ROPE_TYPES and hidden_act == "silu"


def is_native_family(model_type: str) -> bool:
    return model_type in FAMILY_DEFAULTS


def rope_type_of(values: dict[str, Any]) -> str:
    """The RoPE type a config.json asks for, as the native config will read it."""
    return str(_rope_parameters(values)["rope_type"])


def sliding_window_of_layer(config: Any, layer_idx: int) -> int | None:
    """The attention window of one layer: per ``layer_types`` where the config has
    them, else the config's ``sliding_window`` for every layer of a Mistral (a
    Llama's config may carry the key too: transformers' Llama attends over
    everything, and so does heron's)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return int(window) if window and layer_types[layer_idx] == "sliding_attention" else None
    return int(window) if window and getattr(config, "model_type", "mistral") == "mistral" else None


def arch_config_from_dict(values: dict[str, Any]) -> ArchConfig:
    """Fill a config.json-style dict with its family's defaults and normalize the
    fields transformers derives (KV heads, head size, RoPE parameters)."""
    model_type = values["model_type"]
    merged = {**FAMILY_DEFAULTS[model_type], **values}
    if merged.get("num_key_value_heads") is None:
        merged["num_key_value_heads"] = merged["num_attention_heads"]
    if merged.get("head_dim") is None:
        merged["head_dim"] = merged["hidden_size"] // merged["num_attention_heads"]
    merged.setdefault("architectures", [_ARCHITECTURES[model_type]])
    if model_type in ("qwen2", "qwen3"):  # as transformers' Qwen configs derive them
        if not merged.get("use_sliding_window"):
            merged["sliding_window"] = None
        if merged.get("layer_types") is None:
            merged["layer_types"] = [
                "sliding_attention" if merged["sliding_window"] is not None and i >= merged["max_window_layers"]
                else "full_attention"
                for i in range(merged["num_hidden_layers"])
            ]
    merged["rope_parameters"] = _rope_parameters(merged)
    merged.pop("rope_scaling", None)
    merged.pop("rope_theta", None)
    return ArchConfig(**merged)


def _rope_parameters(values: dict[str, Any]) -> dict[str, Any]:
    """One dict with ``rope_type`` and ``rope_theta``, from transformers 5's
    ``rope_parameters`` or the older ``rope_theta`` plus ``rope_scaling``, as
    transformers merges them: a ``rope_parameters`` without ``rope_theta`` takes
    the top-level one (its scaling was dropped); for the types that scale from
    an original context (llama3, YaRN, LongRoPE), a top-level
    ``original_max_position_embeddings`` takes precedence over the dict's
    (Phi-3's rule, which transformers applies to every model), and without
    either they scale from ``max_position_embeddings`` (a bare KeyError)."""
    params = values.get("rope_parameters")
    result = dict(params if isinstance(params, dict) else values.get("rope_scaling") or {})
    if "rope_theta" not in result:
        result["rope_theta"] = float(values.get("rope_theta") or 10000.0)
    result["rope_type"] = result.get("rope_type") or result.get("type") or "default"
    result.pop("type", None)
    if result["rope_type"] in ORIGINAL_CONTEXT_ROPE_TYPES:
        top_level = values.get("original_max_position_embeddings")
        if top_level:
            result["original_max_position_embeddings"] = int(top_level)
        elif not result.get("original_max_position_embeddings") and values.get("max_position_embeddings"):
            result["original_max_position_embeddings"] = int(values["max_position_embeddings"])
    return result


# RoPE types whose scaling is relative to the context the model was pre-trained on
ORIGINAL_CONTEXT_ROPE_TYPES = ("llama3", "yarn", "longrope")


def rope_parameters_of(config: Any) -> dict[str, Any]:
    """``_rope_parameters`` of a config object (transformers' or ``ArchConfig``)."""
    keys = ("rope_parameters", "rope_scaling", "rope_theta", "max_position_embeddings",
            "original_max_position_embeddings")
    return _rope_parameters({key: getattr(config, key, None) for key in keys})
