"""Tiny random-weight models built from config dicts, saved as HF directories
(safetensors + the embedded model's tokenizer), and a reference greedy decoder
that runs transformers' own implementation."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

VOCAB_SIZE = 49152  # the embedded tokenizer's vocabulary

BASE: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.05,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=True,
)

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama"),
    "llama3-rope-untied": dict(
        model_type="llama",
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        },
    ),
    "llama-linear-rope": dict(model_type="llama",
                              rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "mistral-sliding-window": dict(model_type="mistral", sliding_window=16, head_dim=16),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=False),
    # keys transformers' Qwen2 ignores (its biases are fixed): native layers expected weights never saved
    "qwen2-stray-bias-keys": dict(model_type="qwen2", attention_bias=True, mlp_bias=True),
    "qwen3": dict(model_type="qwen3", head_dim=32),
    # Qwen's long-context setting; the original context below the prompts, so the ramp and attention factor show
    "qwen3-yarn-rope": dict(model_type="qwen3", head_dim=32, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}),
}

FALLBACK_FAMILIES: dict[str, dict[str, Any]] = {
    "gemma": dict(model_type="gemma", head_dim=16, num_key_value_heads=1, hidden_activation="gelu_pytorch_tanh"),
    "phi3": dict(model_type="phi3", pad_token_id=0),
    # heads that scale their logits (Cohere multiplies by logit_scale, Granite divides by logits_scaling): the
    # fallback computed plain logits, off by up to 1 in logprob
    "cohere": dict(model_type="cohere", logit_scale=0.5),
    "granite": dict(model_type="granite", logits_scaling=4.0),
    "hyperclovax": dict(model_type="hyperclovax", logits_scaling=4.0),  # the same key, multiplied
    # windows that reach heron's attention through the mask alone (the attention passes no sliding_window):
    # they attended over the whole context
    "qwen2-moe-sliding": dict(model_type="qwen2_moe", use_sliding_window=True, sliding_window=16, max_window_layers=1,
                              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=32),
    "phimoe-sliding": dict(model_type="phimoe", sliding_window=16, num_local_experts=4, num_experts_per_tok=2),
    # its causal LM names its decoder "language_model" but holds it as "model": it loaded, then failed at its first
    # step (real Llama 4 checkpoints, with chunked attention, are refused)
    "llama4-text-unchunked": dict(model_type="llama4_text", head_dim=16, attention_chunk_size=None,
                                  num_local_experts=2, num_experts_per_tok=1, intermediate_size_mlp=128,
                                  interleave_moe_layer_step=1, no_rope_layers=[1, 1], use_qk_norm=False),
    # num_key_value_heads (2, from BASE) that GPT-NeoX's attention ignores: the cache was sized for 2 KV heads, and
    # the first step failed
    "gpt-neox-stray-kv-heads": dict(model_type="gpt_neox", rotary_pct=0.25),
    # a native family with a RoPE type heron does not compute: transformers runs it under "auto"
    "llama-dynamic-rope": dict(model_type="llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                                    "factor": 2.0}),
}


# fallback models whose own tests say how they differ from transformers
OTHER_FALLBACK_FAMILIES: dict[str, dict[str, Any]] = {
    # LongRoPE (Phi-3's long-context RoPE) with an original context of 16: factors per frequency, short and long
    "phi3-longrope": dict(model_type="phi3", pad_token_id=0, original_max_position_embeddings=16, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
        "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.5 * i for i in range(8)]}),
}


def build_tiny_model(directory: str, family: dict[str, Any], tokenizer: Any, seed: int = 0) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {**BASE, **family}
    model_type = settings.pop("model_type")
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, embedded_tokenizer):
    """Factory: family name -> directory of that tiny model (built once)."""
    built: dict[str, str] = {}

    def make(name: str) -> str:
        if name not in built:
            family = FAMILIES.get(name) or FALLBACK_FAMILIES.get(name) or OTHER_FALLBACK_FAMILIES[name]
            directory = str(tmp_path_factory.mktemp(name.replace("/", "_")))
            built[name] = build_tiny_model(directory, family, embedded_tokenizer)
        return built[name]

    return make


def load_reference(directory: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding with transformers, recomputing the whole sequence each step
    (no cache, no batching: the plainest possible reference)."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@torch.inference_mode()
def reference_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: log-softmax at positions 0..n-2 (scoring tokens 1..n-1)."""
    logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(10, VOCAB_SIZE - 10, (n,), generator=generator).tolist() for n in lengths]


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
