"""Which implementation runs a checkpoint (models/implementation.py)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from heron.loader.arch_config import arch_config_from_dict
from heron.models.implementation import select_implementation

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_hidden_layers": 2, "vocab_size": 256}


def described(model_impl: str, **config: object) -> SimpleNamespace:
    return SimpleNamespace(architecture="LlamaForCausalLM", hf_config=arch_config_from_dict({**LLAMA, **config}),
                           model_impl=model_impl, source_format="hf")


def test_a_float_checkpoint_of_a_native_family_runs_natively():
    assert select_implementation(described("auto")) == "native"


def test_a_checkpoint_quantized_its_own_way_runs_through_transformers_or_is_refused():
    """An FP8 checkpoint (block scales beside float8 weights) failed natively as
    "tensor ...weight_scale_inv has no place in LlamaForCausalLM", as if damaged,
    though transformers runs it."""
    fp8 = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert select_implementation(described("auto", **fp8)) == "transformers"
    with pytest.raises(ValueError, match="quant_method 'fp8'"):
        select_implementation(described("native", **fp8))


@pytest.mark.parametrize("model_type, settings, said", [
    ("mamba", {}, "keep a state between tokens"),  # recurrent: each step saw only its new tokens
    # hybrid, not flagged stateful by transformers: its layer types tell
    ("lfm2", {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"]}, "(conv layers)"),
    ("falcon", {}, "take no attention function from outside"),  # was a bare KeyError: 'heron_paged'
    # loaded, then its first step failed; and chunks were attended as the whole sequence
    ("llama4_text", {"attention_chunk_size": 16}, "attend within chunks of the sequence"),
    ("llama4_text", {"attention_chunk_size": None, "num_hidden_layers": 2, "no_rope_layers": [1, 0]},
     "by each token's position"),
    ("deepseek_v3", {"qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 8, "head_dim": 8},
     "multi-head latent attention"),  # loaded, then its first step failed on a reshape
])
def test_the_transformers_fallback_refuses_what_paged_attention_cannot_run(model_type, settings, said):
    from transformers import AutoConfig

    from heron.models.hf_fallback import check_fallback_support

    with pytest.raises(ValueError, match=said.replace("(", r"\(").replace(")", r"\)")) as info:
        check_fallback_support(AutoConfig.for_model(model_type, **settings))
    assert repr(model_type) in str(info.value)
    check_fallback_support(AutoConfig.for_model("gemma2"))  # sliding and full attention layers: runs


def test_rope_settings_are_read_as_transformers_merges_them():
    """rope_parameters without rope_theta dropped its scaling (linear x4 became
    plain RoPE), and YaRN without original_max_position_embeddings was a bare
    KeyError where transformers scales from max_position_embeddings."""
    from heron.loader.arch_config import rope_parameters_of

    merged = arch_config_from_dict({**LLAMA, "rope_theta": 5e5, "rope_parameters": {"rope_type": "linear",
                                                                                    "factor": 4.0}})
    assert rope_parameters_of(merged) == {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}
    legacy = arch_config_from_dict({**LLAMA, "max_position_embeddings": 512, "rope_scaling": {"type": "yarn",
                                                                                              "factor": 4.0}})
    assert rope_parameters_of(legacy) == {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                          "original_max_position_embeddings": 512}


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0}


@pytest.mark.parametrize("settings", [
    {"rope_scaling": LLAMA3_ROPE},  # none given: a bare KeyError at load, where transformers takes the limit
    {"original_max_position_embeddings": 32, "rope_scaling": {**LLAMA3_ROPE, "original_max_position_embeddings": 64}},
    {"original_max_position_embeddings": 32, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    {"original_max_position_embeddings": 32, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},  # unused
])
def test_the_original_context_of_a_rope_is_read_as_transformers_reads_it(settings):
    """transformers' model gives a top-level original_max_position_embeddings
    precedence over the RoPE dict's (for every model, not only Phi-3), and falls
    back to max_position_embeddings; heron read the dict's alone (other
    frequencies), and without it failed with a bare KeyError."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from heron.loader.arch_config import rope_parameters_of
    from heron.models.layers.rotary import compute_inv_freq

    values = {**LLAMA, "max_position_embeddings": 128, **settings}
    # (transformers writes into the dicts it is given)
    config = AutoConfig.for_model("llama", **copy.deepcopy({k: v for k, v in values.items() if k != "model_type"}))
    model = AutoModelForCausalLM.from_config(config)  # its init settles the RoPE's parameters (its config's say less)
    ours = rope_parameters_of(arch_config_from_dict(values))
    assert ours.get("original_max_position_embeddings") == model.config.rope_parameters.get(
        "original_max_position_embeddings")
    assert torch.equal(compute_inv_freq(16, ours), model.model.rotary_emb.inv_freq)


def test_only_a_mistral_slides_on_its_config_key_alone():
    """A Llama config carrying sliding_window (transformers' Llama ignores it)
    attended over a window."""
    from heron.loader.arch_config import sliding_window_of_layer

    assert sliding_window_of_layer(arch_config_from_dict({**LLAMA, "sliding_window": 8}), 0) is None
    mistral = arch_config_from_dict({**LLAMA, "model_type": "mistral", "sliding_window": 8})
    assert sliding_window_of_layer(mistral, 1) == 8


def test_a_native_family_with_another_activation_runs_through_transformers():
    """hidden_act gelu under "auto" was refused by the native MLP, not run by transformers."""
    assert select_implementation(described("auto", hidden_act="gelu")) == "transformers"
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported natively"):
        select_implementation(described("native", hidden_act="gelu"))


def test_longrope_factors_are_fixed_in_a_rotary_module_of_one_rope_per_layer_type():
    """Gemma 3's rotary module keeps each layer type's frequencies apart; its
    LongRoPE ones were left to change per forward call (the batch's longest
    position) while Phi-3's were fixed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from heron.models.hf_fallback import FIXED_LONGROPE, fix_longrope_factors

    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
                "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.5 * i for i in range(8)]}
    config = AutoConfig.for_model(
        "gemma3_text", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": longrope, "sliding_attention": {"rope_type": "default",
                                                                           "rope_theta": 10000.0}})
    for max_model_len, factors in ((128, "long"), (16, "short")):
        rotary = AutoModelForCausalLM.from_config(config).model.rotary_emb
        short = rotary.full_attention_original_inv_freq.clone()
        fix_longrope_factors(rotary, max_model_len)
        assert rotary.rope_type == {"full_attention": FIXED_LONGROPE, "sliding_attention": "default"}
        fixed = rotary.full_attention_inv_freq.clone()
        assert torch.equal(fixed, short) == (factors == "short")
        rotary(torch.zeros(1), torch.tensor([[3 if factors == "long" else 100]]), layer_type="full_attention")
        assert torch.equal(rotary.full_attention_inv_freq, fixed)  # a step of other positions changes nothing
