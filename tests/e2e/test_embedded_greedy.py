"""heron on the embedded model against transformers on the same GGUF, float32
(asked for: "auto" picks int4 for this Q4_1 file, and bf16 on CPUs with native bf16):
greedy outputs token-identical for 8 prompts generated together, under chunked
prefill, prefix-cache hits and preemption."""

from __future__ import annotations

import pytest

from heron import LLM, SamplingParams
from tests.e2e.conftest import reference_generate

MAX_NEW_TOKENS = 24
PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colors are",
    "Q: What is the boiling point of water at sea level?\nA:",
    "1, 2, 3, 4, 5,",
    "Translate to French: 'Good morning, how are you?'\n",
    "A short poem about the sea:\n",
]
SYSTEM = (
    "You are a meticulous assistant for a library. You answer questions about books, "
    "authors, opening hours and lending rules. Be concise, accurate and friendly, and "
    "never invent a book that does not exist. If you do not know, say so plainly. "
    "The library opens from nine in the morning to six in the evening on weekdays, "
    "and from ten to four on Saturdays; it is closed on Sundays and public holidays. "
    "Members may borrow up to five books for three weeks and renew each loan twice."
)
QUESTIONS = ["Who wrote Hamlet?", "How long can I borrow a book?", "Is the library open on Sunday?",
             "Recommend a novel about the sea.", "What is an ISBN?", "Can I renew a loan online?"]


def greedy(max_tokens: int = MAX_NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def prompt_ids(embedded_tokenizer):
    return [embedded_tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(reference_model, prompt_ids):
    return [reference_generate(reference_model, ids, MAX_NEW_TOKENS) for ids in prompt_ids]


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_batched_greedy_matches_transformers(prompt_ids, expected):
    llm = LLM(dtype="float32", quantization="none", max_model_len=512)
    assert token_ids(llm.generate(prompt_ids, greedy(), use_tqdm=False)) == expected


def test_tiny_token_budget_chunks_prefill_and_still_matches(prompt_ids, expected):
    llm = LLM(dtype="float32", quantization="none", max_model_len=512, max_num_batched_tokens=8)
    assert token_ids(llm.generate(prompt_ids, greedy(), use_tqdm=False)) == expected


def test_small_kv_pool_forces_preemption_and_still_matches(prompt_ids, expected):
    # 8 requests need ~25 blocks at once; 6 blocks hold only a few
    llm = LLM(dtype="float32", quantization="none", max_model_len=64, num_kv_blocks=6, block_size=16)
    outputs = llm.generate(prompt_ids, greedy(), use_tqdm=False)
    scheduler = llm.engine.engine_core.scheduler
    assert scheduler.num_preemptions > 0
    assert token_ids(outputs) == expected
    scheduler.kv_cache_manager.check_integrity()
    assert scheduler.kv_cache_manager.num_free_blocks == 6


def test_shared_prefix_hits_the_prefix_cache_and_still_matches(reference_model, embedded_tokenizer):
    conversations = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    llm = LLM(dtype="float32", quantization="none", max_model_len=512)
    first = llm.chat(conversations[:1], greedy(), use_tqdm=False)  # fills the cache
    rest = llm.chat(conversations[1:], greedy(), use_tqdm=False)
    stats = llm.engine.engine_core.scheduler.make_stats()
    prompts = [o.prompt_token_ids for o in first + rest]
    common = next(i for i in range(len(prompts[0])) if len({p[i] for p in prompts}) > 1)
    expected_hit = common // 16 * 16  # only full blocks are shared
    assert expected_hit >= 96
    assert [o.num_cached_tokens for o in rest] == [expected_hit] * 5
    assert stats.prefix_cache_hits == 5 * expected_hit
    for output in first + rest:
        expected = reference_generate(reference_model, output.prompt_token_ids, MAX_NEW_TOKENS)
        assert output.outputs[0].token_ids == expected


def test_chat_answer_mentions_paris():
    llm = LLM(dtype="float32", quantization="none", max_model_len=256)
    [output] = llm.chat([{"role": "user", "content": "What is the capital of France?"}], greedy(32), use_tqdm=False)
    assert "Paris" in output.outputs[0].text
    assert output.outputs[0].finish_reason == "stop"
