"""Speculative decoding on a tiny random Llama, float32: greedy output with
n-gram or draft-model drafts is token-identical to transformers' greedy decoding in every
batching situation (chunked prefill, prefix-cache hits, preemption, mixed with
requests that have no drafts), and seeded sampled output with drafts is the
output without them."""

from __future__ import annotations

import pytest
import torch

from heron import LLM, SamplingParams
from tests.model.conftest import FAMILIES, build_tiny_model, load_reference, random_prompts, reference_greedy

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
NEW_TOKENS = 16


def looping_prompts(reference) -> list[list[int]]:
    """Prompts that contain their own continuation (so n-gram drafts match): a
    random prompt, its greedy continuation, then the prompt again."""
    prompts = []
    for prompt in random_prompts([6, 9, 20, 31], seed=3):
        continuation = reference_greedy(reference, prompt, 8)
        prompts.append(prompt + continuation + prompt)
    return prompts + random_prompts([5, 40], seed=4)


def test_greedy_is_identical_to_transformers_in_every_batching_situation(tiny_model_dir):
    directory = tiny_model_dir("llama")
    reference = load_reference(directory)
    prompts = looping_prompts(reference)
    expected = [reference_greedy(reference, prompt, NEW_TOKENS) for prompt in prompts]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)

    # chunked prefill mixed with verification steps (24-token budget)
    llm = LLM(directory, dtype="float32", max_model_len=128, max_num_batched_tokens=24, num_kv_blocks=64,
              speculative_config=NGRAM)
    for round_ in range(2):  # the second round starts from prefix-cache hits
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected, f"round {round_}"
    scheduler = llm.engine.engine_core.scheduler
    assert scheduler.kv_cache_manager.prefix_cache_stats.hits > 0
    assert scheduler.spec_stats.num_accepted_tokens > 0 and scheduler.spec_stats.num_drafts > 0
    # mixed: requests that may not draft (max_tokens=1 leaves no room) beside ones that do
    mixed = llm.generate(prompts[:3], [greedy, SamplingParams(max_tokens=1, temperature=0), greedy], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == expected[0] and mixed[2].outputs[0].token_ids == expected[2]
    assert mixed[1].outputs[0].token_ids == expected[1][:1]
    scheduler.kv_cache_manager.check_integrity()
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks

    # preemption: a pool too small for every request at once
    small = LLM(directory, dtype="float32", max_model_len=96, num_kv_blocks=14, block_size=8, speculative_config=NGRAM)
    outputs = small.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert small.engine.engine_core.scheduler.num_preemptions > 0


@pytest.fixture(scope="module")
def small_draft_dir(tmp_path_factory, embedded_tokenizer):
    """A one-layer draft with other random weights: it agrees with the target
    only sometimes, so both acceptance and rejection happen."""
    directory = str(tmp_path_factory.mktemp("draft"))
    return build_tiny_model(directory, {**FAMILIES["llama"], "num_hidden_layers": 1}, embedded_tokenizer, seed=7)


def test_draft_model_greedy_is_identical_in_every_batching_situation(tiny_model_dir, small_draft_dir):
    directory = tiny_model_dir("llama")
    reference = load_reference(directory)
    prompts = looping_prompts(reference)
    expected = [reference_greedy(reference, prompt, NEW_TOKENS) for prompt in prompts]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    # the target as its own draft: every draft must be accepted, which holds only
    # if the draft's paged K/V (catch-up, lookahead slots, prefix hits) is right
    for draft, situation in ((directory, dict(max_num_batched_tokens=24, num_kv_blocks=64)),
                             (small_draft_dir, dict(max_num_batched_tokens=24, num_kv_blocks=64)),
                             (directory, dict(num_kv_blocks=18, block_size=8))):
        llm = LLM(directory, dtype="float32", max_model_len=96, **situation,
                  speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3})
        for _ in range(2):  # the second round starts from prefix-cache hits
            outputs = llm.generate(prompts, greedy, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outputs] == expected, (draft, situation)
        counters = llm.engine.engine_core.scheduler.spec_stats
        if draft == directory:
            assert counters.num_accepted_tokens == counters.num_draft_tokens > 0
        else:
            assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
        if "block_size" in situation:
            assert llm.engine.engine_core.scheduler.num_preemptions > 0
        manager = llm.engine.engine_core.scheduler.kv_cache_manager
        manager.check_integrity()
        assert manager.num_free_blocks == manager.num_blocks


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_seeded_samples_are_the_tokens_drawn_without_drafts(tiny_model_dir, method):
    """Many seeded samples (top_k keeps some drafts accepted, some rejected), with
    and without drafts: each request's tokens are the same, also when a small
    step budget trims its drafts. A seeded row's noise depends only on its seed
    and position, and a certain draft is accepted when the row's own draw is it;
    a uniform for the test and then a draw from the residual took two draws from
    the row's generator, so seeded output changed with the batch and differed
    from plain sampling (the distribution was right, the tokens were not
    reproducible). The tiny random model repeats itself, so its own outputs give
    the n-gram drafts."""
    directory = tiny_model_dir("llama")
    reference = load_reference(directory)
    prompt = looping_prompts(reference)[1]
    num_samples = 300
    params = [SamplingParams(max_tokens=6, temperature=1.0, top_k=3, seed=seed, ignore_eos=True)
              for seed in range(num_samples)]
    kwargs = dict(dtype="float32", max_model_len=128, num_kv_blocks=256, max_num_seqs=256)
    plain = [o.outputs[0].token_ids for o in LLM(directory, **kwargs).generate([prompt] * num_samples, params,
                                                                                use_tqdm=False)]
    # the target as its own (greedy) draft: its drafts sit in the top-k
    config = NGRAM if method == "ngram" else {"method": "draft_model", "model": directory, "num_speculative_tokens": 3}
    llm = LLM(directory, speculative_config=config, **kwargs)
    spec = [o.outputs[0].token_ids for o in llm.generate([prompt] * num_samples, params, use_tqdm=False)]
    stats = llm.engine.engine_core.scheduler.spec_stats
    assert 50 < stats.num_accepted_tokens < stats.num_draft_tokens  # some accepted, some rejected
    assert spec == plain
    trimmed = LLM(directory, speculative_config=config, **{**kwargs, "max_num_batched_tokens": 10})
    few = 40
    assert [o.outputs[0].token_ids for o in trimmed.generate([prompt] * few, params[:few], use_tqdm=False)] \
        == plain[:few]


def test_a_draft_model_runs_into_the_model_length_and_catches_up_on_prompt_chunks(tiny_model_dir):
    """The target as its own draft: every draft is right, so acceptance shows
    whether the draft's K/V is. Two faults: a step of prompt chunks alone (no
    request sampling) skipped the draft's catch-up, so its K/V of those chunks
    was never written and most drafts were rejected; and a request reaching
    max_model_len drafted past it, indexing past its block table (IndexError).
    A draft whose context is exactly max_model_len serves it to the end (it was
    refused: the check asked for room for the drafts past the limit, where no
    draft goes)."""
    directory = tiny_model_dir("llama")
    reference = load_reference(directory)
    spec = {"method": "draft_model", "model": directory, "num_speculative_tokens": 3}
    [prompt] = random_prompts([60], seed=5)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    llm = LLM(directory, dtype="float32", max_model_len=128, max_num_batched_tokens=16, block_size=16,
              num_kv_blocks=32, speculative_config=spec)  # a 16-token budget: the prompt in four chunks
    [output] = llm.generate([prompt], greedy, use_tqdm=False)
    assert output.outputs[0].token_ids == reference_greedy(reference, prompt, 24)
    stats = llm.engine.engine_core.scheduler.spec_stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens  # the draft is the target: nothing rejected
    # the draft's K/V is the target's wherever the target wrote (same weights; the prompt's first three chunks
    # were missing, zeros)
    runner = llm.engine.engine_core.model_runner
    for target, draft in zip(runner.model.attention_layers(), runner.proposer.layers):
        written = target.kv_cache.flatten(3).abs().sum(-1) > 0  # [K/V, block, slot]
        assert written.sum() >= 2 * 60
        assert torch.allclose(draft.kv_cache[written], target.kv_cache[written], atol=1e-4)

    short = LLM(directory, dtype="float32", max_model_len=64, block_size=16, num_kv_blocks=32,
                speculative_config=spec)
    [prompt] = random_prompts([58], seed=5)
    [output] = short.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                              use_tqdm=False)
    assert output.outputs[0].finish_reason == "length"
    assert output.outputs[0].token_ids == reference_greedy(reference, prompt, 6)

    full = LLM(directory, dtype="float32", max_model_len=256, block_size=16, num_kv_blocks=32,
               speculative_config=spec)  # the tiny models' whole context, the draft's too
    [prompt] = random_prompts([240], seed=6)
    [output] = full.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                             use_tqdm=False)
    assert output.outputs[0].finish_reason == "length"
    assert output.outputs[0].token_ids == reference_greedy(reference, prompt, 16)
