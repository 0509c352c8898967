"""Read a model's transformers config from an HF directory or a GGUF file, and
helpers that read config fields which differ between transformers versions."""

from __future__ import annotations

import json
import os
from typing import Any

from heron.loader.arch_config import (
    arch_config_from_dict,
    computed_natively,
    is_native_family,
    rope_parameters_of,
    rope_type_of,
)
from heron.loader.model_source import ModelSource


def load_hf_config(source: ModelSource, model_impl: str = "auto") -> Any:
    """The model's config: a light ``ArchConfig`` for natively implemented families
    (GGUF files always; HF directories unless ``model_impl="transformers"``),
    otherwise transformers' own config object."""
    if source.format == "gguf":
        from heron.loader.gguf_file import open_gguf
        from heron.loader.gguf_model import gguf_to_hf_config

        return gguf_to_hf_config(open_gguf(source.path))
    config_path = os.path.join(source.path, "config.json")
    try:
        with open(config_path, encoding="utf-8") as handle:
            values = json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the model config {config_path}: {exc}") from exc
    native_layers = computed_natively(rope_type_of(values), values.get("hidden_act", "silu"))
    if is_native_family(str(values.get("model_type"))) and (model_impl == "native" or
                                                            (model_impl == "auto" and native_layers)):
        return arch_config_from_dict(values)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source.path)
    except (ValueError, KeyError) as exc:
        raise ValueError(f"cannot read the model config in {source.path}: {exc}") from exc


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The RoPE settings as one dict with ``rope_type`` and ``rope_theta``.

    transformers >= 5 keeps them in ``rope_parameters``; older versions in
    ``rope_theta`` plus an optional ``rope_scaling`` dict (``arch_config``'s
    reading, one for both).
    """
    return rope_parameters_of(hf_config)


def model_context_length(hf_config: Any) -> int:
    """The longest sequence the model takes: its position limit, or for YaRN
    the original context times the factor where that is longer (Qwen's configs
    keep the short limit beside the scaling, as vLLM reads them); linear
    scaling stretches the limit by its factor, as vLLM reads it. (Dynamic NTK
    scaling does not: past the limit transformers would recompute its
    frequencies per forward call, that is per step of a whole batch.)"""
    length = 2048
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            length = value
            break
    rope = rope_parameters(hf_config)
    if rope["rope_type"] == "yarn" and rope.get("factor") and rope.get("original_max_position_embeddings"):
        length = max(length, int(float(rope["factor"]) * int(rope["original_max_position_embeddings"])))
    if rope["rope_type"] == "linear" and rope.get("factor"):
        length = int(length * float(rope["factor"]))
    return length


def head_dim_of(hf_config: Any) -> int:
    head_dim = getattr(hf_config, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0:
        return head_dim
    return int(hf_config.hidden_size) // int(hf_config.num_attention_heads)


def eos_token_ids(hf_config: Any, tokenizer: Any, model_dir: str | None = None) -> list[int]:
    """Every token id that ends generation: the generation config's and the model
    config's (either may be a list), and the tokenizer's EOS."""
    ids: list[int] = []
    sources = [getattr(hf_config, "eos_token_id", None)]
    generation_config = os.path.join(model_dir, "generation_config.json") if model_dir else None
    if generation_config and os.path.isfile(generation_config):
        try:
            with open(generation_config, encoding="utf-8") as handle:
                sources.insert(0, json.load(handle).get("eos_token_id"))
        except (OSError, json.JSONDecodeError):
            pass
    for config_eos in sources:
        candidates = config_eos if isinstance(config_eos, (list, tuple)) else [config_eos]
        ids.extend(int(i) for i in candidates if isinstance(i, int) and int(i) not in ids)
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tokenizer_eos, int) and tokenizer_eos not in ids:
        ids.append(tokenizer_eos)
    return ids


def model_eos_token_ids(model_config: Any, tokenizer: Any) -> list[int]:
    """``eos_token_ids`` of a resolved ``ModelConfig`` (an HF directory may add a
    generation_config.json; a GGUF file carries everything in its metadata)."""
    model_dir = model_config.model if model_config.source_format == "hf" else None
    return eos_token_ids(model_config.hf_config, tokenizer, model_dir)
