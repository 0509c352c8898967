"""The offline LLM API on the embedded model: sampling options, n > 1, stops,
logprobs, seeds, and clear errors before any work for bad input."""

from __future__ import annotations

import json
import math
import time

import pytest

from heron import LLM, SamplingParams
from heron.engine.input_processor import InvalidRequestError
from heron.loader.model_source import ModelNotFoundError, ModelSource, resolve_model_source
from heron.sampling_params import SamplingParamError

PROMPT = "Write a short story about a robot who learns to paint."


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512)


def assert_idle(llm: LLM) -> None:
    scheduler = llm.engine.engine_core.scheduler
    assert not llm.engine.has_unfinished_requests() and not scheduler.has_unfinished_requests()
    scheduler.kv_cache_manager.check_integrity()
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks


def test_max_tokens_and_length_finish(llm):
    [out] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 7 and out.outputs[0].finish_reason == "length"
    assert out.prompt == PROMPT and out.prompt_token_ids == llm.get_tokenizer().encode(PROMPT)
    assert_idle(llm)


def test_outputs_come_back_in_prompt_order_with_per_prompt_params(llm):
    prompts = ["One", "Two two", "Three three three"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 5, 4)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 5, 4]


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=20, ignore_eos=True)
    [alone] = llm.generate(PROMPT, seeded, use_tqdm=False)
    others = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True)
    batch = llm.generate(["Hello there", PROMPT, "Tell me a joke"], [others, seeded, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids
    [other_seed] = llm.generate(PROMPT, seeded.clone(seed=43), use_tqdm=False)
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids


def test_reset_prefix_cache_forgets_the_cached_prompts(llm):
    """vLLM's LLM.reset_prefix_cache (heron's engine had it, the API did not)."""
    prompt = PROMPT + " " + PROMPT
    greedy = SamplingParams(temperature=0, max_tokens=4)
    [first] = llm.generate(prompt, greedy, use_tqdm=False)
    [cached] = llm.generate(prompt, greedy, use_tqdm=False)
    assert cached.num_cached_tokens >= 16 and cached.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.reset_prefix_cache() is True
    [fresh] = llm.generate(prompt, greedy, use_tqdm=False)
    assert fresh.num_cached_tokens == 0 and fresh.outputs[0].token_ids == first.outputs[0].token_ids


def test_n_samples_share_the_prompt_blocks(llm):
    assert llm.reset_prefix_cache()
    before = llm.engine.engine_core.scheduler.make_stats().prefix_cache_hits
    prompt = PROMPT + " " + PROMPT  # > 2 blocks
    [out] = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # child seeds differ
    hits = llm.engine.engine_core.scheduler.make_stats().prefix_cache_hits - before
    num_full_blocks = (len(out.prompt_token_ids) - 1) // 16
    assert hits == 2 * num_full_blocks * 16  # samples 2 and 3 reuse sample 1's prompt blocks
    assert_idle(llm)


def test_stop_strings_are_cut_and_reported(llm):
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    [free] = llm.generate(PROMPT, base, use_tqdm=False)
    text = free.outputs[0].text
    words = text.split()
    stop = words[len(words) // 2]  # a word from the middle of the greedy output
    cut = text.index(stop)
    [stopped] = llm.generate(PROMPT, base.clone(stop=[stop]), use_tqdm=False)
    completion = stopped.outputs[0]
    assert completion.text == text[:cut]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    [kept] = llm.generate(PROMPT, base.clone(stop=[stop], include_stop_str_in_output=True), use_tqdm=False)
    assert kept.outputs[0].text == text[: cut + len(stop)]
    assert_idle(llm)


def test_stop_token_ids_and_eos(llm):
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    [free] = llm.generate(PROMPT, base, use_tqdm=False)
    target = free.outputs[0].token_ids[5]
    [stopped] = llm.generate(PROMPT, base.clone(stop_token_ids=[target]), use_tqdm=False)
    first = free.outputs[0].token_ids.index(target)
    assert stopped.outputs[0].token_ids == free.outputs[0].token_ids[: first + 1]
    assert stopped.outputs[0].stop_reason == target
    chat = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=64),
                    use_tqdm=False)
    assert chat[0].outputs[0].token_ids[-1] == 2 and chat[0].outputs[0].finish_reason == "stop"


def test_logprobs_and_prompt_logprobs(llm):
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    [out] = llm.generate(PROMPT, params, use_tqdm=False)
    completion = out.outputs[0]
    assert len(completion.logprobs) == 5
    total = 0.0
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        assert entry[token_id].rank == 1  # greedy picks the top token
        assert entry[token_id].logprob == max(lp.logprob for lp in entry.values())
        assert len(entry) == 3 and all(lp.logprob <= 0 for lp in entry.values())
        assert entry[token_id].decoded_token == llm.get_tokenizer().decode([token_id])
        total += entry[token_id].logprob
    assert completion.cumulative_logprob == pytest.approx(total)
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
    for token_id, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert token_id in entry and 2 <= len(entry) <= 3
        assert math.isfinite(entry[token_id].logprob)


def test_penalties_and_bias_change_the_output(llm):
    base = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    [plain] = llm.generate("List fruits: apple, apple, apple,", base, use_tqdm=False)
    [penalized] = llm.generate("List fruits: apple, apple, apple,",
                               base.clone(repetition_penalty=1.5, frequency_penalty=1.0), use_tqdm=False)
    assert penalized.outputs[0].token_ids != plain.outputs[0].token_ids
    banned = plain.outputs[0].token_ids[0]
    [biased] = llm.generate("List fruits: apple, apple, apple,", base.clone(logit_bias={banned: -100}), use_tqdm=False)
    assert banned not in biased.outputs[0].token_ids[:1]


def test_min_tokens_suppresses_early_eos(llm):
    params = SamplingParams(temperature=0, max_tokens=64, min_tokens=20)
    [out] = llm.chat([{"role": "user", "content": "Say hi."}], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) >= 20
    assert 2 not in out.outputs[0].token_ids[:19]


def test_priority_needs_the_priority_policy(llm):
    """Under first come, first served a priority was accepted and ignored; vLLM
    refuses it, and so does heron now."""
    with pytest.raises(InvalidRequestError, match="scheduling-policy priority") as refused:
        llm.generate(["a", "b"], SamplingParams(max_tokens=2), priority=[1, 0], use_tqdm=False)
    assert refused.value.param == "priority"
    assert_idle(llm)
    ordered = LLM(max_model_len=512, scheduling_policy="priority")
    outputs = ordered.generate(["a", "b"], SamplingParams(max_tokens=2), priority=[1, 0], use_tqdm=False)
    assert len(outputs) == 2


@pytest.mark.parametrize(
    "prompt, params, error, param",
    [
        ("", SamplingParams(), InvalidRequestError, "prompt"),
        ("hi " * 600, SamplingParams(), InvalidRequestError, "prompt"),
        ([999999], SamplingParams(), InvalidRequestError, "prompt"),
        ("hi", SamplingParams(logit_bias={10**6: 1.0}), InvalidRequestError, "logit_bias"),
        # an image dropped without a word, a typo taken
        ({"prompt": "hi", "multi_modal_data": {"image": None}}, SamplingParams(), InvalidRequestError, "prompt"),
        ({"prompt": "hi", "cache_salt": ""}, SamplingParams(), InvalidRequestError, "cache_salt"),
    ],
)
def test_bad_input_fails_before_any_work(llm, prompt, params, error, param):
    with pytest.raises(error) as info:
        llm.generate(["fine prompt", prompt], params, use_tqdm=False)
    assert info.value.param == param
    assert_idle(llm)


def test_bad_sampling_values_fail_at_construction():
    for kwargs in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -2}):
        with pytest.raises(SamplingParamError):
            SamplingParams(**kwargs)


def test_too_long_prompt_names_both_numbers(llm):
    with pytest.raises(InvalidRequestError, match=r"has \d+ tokens.*maximum context length is 512"):
        llm.generate("hi " * 600, use_tqdm=False)


def test_unknown_path_and_unsupported_architecture(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found"):
        LLM(str(tmp_path / "nope" / "model.gguf"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelNotFoundError, match="no \\*.safetensors"):
        LLM(str(tmp_path))
    # a GGUF beside a config.json is that GGUF (its own config); the directory was refused for its config.json
    (tmp_path / "model.gguf").write_bytes(b"")
    assert resolve_model_source(str(tmp_path)) == ModelSource("gguf", str(tmp_path / "model.gguf"), "model")
    (tmp_path / "model.gguf").unlink()
    for part in (1, 2):  # llama.cpp's split files: said "pass one of them", and one of them lacked weights
        (tmp_path / f"big-0000{part}-of-00002.gguf").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="GGUF split into 2 files.*llama-gguf-split --merge"):
        resolve_model_source(str(tmp_path))
    for part in (1, 2):
        (tmp_path / f"big-0000{part}-of-00002.gguf").unlink()
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit", "architectures": ["ViTModel"]}))
    with pytest.raises(ValueError, match="not supported.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(str(tmp_path))


def test_hub_id_without_network_fails_fast_with_advice(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.monotonic()
    with pytest.raises(ModelNotFoundError, match="pass a local path"):
        LLM("some-org/some-model-that-is-not-here")
    assert time.monotonic() - started < 30


def test_engine_abort_frees_blocks(llm):
    engine = llm.engine
    prompt = engine.input_processor.process_prompt(PROMPT)
    engine.add_request("abort-me", prompt, SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    kv_cache_manager = engine.engine_core.scheduler.kv_cache_manager
    assert kv_cache_manager.num_free_blocks < kv_cache_manager.num_blocks
    engine.abort_request("abort-me")
    assert_idle(llm)


def test_an_interrupt_leaves_nothing_running_in_the_engine_core(llm, monkeypatch):
    """Ctrl-C while the batch was being added left the requests added so far
    running in the core; Ctrl-C in a step where a stop string finished a request,
    before the core was told, left that one running. The next generate() quietly
    computed them to max_tokens."""
    engine = llm.engine
    long = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    add_request, calls = engine.add_request, []

    def interrupted_add(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        add_request(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", interrupted_add)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([f"Prompt {i}" for i in range(5)], long, use_tqdm=False)
    monkeypatch.setattr(engine, "add_request", add_request)
    assert_idle(llm)

    process_outputs = engine.output_processor.process_outputs

    def interrupted_after_a_stop_string(*args, **kwargs):
        processed = process_outputs(*args, **kwargs)
        if processed.request_ids_to_abort:
            raise KeyboardInterrupt
        return processed

    monkeypatch.setattr(engine.output_processor, "process_outputs", interrupted_after_a_stop_string)
    with pytest.raises(KeyboardInterrupt):
        llm.generate("Hello, my name is", long.clone(stop=[",", " "], n=2), use_tqdm=False)
    monkeypatch.setattr(engine.output_processor, "process_outputs", process_outputs)
    assert_idle(llm)


def test_chat_passes_tools_to_the_template(llm):
    """vLLM's LLM.chat(..., tools=[...]); heron's raised TypeError."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    template = ("{% for t in tools %}{{ t.function.name }}: {% endfor %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    [output] = llm.chat([{"role": "user", "content": "Weather in Paris?"}], SamplingParams(max_tokens=4),
                        tools=tools, chat_template=template, use_tqdm=False)
    assert output.prompt == "get_weather: Weather in Paris?" and output.outputs[0].token_ids


def test_chat_prepares_tool_conversations_as_the_server_does(llm):
    """A past call's arguments reach a template that takes tools as an object
    (they were JSON text, which `| tojson` quoted again), and a template that
    does not (the embedded model's) gets the tools, the call and its result
    written in (they were dropped: the tools, and an assistant turn with only a
    call, rendered as nothing)."""
    tools = [{"type": "function", "function": {"name": "get_weather",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22C sunny"},
    ]
    takes_tools = ("{{ tools | length }} tools: {% for m in messages %}{% for c in m.tool_calls or [] %}"
                   "{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}")
    [output] = llm.chat(conversation, SamplingParams(max_tokens=1), tools=tools, chat_template=takes_tools,
                        use_tqdm=False)
    assert output.prompt == '1 tools: {"city": "Paris"}'
    [output] = llm.chat(conversation, SamplingParams(max_tokens=1), tools=tools, use_tqdm=False)
    assert '"name": "get_weather"' in output.prompt  # the tools, in the system message
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in output.prompt
    assert "<tool_response>\n22C sunny\n</tool_response>" in output.prompt


def test_nothing_to_do_is_an_error(llm):
    with pytest.raises(ValueError, match="no prompts given"):
        llm.generate([], use_tqdm=False)
    with pytest.raises(ValueError, match="no conversations given"):  # was [] without a word
        llm.chat([], use_tqdm=False)


def test_allowed_token_ids_and_bad_words(llm):
    """vLLM's two sampling fields: only the allowed tokens are sampled, and a bad
    word (each of its spellings with and without a leading space) never comes out.
    Both were accepted and ignored."""
    tokenizer = llm.get_tokenizer()
    allowed = tokenizer.encode(" yes no maybe", add_special_tokens=False)
    [sampled] = llm.generate("Answer:", SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True,
                                                       allowed_token_ids=allowed), use_tqdm=False)
    assert set(sampled.outputs[0].token_ids) <= set(allowed)
    question = [{"role": "user", "content": "What is the capital of Japan?"}]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    [plain] = llm.chat(question, greedy, use_tqdm=False)
    assert "Tokyo" in plain.outputs[0].text
    [banned] = llm.chat(question, greedy.clone(bad_words=["Tokyo", "capital of Japan is"]), use_tqdm=False)
    assert "Tokyo" not in banned.outputs[0].text and "capital of Japan is" not in banned.outputs[0].text
    assert banned.outputs[0].text[:10] == plain.outputs[0].text[:10]  # the same answer up to the ban
    with pytest.raises(InvalidRequestError, match="allowed_token_ids outside the vocabulary"):
        llm.generate("x", SamplingParams(allowed_token_ids=[10**7]), use_tqdm=False)
    with pytest.raises(SamplingParamError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    assert_idle(llm)


def test_restrictions_that_leave_no_token_are_refused_or_end_the_request_with_the_reason(llm):
    """allowed_token_ids all banned (the end of sequence held back by min_tokens, a
    one-token bad word) left a row of -inf, and token 0 came out, outside the
    request's own allowed_token_ids, answered as a success. Known at once: a 400.
    Known only later (a bad word of several tokens bans the last allowed one once
    the output ends in the rest): the request ends there with the reason."""
    tokenizer = llm.get_tokenizer()
    [eos] = llm.engine.input_processor.eos_token_ids[:1]
    comma = tokenizer.encode(",", add_special_tokens=False)
    for params in (SamplingParams(allowed_token_ids=[eos], min_tokens=3),
                   SamplingParams(allowed_token_ids=comma, bad_words=[","])):
        with pytest.raises(InvalidRequestError, match="no token is left") as raised:
            llm.generate("x", params, use_tqdm=False)
        assert raised.value.param == "allowed_token_ids"
    [only] = tokenizer.encode(" yes", add_special_tokens=False)
    for temperature in (0.0, 1.0):
        [ended] = llm.generate("Answer:", SamplingParams(temperature=temperature, seed=1, max_tokens=8,
                                                         allowed_token_ids=[only], bad_words_token_ids=[[only, only]]),
                               use_tqdm=False)
        completion = ended.outputs[0]
        assert completion.token_ids == [only], completion  # never token 0
        assert completion.finish_reason == "abort" and "no token is left" in (completion.error or ""), completion
    assert_idle(llm)


def test_a_prompt_dicts_cache_salt_keeps_its_prefix_apart(llm):
    """It was ignored: a prompt salted "bob" got the cached blocks of the same prompt salted "alice"."""
    stats = llm.engine.engine_core.scheduler.kv_cache_manager.prefix_cache_stats
    greedy = SamplingParams(temperature=0, max_tokens=2)

    def hits_of(salt: str) -> int:
        before = stats.hits
        llm.generate([{"prompt": PROMPT * 4, "cache_salt": salt}], greedy, use_tqdm=False)
        return stats.hits - before

    hits_of("alice")
    assert hits_of("bob") == 0
    assert hits_of("alice") > 0
    assert_idle(llm)
