"""Async scheduling on a tiny random Llama (float32, CPU: the same code path as
CUDA, without the overlap): greedy output token-identical to transformers in
every batching situation, sampled output identical to synchronous scheduling,
and stops, aborts and requests that need synchronous steps handled."""

from __future__ import annotations

import pytest

from heron import LLM, SamplingParams
from heron.worker.step_inputs import PendingInputIds
from tests.model.conftest import load_reference, random_prompts, reference_greedy

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    directory = tiny_model_dir("llama")
    prompts = random_prompts([5, 17, 33, 70, 1, 48], seed=8)
    reference = load_reference(directory)
    return directory, prompts, [reference_greedy(reference, prompt, NEW_TOKENS) for prompt in prompts]


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("situation", [
    dict(num_kv_blocks=64),
    dict(num_kv_blocks=64, max_num_batched_tokens=24),  # chunked prefill mixed with decodes
    dict(num_kv_blocks=12, block_size=8, max_model_len=96),  # too small: preemption
])
def test_greedy_matches_transformers(llama, situation, monkeypatch):
    directory, prompts, expected = llama
    llm = LLM(directory, dtype="float32", **{"max_model_len": 128, **situation}, async_scheduling=True)
    core = llm.engine.engine_core
    assert core.async_scheduling
    written = {"in order": 0, "indexed": 0}  # how the in-flight step's tokens reached the inputs
    write_into = PendingInputIds.write_into

    def counting_write_into(pending, input_ids):
        written["in order" if pending.positions is None else "indexed"] += 1
        write_into(pending, input_ids)

    monkeypatch.setattr(PendingInputIds, "write_into", counting_write_into)
    for _ in range(2):  # the second round starts from prefix-cache hits
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    # steady decoding takes the shortcut; decodes mixed with prompt chunks take the index path
    assert written["in order"] > 0
    if "max_num_batched_tokens" in situation:
        assert written["indexed"] > 0
    if "block_size" in situation:
        assert core.scheduler.num_preemptions > 0
    # a stop found a step late leaks no token; max_tokens is exact
    stops = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0, stop_token_ids=[tokens[3]]) for tokens in expected]
    for output, tokens in zip(llm.generate(prompts, stops, use_tqdm=False), expected):
        assert output.outputs[0].token_ids == tokens[: tokens.index(tokens[3]) + 1]
        assert output.outputs[0].finish_reason == "stop"
    # the step launched before the stops were seen is taken, not left until the next request (its buffers
    # held, and the tiers' idle flush waiting for it)
    assert not core.has_step_in_flight
    short = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in short] == [tokens[:1] for tokens in expected]
    manager = core.scheduler.kv_cache_manager
    manager.check_integrity()
    assert manager.num_free_blocks == manager.num_blocks


def test_sampling_and_sync_only_requests_match_sync_scheduling(llama):
    directory, prompts, _ = llama
    params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, top_p=0.9, seed=3 + i, logprobs=2, min_tokens=4)
              for i in range(len(prompts))]
    # a penalised request needs its previous token on the host: steps turn synchronous
    params[2] = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, repetition_penalty=1.3)
    results = []
    for async_scheduling in (False, True):
        llm = LLM(directory, dtype="float32", max_model_len=128, num_kv_blocks=64, async_scheduling=async_scheduling)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, [sorted(lp.items()) for lp in o.outputs[0].logprobs or []])
                        for o in outputs])
    assert results[0] == results[1]


def test_abort_while_a_step_is_in_flight(llama):
    directory, prompts, expected = llama
    llm = LLM(directory, dtype="float32", max_model_len=128, num_kv_blocks=64, async_scheduling=True)
    engine = llm.engine
    ids = []
    for prompt in prompts[:3]:
        request_id = engine.next_request_id()
        engine.add_request(request_id, engine.input_processor.process_prompt(prompt), GREEDY)
        ids.append(request_id)
    finished = {}
    for step in range(200):
        if not engine.has_unfinished_requests():
            break
        if step == 4:
            engine.abort_request(ids[1])  # its next step is already launched
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    assert finished[ids[0]] == expected[0] and finished[ids[2]] == expected[2]
    assert ids[1] not in finished or len(finished[ids[1]]) < NEW_TOKENS
    manager = engine.engine_core.scheduler.kv_cache_manager
    manager.check_integrity()
    assert manager.num_free_blocks == manager.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_statistics_count_each_step_once(llama, async_scheduling):
    """Under async scheduling a burst's first step was reported when launched
    and again when processed, and its last step, processed in the same call as
    an empty one, not at all: heron:iteration_tokens read 6, 6, 1 ... for steps
    of 6, 1, 1 ..."""
    directory, prompts, _ = llama
    llm = LLM(directory, dtype="float32", max_model_len=128, num_kv_blocks=64, async_scheduling=async_scheduling)
    core = llm.engine.engine_core
    observed: list[int] = []
    step = core.step

    def recording_step():
        outputs = step()
        stats = outputs.scheduler_stats
        if stats is not None:
            observed.extend(tokens for tokens in (stats.earlier_step_tokens, stats.num_scheduled_tokens) if tokens)
        return outputs

    core.step = recording_step
    prompt = prompts[0]  # 5 tokens
    llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)
    assert observed == [len(prompt)] + [1] * 9
