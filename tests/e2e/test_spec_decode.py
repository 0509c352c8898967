"""Speculative decoding on the embedded model: n-gram drafts give the same
greedy tokens as no speculation (also under structured output, whose grammar
rolls back rejected drafts), the server takes --speculative-config, and the
spec_decode metrics move."""

from __future__ import annotations

import json

import openai
import pytest

from heron import LLM, SamplingParams
from tests.e2e.server_process import ServerProcess

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
PASSAGE = (
    "The Industrial Revolution began in Great Britain in the late eighteenth century. Steam engines, powered by "
    "coal, drove new machines in textile mills, and railways soon connected the growing cities."
)
COPY = [{"role": "user", "content": "Repeat the following text exactly, word for word:\n\n" + PASSAGE}]
FREE = [{"role": "user", "content": "Write a short poem about the autumn wind."}]
SCHEMA = {
    "type": "object",
    "properties": {"summary": {"type": "string", "maxLength": 200}, "year": {"type": "integer"}},
    "required": ["summary", "year"],
}


@pytest.fixture(scope="module")
def engines():
    # float32: greedy tokens are then identical with and without speculation (README)
    exact = dict(max_model_len=512, dtype="float32", quantization="none")
    return LLM(**exact), LLM(**exact, speculative_config=NGRAM)


def test_greedy_tokens_equal_no_speculation(engines):
    plain, spec = engines
    params = SamplingParams(max_tokens=60, temperature=0)
    expected = [o.outputs[0].token_ids for o in plain.chat([COPY, FREE], params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.chat([COPY, FREE], params, use_tqdm=False)]
    assert got == expected
    counters = spec.engine.engine_core.scheduler.spec_stats
    assert counters.num_accepted_tokens > 20  # the copy request drafts well
    scheduler = spec.engine.engine_core.scheduler
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks


def test_structured_output_with_drafts(engines):
    plain, spec = engines
    messages = [{"role": "user", "content": "Summarise as JSON with a year:\n\n" + PASSAGE}]
    params = SamplingParams(max_tokens=120, temperature=0, structured_outputs={"json": SCHEMA})
    expected = plain.chat([messages], params, use_tqdm=False)[0].outputs[0]
    before = spec.engine.engine_core.scheduler.spec_stats.num_drafts
    got = spec.chat([messages], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == expected.token_ids
    assert spec.engine.engine_core.scheduler.spec_stats.num_drafts > before
    if got.finish_reason == "stop":
        assert set(json.loads(got.text)) >= {"summary", "year"}
    else:
        assert got.text.lstrip().startswith("{")
    sampled = SamplingParams(max_tokens=120, temperature=0.8, seed=5, structured_outputs={"json": SCHEMA})
    outputs = spec.chat([messages] * 4, sampled, use_tqdm=False)
    for output in outputs:
        if output.outputs[0].finish_reason == "stop":
            assert set(json.loads(output.outputs[0].text)) >= {"summary", "year"}
        else:
            assert output.outputs[0].text.lstrip().startswith("{")
    assert not spec.engine.engine_core.structured_output.matchers


def test_a_draft_that_ends_the_grammar(engines):
    # n-gram drafts copy the prompt's end-of-turn token after the JSON the prompt shows: the mask walk took
    # the draft that completes the grammar, then asked the finished matcher for the next mask, which raised
    # and stopped the engine core
    plain, spec = engines
    messages = [{"role": "user", "content": 'Reply with exactly this JSON and nothing else: {"answer": "yes"}'}]
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    params = SamplingParams(max_tokens=40, temperature=0, structured_outputs={"json": schema})
    expected = plain.chat([messages], params, use_tqdm=False)[0].outputs[0]
    got = spec.chat([messages], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == expected.token_ids and got.finish_reason == "stop"
    assert json.loads(got.text) == {"answer": "yes"}


def test_server_with_speculative_config_reports_metrics():
    server = ServerProcess("--max-model-len", "512", "--speculative-config", json.dumps(NGRAM))
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=COPY, max_tokens=60,
                                                temperature=0, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert "Industrial Revolution" in text
        assert server.metric("heron:spec_decode_num_drafts_total") > 0
        accepted = server.metric("heron:spec_decode_num_accepted_tokens_total")
        assert 0 < accepted <= server.metric("heron:spec_decode_num_draft_tokens_total")
    finally:
        server.stop()


def test_bad_speculative_config_fails_at_start():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 0})
