"""Which implementation runs a checkpoint (models/implementation.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

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
