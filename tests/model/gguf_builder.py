"""Write small GGUF files for tests: any tensor type, with the embedded model's
tokenizer metadata, from a tiny HF Llama's weights."""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, RopeScalingType
from gguf.quants import quantize

from heron.loader.gguf_file import GGUFFile
from heron.loader.model_source import default_model_path

QK_K = 256


def random_k_quant_rows(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random but well-scaled Q4_K / Q6_K blocks, as raw bytes [rows, bytes]."""
    rng = np.random.default_rng(seed)
    num_blocks = rows * cols // QK_K
    if qtype == Q.Q4_K:
        blocks = rng.integers(0, 256, size=(num_blocks, 144), dtype=np.uint8)
        blocks[:, 0:2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)  # d
        blocks[:, 2:4] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)  # dmin
    elif qtype == Q.Q6_K:
        blocks = rng.integers(0, 256, size=(num_blocks, 210), dtype=np.uint8)
        blocks[:, 192:208] = rng.integers(-8, 8, size=(num_blocks, 16)).astype(np.int8).view(np.uint8)
        blocks[:, 208:210] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
    else:
        raise ValueError(qtype)
    return blocks.reshape(rows, -1)


def encode(array: np.ndarray, qtype: Q, seed: int = 0) -> np.ndarray:
    if qtype == Q.F32:
        return array.astype(np.float32)
    if qtype == Q.F16:
        return array.astype(np.float16)
    if qtype in (Q.Q4_K, Q.Q6_K):
        return random_k_quant_rows(qtype, array.shape[0], array.shape[1], seed)
    return quantize(array.astype(np.float32), qtype)


def llama_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (interleaved rotary pairs)."""
    head_rows = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, head_rows, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_llama_gguf(path: str, hf_model, tensor_types: dict[str, Q], drop: Collection[str] = (),
                          extra: dict[str, np.ndarray] | None = None, keys: dict[str, int] | None = None,
                          **counts: int) -> None:
    """tensor_types maps a GGUF tensor kind ("attn_q", "token_embd", ...) to its type;
    a damaged file: ``drop``, tensors to leave out; ``extra``, float32 tensors and
    ``keys``, uint32 metadata to add; ``counts``: block_count, feed_forward_length or
    head_count_kv to write instead of the model's."""
    config = hf_model.config
    source = GGUFFile(default_model_path()).metadata
    writer = GGUFWriter(path, "llama")
    for key, value in (keys or {}).items():
        writer.add_uint32(key, value)
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array.astype(np.float32))
    writer.add_block_count(counts.get("block_count", config.num_hidden_layers))
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(counts.get("feed_forward_length", config.intermediate_size))
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(counts.get("head_count_kv", config.num_key_value_heads))
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    if config.rope_parameters.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(config.rope_parameters["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(config.rope_parameters["original_max_position_embeddings"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    if config.rope_parameters.get("rope_type") == "llama3":  # llama.cpp keeps Llama 3.1's scaling as factors
        writer.add_tensor("rope_freqs.weight", llama3_freq_factors(config))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(source["tokenizer.ggml.pre"])
    writer.add_token_list(source["tokenizer.ggml.tokens"])
    writer.add_token_types(source["tokenizer.ggml.token_type"])
    writer.add_token_merges(source["tokenizer.ggml.merges"])
    writer.add_bos_token_id(source["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(source["tokenizer.ggml.eos_token_id"])
    writer.add_chat_template(source["tokenizer.chat_template"])
    names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    }
    state = {k: v.detach().to(torch.float32).numpy() for k, v in hf_model.state_dict().items()}
    seed = 0
    for name, array in state.items():
        if name == "model.embed_tokens.weight":
            gguf_name, kind = "token_embd.weight", "token_embd"
        elif name == "model.norm.weight":
            gguf_name, kind = "output_norm.weight", "norm"
        elif name == "lm_head.weight":
            if config.tie_word_embeddings:
                continue
            gguf_name, kind = "output.weight", "output"
        else:
            layer = name.split(".")[2]
            module = ".".join(name.split(".")[3:-1])
            kind = names[module]
            gguf_name = f"blk.{layer}.{kind}.{name.rsplit('.', 1)[1]}"  # a weight or a bias
            if kind == "attn_q":
                array = llama_permute(array, config.num_attention_heads)
            elif kind == "attn_k":
                array = llama_permute(array, config.num_key_value_heads)
        if gguf_name in drop:
            continue
        qtype = Q.F32 if array.ndim == 1 else tensor_types.get(kind, Q.F32)
        seed += 1
        encoded = encode(array, qtype, seed)
        writer.add_tensor(gguf_name, encoded, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama3_freq_factors(config) -> np.ndarray:
    """What llama.cpp's converter writes as rope_freqs.weight: per frequency, how
    much llama3 scaling divides it."""
    rope = config.rope_parameters
    head_dim = config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    original, low, high, factor = (rope["original_max_position_embeddings"], rope["low_freq_factor"],
                                   rope["high_freq_factor"], rope["factor"])
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)
