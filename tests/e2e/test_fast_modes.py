"""Fast modes state what they change: int8 and int4 report their fidelity against
float32, and the GGUF weight cache changes nothing."""

from __future__ import annotations

import os

import pytest

from heron import LLM, SamplingParams
from heron.benchmarks.quality import compare


@pytest.fixture(scope="module")
def fp32():
    return LLM(max_model_len=1024, num_kv_blocks=128)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_modes_keep_perplexity_and_agreement(fp32, method):
    quantized = LLM(max_model_len=1024, num_kv_blocks=128, quantization=method)
    result = compare(fp32, quantized)
    assert result["perplexity"] < result["reference_perplexity"] * 1.05
    assert result["top1_agreement"] > 0.9
    [answer] = quantized.chat([{"role": "user", "content": "What is the capital of France?"}],
                         SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert "Paris" in answer.outputs[0].text


def test_int8_output_does_not_depend_on_the_batch(fp32):
    int8 = LLM(max_model_len=1024, num_kv_blocks=256, quantization="int8")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = "The grey heron stands at the edge of"
    [alone] = int8.generate(prompt, params, use_tqdm=False)
    # the same prompt beside a long one: its first steps run the large-batch path
    busy = int8.generate(["A scheduler decides, at every step, " * 20, prompt], params, use_tqdm=False)
    assert busy[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_float32_is_unchanged_by_the_weight_cache(tmp_path, monkeypatch, fp32):
    monkeypatch.setenv("HERON_CACHE_DIR", str(tmp_path))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["Herons live on every continent except", "Memory is cut into small pages of"]
    expected = [o.outputs[0].token_ids for o in fp32.generate(prompts, params, use_tqdm=False)]
    first = LLM(max_model_len=256, num_kv_blocks=64)  # dequantizes and writes the cache
    [cached_file] = os.listdir(tmp_path / "weights")
    second = LLM(max_model_len=256, num_kv_blocks=64)  # reads the cache
    for llm in (first, second):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert cached_file.endswith(".safetensors")
