"""Features beyond plain decoding, on CUDA (Triton attention, CUDA graphs):
speculative decoding (n-gram and draft model), structured output, async
scheduling and ``torch.compile`` — greedy float32 output token-identical to
transformers, constrained output valid.

``HERON_TEST_DEVICE=cpu`` runs these on the CPU (no graphs) to check the tests
themselves where no GPU is present: with the torch attention backend, or with
``HERON_TEST_ATTENTION_BACKEND=triton`` with heron's Triton kernels in Triton's
CPU interpreter."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from heron import LLM, SamplingParams
from heron.sampling_params import StructuredOutputsParams
from tests.gpu.conftest import byte_level_tokenizer, word_tokenizer

pytestmark = pytest.mark.gpu

DEVICE = os.environ.get("HERON_TEST_DEVICE", "cuda")
ATTENTION_BACKEND = os.environ.get("HERON_TEST_ATTENTION_BACKEND", "auto")
VOCAB = 512
NEW_TOKENS = 16


def _save_tiny_llama(directory: str, tokenizer, eos_token_id: int) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                         initializer_range=0.05, tie_word_embeddings=False, bos_token_id=1, eos_token_id=eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def word_llama(tmp_path_factory) -> str:
    return _save_tiny_llama(str(tmp_path_factory.mktemp("word-llama")), word_tokenizer(VOCAB), eos_token_id=2)


@pytest.fixture(scope="module")
def byte_llama(tmp_path_factory) -> str:
    """A tiny model whose tokenizer spells any text byte by byte (structured output)."""
    return _save_tiny_llama(str(tmp_path_factory.mktemp("byte-llama")), byte_level_tokenizer(), eos_token_id=0)


@pytest.fixture(scope="module")
def reference(word_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(word_llama, dtype=torch.float32,
                                                attn_implementation="eager").to(DEVICE).eval()


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(torch.tensor([ids], device=DEVICE)).logits[0, -1].argmax()))
    return ids[len(prompt):]


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def looping_prompts(reference) -> list[list[int]]:
    """Prompts holding their own continuation, so n-gram drafts get accepted."""
    looping = []
    for prompt in random_prompts([6, 9, 20, 31], seed=3):
        looping.append(prompt + reference_greedy(reference, prompt, 8) + prompt)
    return looping + random_prompts([5, 40, 70], seed=4)


def _llm(directory: str, **kwargs) -> LLM:
    return LLM(directory, dtype="float32", device=DEVICE, attention_backend=ATTENTION_BACKEND,
               **{"max_model_len": 256, **kwargs})


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("speculative", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
    "draft_model",
])
def test_speculative_decoding_greedy_matches_transformers(word_llama, reference, speculative):
    if speculative == "draft_model":  # the target as its own draft: every draft must be accepted
        speculative = {"method": "draft_model", "model": word_llama, "num_speculative_tokens": 3}
    prompts = looping_prompts(reference)
    expected = [reference_greedy(reference, prompt, NEW_TOKENS) for prompt in prompts]
    situations = (dict(max_num_batched_tokens=24, num_kv_blocks=96),
                  dict(num_kv_blocks=24, block_size=8, max_model_len=128))
    for situation in situations:
        llm = _llm(word_llama, speculative_config=speculative, **situation)
        for round_ in range(2):  # the second round starts from prefix-cache hits
            outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outputs] == expected, (situation, round_)
        stats = llm.engine.engine_core.scheduler.spec_stats
        assert stats.num_accepted_tokens > 0
        if speculative["method"] == "draft_model":
            assert stats.num_accepted_tokens == stats.num_draft_tokens
        llm.engine.engine_core.scheduler.kv_cache_manager.check_integrity()


def test_structured_output_is_valid_beside_plain_requests(byte_llama):
    llm = _llm(byte_llama, num_kv_blocks=128)
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode("Say something: ")
    constraints = [
        StructuredOutputsParams(choice=["red", "green", "blue"]),
        StructuredOutputsParams(regex=r"[a-z]{3,8}@[a-z]{2,5}\.com"),
        StructuredOutputsParams(json=schema, disable_any_whitespace=True),
    ]
    plain = SamplingParams(max_tokens=24, temperature=0)
    params = [SamplingParams(max_tokens=64, temperature=0.8, seed=seed, structured_outputs=c)
              for seed in range(4) for c in constraints]
    outputs = llm.generate([prompt] * (len(params) + 1), params + [plain], use_tqdm=False)
    alone = llm.generate([prompt], plain, use_tqdm=False)[0]
    assert outputs[-1].outputs[0].token_ids == alone.outputs[0].token_ids  # masks stay on their rows
    for param, output in zip(params, outputs):
        text = output.outputs[0].text
        assert output.outputs[0].finish_reason == "stop", text
        constraint = param.structured_outputs
        if constraint.choice:
            assert text in constraint.choice
        elif constraint.regex:
            assert re.fullmatch(constraint.regex, text), text
        else:
            value = json.loads(text)  # (jsonschema is not installed on the GPU machine)
            assert set(value) == {"a", "b"} and type(value["a"]) is bool and value["b"] in ("x", "y"), text


@pytest.mark.parametrize("situation", [
    dict(num_kv_blocks=256),
    dict(num_kv_blocks=256, max_num_batched_tokens=32),  # chunked prefill mixed with decodes
    dict(num_kv_blocks=11, max_model_len=160),  # too small: preemption
])
def test_async_scheduling_greedy_matches_transformers(word_llama, reference, situation):
    prompts = random_prompts([5, 17, 33, 70, 1, 128, 16, 40], seed=0)
    expected = [reference_greedy(reference, prompt, NEW_TOKENS) for prompt in prompts]
    llm = _llm(word_llama, **situation, async_scheduling=True)
    assert llm.engine.engine_core.async_scheduling
    for _ in range(2):  # the second round starts from prefix-cache hits
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    # stops found one step late must not leak a token: EOS, stop ids, max_tokens
    stops = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0, stop_token_ids=[e[3]]) for e in expected]
    for output, tokens in zip(llm.generate(prompts, stops, use_tqdm=False), expected):
        assert output.outputs[0].token_ids == tokens[: tokens.index(tokens[3]) + 1]
    manager = llm.engine.engine_core.scheduler.kv_cache_manager
    manager.check_integrity()
    assert manager.num_free_blocks == manager.num_blocks


def test_async_scheduling_sampling_matches_sync(word_llama):
    """Seeded sampling, logprobs and min_tokens give the same result with and
    without async scheduling."""
    prompts = random_prompts([7, 30, 12, 50], seed=5)
    params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, top_p=0.9, top_k=50, seed=11 + i,
                             logprobs=2, min_tokens=4) for i in range(len(prompts))]
    results = []
    for async_scheduling in (False, True):
        llm = _llm(word_llama, num_kv_blocks=128, async_scheduling=async_scheduling)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, [sorted(lp) for lp in o.outputs[0].logprobs]) for o in outputs])
    assert results[0] == results[1]


@pytest.mark.skipif(DEVICE != "cuda", reason="torch.compile is checked on CUDA")
def test_compile_greedy_matches_transformers(word_llama, reference):
    prompts = random_prompts([5, 17, 33, 70], seed=6)
    expected = [reference_greedy(reference, prompt, NEW_TOKENS) for prompt in prompts]
    llm = _llm(word_llama, num_kv_blocks=128, compile_model=True)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
