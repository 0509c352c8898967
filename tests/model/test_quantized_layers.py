"""Which layer each weight gets under a low-bit mode: the LM head is int8 under
int4 whether tied or not (an untied head, a native model's or a transformers
model's, took int4, and a GGUF's Q6_K head lost most of its precision:
top-1 agreement with float32 fell from 97% to 83% in the review's run), and a
layer whose input size is not a multiple of 32 (int8 weights, bf16 inputs)
computes finite, right values at every batch size (torch's int8 weight-only
kernel read out of bounds at input sizes 4 past a multiple of 8: NaN, 1e30,
then a segfault)."""

from __future__ import annotations

import pytest
import torch

from heron import LLM, SamplingParams
from heron.models.quantization import Int4WeightOnlyLinear, Int8WeightInt8InputLinear, Int8WeightOnlyLinear
from tests.model.conftest import build_tiny_model, random_prompts


def _model(llm: LLM) -> torch.nn.Module:
    return llm.engine.engine_core.model_runner.model


def _head(model: torch.nn.Module) -> torch.nn.Module:
    hf_model = getattr(model, "hf_model", None)
    return hf_model.get_output_embeddings() if hf_model is not None else model.lm_head


@pytest.mark.parametrize("family", ["qwen2", "llama3-rope-untied"])
def test_an_untied_native_head_is_int8_under_int4(tiny_model_dir, family):
    llm = LLM(tiny_model_dir(family), quantization="int4", dtype="float32", max_model_len=64, num_kv_blocks=16)
    model = _model(llm)
    assert isinstance(_head(model), Int8WeightInt8InputLinear)
    assert llm.engine.engine_core.model_runner.compute_path["linear"] == "heron int4 C kernels"
    assert isinstance(model.layers[0].mlp.down_proj, Int4WeightOnlyLinear)


def test_an_untied_transformers_head_is_int8_under_int4(tmp_path, embedded_tokenizer):
    directory = build_tiny_model(str(tmp_path), dict(model_type="phi3", pad_token_id=0, tie_word_embeddings=False),
                                 embedded_tokenizer)
    llm = LLM(directory, quantization="int4", dtype="float32", max_model_len=64, num_kv_blocks=16)
    assert isinstance(_head(_model(llm)), Int8WeightInt8InputLinear)
    output = llm.generate(random_prompts([9]), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                          use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 4


@pytest.mark.parametrize("in_features", [36, 52, 100, 40])
@pytest.mark.parametrize("rows", [1, 2, 7, 24, 40])
def test_an_int8_weight_only_layer_is_right_at_any_input_size(in_features, rows):
    generator = torch.Generator().manual_seed(in_features * 100 + rows)
    weight = torch.randn(64, in_features, generator=generator)
    layer = Int8WeightOnlyLinear(weight)
    x = torch.randn(rows, in_features, generator=generator)
    expected = torch.nn.functional.linear(x.to(torch.bfloat16).double(), layer.dequantized.double())
    out = layer(x)
    assert torch.isfinite(out).all()
    assert torch.allclose(out.double(), expected, rtol=1e-2, atol=1e-2)


def test_a_model_with_odd_layer_sizes_runs_under_int4(tmp_path, embedded_tokenizer):
    """intermediate_size 100: the down projection's input is no multiple of 32."""
    directory = build_tiny_model(str(tmp_path), dict(model_type="llama", intermediate_size=100), embedded_tokenizer)
    llm = LLM(directory, quantization="int4", dtype="float32", max_model_len=64, num_kv_blocks=16)
    assert isinstance(_model(llm).layers[0].mlp.down_proj, Int8WeightOnlyLinear)
    # the compute path says how many layers the kernels run (it said all: here the two down projections are not)
    path = llm.engine.engine_core.model_runner.compute_path["linear"]
    assert path == "heron int4 C kernels (7 of 9 linear layers; the rest in torch)", path
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
    for output in llm.generate(random_prompts([5, 12, 20]), params, use_tqdm=False):
        logprobs = [entry[token].logprob for token, entry in zip(output.outputs[0].token_ids,
                                                                 output.outputs[0].logprobs)]
        assert all(-1e4 < value <= 0 for value in logprobs)


def test_a_low_bit_draft_under_a_bf16_target_is_refused(tiny_model_dir):
    """The draft runs in the target's dtype; an int8 draft under bfloat16 took a
    slow path with a warning only, where the same for the target is an error."""
    from heron.engine.args import EngineArgs

    directory = tiny_model_dir("llama")
    speculative = {"method": "draft_model", "model": directory, "num_speculative_tokens": 2, "quantization": "int8"}
    with pytest.raises(ValueError, match="speculative_config.quantization='int8' runs its kernels on float32"):
        EngineArgs(model=directory, dtype="bfloat16", speculative_config=speculative).create_engine_config()
    config = EngineArgs(model=directory, dtype="float32", speculative_config=speculative).create_engine_config()
    assert config.speculative is not None


def test_quantization_none_means_as_the_model_says():
    """vLLM's default quantization is None ("as the model says"): code written for
    it passed None and was refused; it is "auto" (the embedded GGUF: int4)."""
    from heron.engine.args import EngineArgs

    assert EngineArgs(quantization=None, max_model_len=256).create_engine_config().model.quantization == "int4"


def test_the_compute_path_counts_the_experts_a_low_bit_mode_leaves_in_torch(tiny_model_dir):
    """transformers' MoE blocks hold their experts as stacked matrices, not linear
    layers: they stay in float, and the label said the C kernels ran every layer."""
    llm = LLM(tiny_model_dir("qwen2-moe-sliding"), quantization="int4", dtype="float32", max_model_len=64,
              num_kv_blocks=16)
    path = llm.engine.engine_core.model_runner.compute_path["linear"]
    assert path.startswith("heron int4 C kernels (") and path.endswith(" linear layers; the rest in torch)"), path
