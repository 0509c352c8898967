"""Turn a GGUF checkpoint into what an HF checkpoint gives: a transformers config
and (name, tensor) pairs under Hugging Face parameter names.

llama.cpp's converter permutes the rows of the Q and K projections of "llama"
architecture models (it applies rotary embeddings to interleaved pairs; HF applies
them to the two halves), so those two are permuted back here. Rope frequency
factors that llama.cpp stores as a ``rope_freqs.weight`` tensor (Llama 3.1 style
scaling) are carried into the config as ``heron_rope_freq_factors``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from heron.loader.arch_config import ArchConfig, arch_config_from_dict
from heron.loader.gguf_file import GGUFFile, GGUFFormatError

if TYPE_CHECKING:  # the config and tokenizer read GGUF files in the API server, which never imports torch
    import torch

# GGUF architecture -> (HF model_type, HF architecture)
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}

_LAYER_TENSOR_NAMES: dict[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSOR_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_PATTERN = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_ROPE_FREQS = "rope_freqs.weight"


def gguf_architecture(gguf: GGUFFile) -> tuple[str, str]:
    arch = gguf.architecture
    kind = gguf.metadata.get("general.type", "model")
    if kind != "model":  # a LoRA adapter, a vocabulary-only file, an mmproj...
        raise ValueError(f"{gguf.path} is a GGUF {kind} (general.type {kind!r}), not a model: heron loads model "
                         "files")
    split_count = int(gguf.metadata.get("split.count", 1) or 1)
    if split_count > 1:
        raise ValueError(f"{gguf.path} is part {int(gguf.metadata.get('split.no', 0)) + 1} of a GGUF split into "
                         f"{split_count} files, which heron does not load: merge them into one with "
                         "llama.cpp's `llama-gguf-split --merge FIRST-PART OUT.gguf`")
    experts = gguf.metadata.get(f"{arch}.expert_count")
    if isinstance(experts, int) and experts > 0:  # (Mixtral is a "llama" whose FFNs are experts)
        raise ValueError(f"{gguf.path} is a mixture-of-experts model ({arch}.expert_count = {experts}), which "
                         "heron does not load from GGUF: serve its Hugging Face directory instead")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; heron reads GGUF files of "
            f"{sorted(GGUF_ARCHITECTURES)} (use a Hugging Face directory for other models)"
        )
    return GGUF_ARCHITECTURES[arch]


def _rope_scaling(get: Callable[..., Any], context_length: int, path: str) -> dict[str, Any]:
    """llama.cpp's ``rope.scaling.*`` keys as transformers' rope parameters (a
    scaling heron does not run is said so, not called damaged metadata)."""
    scaling_type = get("rope.scaling.type")
    if scaling_type in (None, "none"):
        return {}
    factor = float(get("rope.scaling.factor", 1.0))
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": factor}
    if scaling_type == "yarn" and not get("rope.scaling.yarn_log_multiplier"):
        yarn = {"rope_type": "yarn", "factor": factor,
                "original_max_position_embeddings": int(get("rope.scaling.original_context_length", context_length))}
        for beta in ("beta_fast", "beta_slow"):
            if get(f"rope.scaling.yarn_{beta}") is not None:
                yarn[beta] = float(get(f"rope.scaling.yarn_{beta}"))
        return yarn
    if scaling_type == "yarn":
        raise GGUFFormatError(f"{path}: YaRN rope scaling with rope.scaling.yarn_log_multiplier (DeepSeek's "
                              "attention scaling) is not supported; heron runs plain YaRN and linear scaling")
    raise GGUFFormatError(f"{path}: GGUF rope scaling {scaling_type!r} is not supported (supported: linear, yarn)")


def _end_tokens(meta: dict[str, Any]) -> int | list[int] | None:
    """The tokens that end generation: EOS, and llama.cpp's end-of-turn and
    end-of-message tokens where the file names them (Llama 3.1's <|eom_id|>, a
    chat model's <|im_end|> beside a base EOS): one id, or a list of them."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = meta.get(key)
        if isinstance(value, int) and value not in ids:
            ids.append(value)
    if len(ids) <= 1:
        return ids[0] if ids else None
    return ids


def gguf_to_hf_config(gguf: GGUFFile) -> ArchConfig:
    """Build the model config (the fields transformers' config would hold) from the
    GGUF metadata; metadata missing or of the wrong kind is a ``GGUFFormatError``
    naming the file (it was a TypeError traceback from ``int(None)``). A file that is
    no model (an adapter, a split's part) or of an architecture heron does not run
    is said so as it is, not as damaged."""
    model_type, architecture = gguf_architecture(gguf)
    try:
        return _hf_config(gguf, model_type, architecture)
    except GGUFFormatError:
        raise
    except (TypeError, ValueError, KeyError, ZeroDivisionError, OverflowError) as exc:
        raise GGUFFormatError(f"{gguf.path}: the GGUF metadata is damaged or incomplete ({exc})") from exc


def _hf_config(gguf: GGUFFile, model_type: str, architecture: str) -> ArchConfig:
    meta = gguf.metadata
    arch = gguf.architecture

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    def required(key: str) -> int:
        value = get(key)
        if not isinstance(value, int) or value <= 0:
            raise GGUFFormatError(f"{gguf.path}: the GGUF metadata has no valid {arch}.{key} ({value!r})")
        return value

    num_heads = required("attention.head_count")
    hidden_size = required("embedding_length")
    head_dim = int(get("attention.key_length", hidden_size // num_heads))
    vocab_size = int(get("vocab_size", len(meta.get("tokenizer.ggml.tokens", []))))
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))}
    rope_parameters.update(_rope_scaling(get, int(get("context_length", 2048)), gguf.path))
    num_kv_heads = int(get("attention.head_count_kv", num_heads))
    if num_kv_heads <= 0 or num_heads % num_kv_heads:  # (it served a prompt of one token, then the engine died)
        raise GGUFFormatError(f"{gguf.path}: {arch}.attention.head_count_kv is {num_kv_heads}, which does not "
                              f"divide {arch}.attention.head_count ({num_heads})")
    kwargs: dict[str, Any] = dict(
        model_type=model_type,
        architectures=[architecture],
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=required("feed_forward_length"),
        num_hidden_layers=required("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(get("context_length", 2048)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=rope_parameters,
        tie_word_embeddings="output.weight" not in gguf.tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=_end_tokens(meta),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )
    if model_type in ("llama", "qwen3"):  # (Qwen2 always has Q/K/V biases; Mistral never has any)
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in gguf.tensors
    if get("attention.sliding_window") is not None:
        kwargs["sliding_window"] = int(get("attention.sliding_window"))
    config = arch_config_from_dict(kwargs)
    _check_tensors(gguf, config)
    if _ROPE_FREQS in gguf.tensors:
        config.heron_rope_freq_factors = gguf.dequantize(_ROPE_FREQS).tolist()
    return config


def _check_tensors(gguf: GGUFFile, config: ArchConfig) -> None:
    """Every tensor the model needs is in the file, in the shape the metadata
    implies, no layer lies past ``block_count`` and no tensor is one the model
    does not read: checked from the header,
    which every process reads (such a file failed only as the engine core loaded
    it, with a traceback, after writing a float copy to the weight cache)."""
    expected = _expected_shapes(config)
    if config.tie_word_embeddings:
        expected.pop("output.weight")
    layers = config.num_hidden_layers
    beyond = sorted({int(match.group(1)) for match in map(_LAYER_PATTERN.match, gguf.tensors)
                     if match is not None and int(match.group(1)) >= layers})
    if beyond:
        raise GGUFFormatError(f"{gguf.path}: the file holds tensors of layer {beyond[0]}, but its metadata says "
                              f"{gguf.architecture}.block_count = {layers}")
    unread = [name for name in gguf.tensors if name not in expected and name != _ROPE_FREQS]
    if unread:  # (they failed in the engine core as "unexpected tensor", or with no place in the model)
        raise GGUFFormatError(f"{gguf.path}: the file holds {len(unread)} tensor(s) heron's {config.model_type} "
                              f"model does not read ({', '.join(unread[:4])}{', ...' if len(unread) > 4 else ''})")
    if _ROPE_FREQS in gguf.tensors:
        expected[_ROPE_FREQS] = (config.head_dim // 2,)
    missing = [name for name in expected if name not in gguf.tensors]
    if missing:
        raise GGUFFormatError(f"{gguf.path}: the file lacks {len(missing)} of the model's tensors "
                              f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}): an incomplete "
                              "download or export, or metadata that does not match the tensors?")
    for name, shape in expected.items():
        if gguf.tensors[name].shape != shape:
            raise GGUFFormatError(f"{gguf.path}: tensor {name!r} has shape {gguf.tensors[name].shape}, but the "
                                  f"metadata implies {shape}")


def _expected_shapes(config: ArchConfig) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> shape (PyTorch order) of every tensor the model reads."""
    hidden, inner, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_size, kv_size = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_layer: dict[str, tuple[int, ...]] = {
        "attn_norm.weight": (hidden,), "ffn_norm.weight": (hidden,),
        "attn_q.weight": (q_size, hidden), "attn_k.weight": (kv_size, hidden), "attn_v.weight": (kv_size, hidden),
        "attn_output.weight": (hidden, q_size),
        "ffn_gate.weight": (inner, hidden), "ffn_up.weight": (inner, hidden), "ffn_down.weight": (hidden, inner),
    }
    # as the native attention has them (models/llama.py): Qwen2's Q/K/V biases always, Llama's and Qwen3's
    # four with attention_bias
    if config.model_type == "qwen2" or getattr(config, "attention_bias", False):
        per_layer |= {"attn_q.bias": (q_size,), "attn_k.bias": (kv_size,), "attn_v.bias": (kv_size,)}
    if config.model_type in ("llama", "qwen3") and getattr(config, "attention_bias", False):
        per_layer["attn_output.bias"] = (hidden,)
    if config.model_type == "qwen3":
        per_layer |= {"attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,)}
    shapes = {"token_embd.weight": (config.vocab_size, hidden), "output_norm.weight": (hidden,),
              "output.weight": (config.vocab_size, hidden)}
    for layer in range(config.num_hidden_layers):
        shapes |= {f"blk.{layer}.{name}": shape for name, shape in per_layer.items()}
    return shapes


def _unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of Q/K rows (per head: pairs -> halves)."""
    out_features = weight.shape[0]
    head_dim = out_features // num_heads
    rest = weight.shape[1:]
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *rest)
        .swapaxes(1, 2)
        .reshape(out_features, *rest)
    )


def iterate_gguf_weights(gguf: GGUFFile, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, float32 tensor) for every tensor of the file."""
    import torch

    permute_qk = gguf.architecture == "llama"
    num_heads = int(hf_config.num_attention_heads)
    num_kv_heads = int(hf_config.num_key_value_heads)
    for name in gguf.tensors:
        if name == _ROPE_FREQS:
            continue  # already folded into the config
        hf_name = _GLOBAL_TENSOR_NAMES.get(name)
        array = gguf.dequantize(name)
        if hf_name is None:
            match = _LAYER_PATTERN.match(name)
            if match is None or match.group(2) not in _LAYER_TENSOR_NAMES:
                raise ValueError(f"unexpected tensor {name!r} in GGUF file {gguf.path}")
            layer, kind, suffix = match.groups()
            hf_name = f"model.layers.{layer}.{_LAYER_TENSOR_NAMES[kind]}.{suffix}"
            if permute_qk and kind == "attn_q":
                array = _unpermute_rotary_rows(array, num_heads)
            elif permute_qk and kind == "attn_k":
                array = _unpermute_rotary_rows(array, num_kv_heads)
        if not array.flags.writeable:  # a view into the read-only memory map
            array = array.copy()
        yield hf_name, torch.from_numpy(np.ascontiguousarray(array))


# the linear layers' tensors (not norms, embeddings or the output head)
_LINEAR_KINDS = frozenset(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"))


def linear_weight_types(gguf: GGUFFile) -> set[str]:
    """The GGML types (``Q4_1``, ``Q8_0``, ``F16``...) of the file's linear-layer weights."""
    from gguf import GGMLQuantizationType

    types = set()
    for name, info in gguf.tensors.items():
        match = _LAYER_PATTERN.match(name)
        if match is not None and match.group(2) in _LINEAR_KINDS and match.group(3) == "weight":
            types.add(GGMLQuantizationType(info.ggml_type).name)
    return types
