"""The host-memory KV offload tier on a tiny random Llama (float32, CPU): a
prefix evicted from a pool too small to keep it is saved to the tier, loaded
back instead of recomputed, and the greedy output stays token-identical to
transformers, alone and mixed with chunked prefill, preemption and async
scheduling; the pool's books balance afterwards."""

from __future__ import annotations

import pytest

from heron import LLM, SamplingParams
from tests.model.conftest import load_reference, random_prompts, reference_greedy

NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    directory = tiny_model_dir("llama")
    shared, = random_prompts([48], seed=21)
    tails = random_prompts([3, 9, 5], seed=22)
    fillers = random_prompts([40, 44, 36], seed=23)  # enough to push the shared prefix out of the pool
    reference = load_reference(directory)
    with_prefix = [shared + tail for tail in tails]
    expected = {tuple(prompt): reference_greedy(reference, prompt, NEW_TOKENS) for prompt in with_prefix + fillers}
    return directory, with_prefix, fillers, expected


def check(llm: LLM, prompts: list[list[int]], expected: dict) -> None:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [expected[tuple(p)] for p in prompts]


@pytest.mark.parametrize("situation", [
    dict(),
    dict(max_num_batched_tokens=16),  # chunked prefill: loaded blocks, then chunks on top of them
    dict(async_scheduling=True),
])
def test_an_evicted_prefix_is_loaded_back_not_recomputed(llama, situation):
    directory, with_prefix, fillers, expected = llama
    # 12 blocks of 8 tokens: one request's prompt and output, not two prompts' prefixes
    llm = LLM(directory, dtype="float32", block_size=8, num_kv_blocks=12, max_model_len=96,
              kv_offloading_size=0.01, **situation)
    manager = llm.engine.engine_core.scheduler.kv_cache_manager
    check(llm, with_prefix[:1], expected)
    check(llm, fillers, expected)  # evicts the shared prefix's blocks: saved to the tier
    offload = manager.offload
    assert offload is not None and offload.stats.stored >= 6
    check(llm, with_prefix[1:], expected)  # the prefix misses the pool and hits the tier
    assert offload.stats.loaded >= 6 and offload.stats.hit_tokens >= 6 * 8
    stats = llm.engine.engine_core.scheduler.make_stats()
    assert stats.kv_host_loaded == offload.stats.loaded and stats.kv_host_blocks == len(offload)
    manager.check_integrity()
    assert manager.num_free_blocks == manager.num_blocks


def test_a_batch_under_preemption_with_a_small_tier(llama):
    """Everything at once in a pool that preempts, with a tier that must evict too."""
    directory, with_prefix, fillers, expected = llama
    llm = LLM(directory, dtype="float32", block_size=8, num_kv_blocks=12, max_model_len=96,
              kv_offloading_size=4 * 2 * 8 * 64 * 4 * 2 / (1 << 30), max_num_batched_tokens=24)
    core = llm.engine.engine_core
    for _ in range(2):
        check(llm, with_prefix + fillers, expected)
    offload = core.scheduler.kv_cache_manager.offload
    assert offload is not None and offload.stats.stored > 0
    core.scheduler.kv_cache_manager.check_integrity()


def test_the_tier_needs_the_prefix_cache(llama):
    directory, *_ = llama
    with pytest.raises(ValueError, match="prefix caching"):
        LLM(directory, dtype="float32", num_kv_blocks=12, kv_offloading_size=0.01, enable_prefix_caching=False)
