"""A live `heron serve` on the embedded model, driven by the official openai client
and by plain HTTP."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import httpx
import openai
import pytest

from tests.e2e.server_process import ServerProcess, wait_for

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def wait_idle(server: ServerProcess, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.metric("heron:num_requests_running") == 0 and server.metric("heron:kv_cache_usage_perc") == 0:
            return
        time.sleep(0.1)
    raise AssertionError("the server did not return to idle (requests or KV blocks still held)")


def test_health_version_models(server, client):
    # no KV transfers; the block size lets a router skip prefill servers no decode server can pull from
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok", "kv_role": None, "block_size": 16}
    assert httpx.get(f"{server.base_url}/version").json()["version"]
    [model] = client.models.list().data
    assert model.id == MODEL
    assert client.models.retrieve(MODEL).id == MODEL  # was a 404: the route did not exist
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("org/another-model")


def test_chat_completion_answers_paris(client):
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    choice = response.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert response.id.startswith("chatcmpl-") and response.model == MODEL


def test_usage_counts_equal_the_tokenizer(server, client, embedded_tokenizer):
    prompt = "The quick brown fox jumps over the lazy dog."
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=9, temperature=0,
                                         extra_body={"ignore_eos": True})
    expected = len(embedded_tokenizer.encode(prompt))
    assert response.usage.prompt_tokens == expected
    assert response.usage.completion_tokens == 9 and response.usage.total_tokens == expected + 9
    tokenized = httpx.post(f"{server.base_url}/tokenize", json={"prompt": prompt}).json()
    assert tokenized["count"] == expected and tokenized["max_model_len"] == 512
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0)
    chat_tokens = httpx.post(f"{server.base_url}/tokenize", json={"messages": QUESTION}).json()
    assert chat.usage.prompt_tokens == chat_tokens["count"]
    detok = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokenized["tokens"]}).json()
    assert detok["prompt"] == prompt
    strs = httpx.post(f"{server.base_url}/tokenize", json={"prompt": prompt, "return_token_strs": True}).json()
    assert strs["token_strs"] == embedded_tokenizer.convert_ids_to_tokens(strs["tokens"])  # vLLM's field


def test_continuing_and_a_generation_prompt_both_asked_for_is_a_400(server):
    """Both true: the final message was continued and the generation prompt
    dropped without a word (vLLM refuses it); chat and /tokenize alike."""
    body = {"model": MODEL, "messages": QUESTION, "continue_final_message": True, "add_generation_prompt": True}
    for path in ("/v1/chat/completions", "/tokenize"):
        response = httpx.post(f"{server.base_url}{path}", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == "continue_final_message"
    del body["add_generation_prompt"]  # continuing alone (add_generation_prompt's default true gives way)
    assert httpx.post(f"{server.base_url}/tokenize", json=body).status_code == 200


def test_streamed_text_equals_non_streamed_for_the_same_seed(client):
    kwargs = dict(model=MODEL, messages=QUESTION + [{"role": "assistant", "content": "It is"},
                                                    {"role": "user", "content": "Tell me more."}],
                  temperature=0.9, seed=1234, max_tokens=48)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    again = client.chat.completions.create(**kwargs).choices[0].message.content
    assert full == again  # seeds are reproducible
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == full
    assert usage is not None and usage.completion_tokens > 0 and finish in ("stop", "length")


def test_completions_n2_logprobs_and_echo(client):
    response = client.completions.create(model=MODEL, prompt=["Once upon a time", "The sky is"], n=2, max_tokens=6,
                                         temperature=1.0, seed=5, logprobs=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in response.choices) == [0, 1, 2, 3]
    for choice in response.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
        assert "".join(lp.tokens) == choice.text
        assert all(len(top) >= 2 for top in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)
    assert response.usage.completion_tokens == 4 * 6
    # the top 2 and the token itself, sampled (at temperature 1) below them or not (OpenAI: up to logprobs+1)
    for choice in response.choices:
        lp = choice.logprobs
        assert all(token in top and len(top) <= 3 for token, top in zip(lp.tokens, lp.top_logprobs))
    assert any(len(top) == 3 for choice in response.choices for top in choice.logprobs.top_logprobs)
    echo = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0, echo=True,
                                     logprobs=1)
    assert echo.choices[0].text.startswith("Hello there")
    lp = echo.choices[0].logprobs
    assert lp.token_logprobs[0] is None
    assert all(token in top for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_text_offsets_equal_non_streamed_under_stop_strings(server, echo):
    """Streamed offsets were counted from the text sent so far, which stop
    strings hold back: every offset was short by up to the longest stop
    string's length less one."""
    body = {"model": MODEL, "prompt": "Once upon a time, in a small village,", "max_tokens": 12,
            "temperature": 0, "logprobs": 0, "stop": ["Elwes", "zzzz"], "echo": echo}
    url = f"{server.base_url}/v1/completions"
    whole = httpx.post(url, json=body, timeout=120).json()["choices"][0]
    offsets, text = [], ""
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as streamed:
        for line in streamed.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line.removeprefix("data: "))["choices"][0]
                text += choice["text"]
                offsets += choice["logprobs"]["text_offset"]
    assert text == whole["text"] and offsets == whole["logprobs"]["text_offset"]
    # each token's text is where its offset says (those of the stop string cut from the text aside)
    assert all(text[offset:].startswith(token) for offset, token in zip(offsets, whole["logprobs"]["tokens"])
               if "\ufffd" not in token and offset + len(token) <= len(text))


def test_text_offsets_leave_out_the_special_tokens_the_text_leaves_out(server):
    """A special token skipped from the text (skip_special_tokens) still moved the
    offsets on: every later token's offset pointed past its text."""
    body = {"model": MODEL, "prompt": [1, 504, 2365, 6354, 2], "max_tokens": 4, "temperature": 0, "logprobs": 1,
            "echo": True, "ignore_eos": True}
    url = f"{server.base_url}/v1/completions"
    choice = httpx.post(url, json=body, timeout=120).json()["choices"][0]
    text, logprobs = choice["text"], choice["logprobs"]
    assert "<|im_start|>" in logprobs["tokens"][5:], logprobs["tokens"]  # the model's answer opens a turn
    for offset, token in zip(logprobs["text_offset"][5:], logprobs["tokens"][5:]):
        if token != "<|im_start|>" and "\ufffd" not in token:
            assert text[offset:].startswith(token), (offset, token, text)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_scores_the_prompt_alone(server, stream):
    """lm-evaluation-harness's loglikelihood (and vLLM, and OpenAI's legacy
    completions) ask echo with max_tokens 0: the prompt and its logprobs,
    nothing generated. It was a 400."""
    prompt = "The capital of France is Paris"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "stream": stream}
    url = f"{server.base_url}/v1/completions"
    if stream:
        text, tokens, finish = "", [], None
        with httpx.stream("POST", url, json=body, timeout=120) as streamed:
            for line in streamed.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line.removeprefix("data: "))["choices"][0]
                    text += choice["text"]
                    tokens += (choice["logprobs"] or {}).get("tokens", [])
                    finish = choice["finish_reason"] or finish
    else:
        answer = httpx.post(url, json=body, timeout=120).json()
        choice = answer["choices"][0]
        text, tokens, finish = choice["text"], choice["logprobs"]["tokens"], choice["finish_reason"]
        assert answer["usage"]["completion_tokens"] == 0
        assert answer["usage"]["prompt_tokens"] == len(tokens)
        assert choice["logprobs"]["token_logprobs"][0] is None
        assert all(value < 0 for value in choice["logprobs"]["token_logprobs"][1:])
    assert text == prompt and "".join(tokens) == prompt and finish == "length"


def test_chat_logprobs_shape(client):
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, temperature=0,
                                              logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)  # greedy picks the best
        assert bytes(item.bytes).decode() == item.token


def test_prompt_logprobs_come_back_in_vllms_shape(server, embedded_tokenizer):
    prompt = "The capital of France is"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    choice = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30).json()["choices"][0]
    ids = embedded_tokenizer.encode(prompt)
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token_id, entry in zip(ids[1:], entries[1:]):
        assert str(token_id) in entry and 2 <= len(entry) <= 3  # its own token and the top 2
        assert {lp["rank"] for lp in entry.values()} >= {1, 2}
        assert all(lp["logprob"] <= 0 and isinstance(lp["decoded_token"], str) for lp in entry.values())
    chat = {"model": MODEL, "messages": QUESTION, "max_tokens": 1, "prompt_logprobs": 0}
    answer = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat, timeout=30).json()
    assert len(answer["prompt_logprobs"]) == answer["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in answer["prompt_logprobs"][1:])  # prompt_logprobs 0: its own token only
    streamed = httpx.post(f"{server.base_url}/v1/chat/completions", json={**chat, "stream": True}, timeout=30)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_stop_strings_never_leak_into_chunks(client):
    base = dict(model=MODEL, prompt="Count: 1, 2, 3, 4, 5, 6, 7, 8,", max_tokens=30, temperature=0)
    full = client.completions.create(**base).choices[0].text
    stop = full.strip().split(",")[2].strip() + ","  # e.g. "11,"
    cut = client.completions.create(stop=[stop], **base).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]
    chunks = [c.choices[0].text for c in client.completions.create(stop=[stop], stream=True, **base) if c.choices]
    assert "".join(chunks) == cut.text
    assert all(stop not in chunk for chunk in chunks)


def test_tokens_are_flushed_as_produced(server):
    body = {"model": MODEL, "prompt": "Write a long story.", "max_tokens": 64, "temperature": 0, "stream": True,
            "ignore_eos": True}
    arrivals = []
    started = time.monotonic()
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic() - started)
    assert len(arrivals) >= 32
    assert arrivals[0] < arrivals[-1] * 0.5  # the first token arrived long before the last


def test_concurrent_requests_are_all_answered(server, embedded_tokenizer):
    async def run() -> list:
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as aclient:
            async def one(i: int):
                if i % 2:
                    return await aclient.completions.create(model=MODEL, prompt=f"Fact number {i}:",
                                                            max_tokens=8 + i % 5, temperature=0,
                                                            extra_body={"ignore_eos": True})
                return await aclient.chat.completions.create(model=MODEL,
                                                             messages=[{"role": "user", "content": f"Say {i}"}],
                                                             max_tokens=8 + i % 5, temperature=0,
                                                             extra_body={"ignore_eos": True})
            return await asyncio.gather(*[one(i) for i in range(40)])

    responses = asyncio.run(run())
    assert len(responses) == 40
    for i, response in enumerate(responses):
        assert response.usage.completion_tokens == 8 + i % 5
    wait_idle(server)


def aborted_count(server: ServerProcess) -> float:
    return server.metric("heron:request_success_total", finished_reason="abort")


def test_streaming_client_disconnect_frees_blocks(server):
    body = {"model": MODEL, "prompt": "Tell me everything.", "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    aborted_before = aborted_count(server)
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        chunks = []
        # held in a name: httpx closes the connection when this generator is dropped,
        # which a bare `for ... in response.iter_lines(): break` does at once
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                if len(chunks) >= 3:
                    break
        assert len(chunks) == 3 and all("choices" in chunk for chunk in chunks), chunks
        # still generating while we hold it (the gauge follows the engine's step reports)
        running = [server.metric("heron:num_requests_running")]
        while running[-1] != 1 and len(running) < 20:
            time.sleep(0.1)
            running.append(server.metric("heron:num_requests_running"))
        assert running[-1] == 1, (running, server.read_log()[-3000:])
    wait_idle(server, timeout=5.0)
    assert aborted_count(server) == aborted_before + 1


def test_reset_prefix_cache_forgets_cached_prompts_and_refuses_while_requests_run(server):
    def cached_tokens() -> int:
        body = {"model": MODEL, "prompt": "Reset me, please. " * 10, "max_tokens": 2, "temperature": 0}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached_tokens()
    assert cached_tokens() >= 32
    reset = httpx.post(f"{server.base_url}/reset_prefix_cache", timeout=30)
    assert (reset.status_code, reset.json()) == (200, {"reset": True})
    assert cached_tokens() == 0
    body = {"model": MODEL, "prompt": "Tell me everything.", "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        busy = httpx.post(f"{server.base_url}/reset_prefix_cache", timeout=30)
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "prefix_cache_in_use"
    wait_idle(server, timeout=5.0)
    assert cached_tokens() > 0  # the refused reset forgot nothing


def test_non_streaming_client_disconnect_frees_blocks(server):
    body = {"model": MODEL, "prompt": "Tell me everything.", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    aborted_before = aborted_count(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=1.0)
    wait_idle(server, timeout=5.0)
    assert aborted_count(server) == aborted_before + 1


def raw_request(server: ServerProcess, body: bytes, length: int | None = None) -> socket.socket:
    """A POST to /v1/completions on a plain socket, its Content-Length ``length``
    (default: the body's), left open for the caller."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body) if length is None else length, body))
    return sock


def test_a_client_gone_before_its_first_token_frees_everything_within_a_step(server):
    """A streamed request with a long prompt whose client closes the socket as
    soon as the response's headers arrive, while the prompt is prefilled: it
    generates at most the one token of the step under way, and nothing runs or
    holds a KV block afterwards. (A client that closes before the server has
    read its body never gets a request started: uvicorn reports the
    disconnect instead of the body, as in the mid-body case below.)"""
    body = {"model": MODEL, "prompt": "the " * 440, "max_tokens": 40, "temperature": 0, "stream": True,
            "ignore_eos": True}
    aborted_before, generated_before = aborted_count(server), server.metric("heron:generation_tokens_total")
    disconnected_before = server.metric("heron:request_aborts_total", reason="client_disconnected")
    sock = raw_request(server, json.dumps(body).encode())
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(4096)
    sock.close()
    closed = time.monotonic()
    assert received.startswith(b"HTTP/1.1 200") and b"data:" not in received, received  # no token yet
    wait_for(lambda: aborted_count(server) == aborted_before + 1, timeout=10, what="the request to be aborted")
    wait_idle(server, timeout=5.0)
    print(f"aborted and idle {time.monotonic() - closed:.2f} s after the client closed")
    assert server.metric("heron:generation_tokens_total") - generated_before <= 1
    assert server.metric("heron:request_aborts_total", reason="client_disconnected") == disconnected_before + 1


def test_a_client_gone_mid_body_leaves_nothing_behind(server):
    """Headers announcing a body, half of it, then a close: nothing reaches the
    engine, the server drops the connection, logs no error, and serves on."""
    body = json.dumps({"model": MODEL, "prompt": "the " * 400, "max_tokens": 8}).encode()
    prompt_tokens_before = server.metric("heron:prompt_tokens_total")
    aborted_before = aborted_count(server)
    log_before = len(server.read_log())
    raw_request(server, body[: len(body) // 2], length=len(body)).close()
    wait_for(lambda: server.connections() == [], timeout=5, what="the server to drop the connection")
    time.sleep(0.5)  # anything the server would do about it, done
    assert server.metric("heron:prompt_tokens_total") == prompt_tokens_before
    assert aborted_count(server) == aborted_before
    wait_idle(server, timeout=5.0)
    new_log = server.read_log()[log_before:]
    assert "Traceback" not in new_log and "ERROR" not in new_log, new_log
    response = httpx.post(f"{server.base_url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                          timeout=30)
    assert response.status_code == 200


@pytest.mark.parametrize(
    "body, param, fragment",
    [
        ({"temperature": -1}, "temperature", "temperature"),
        ({"top_p": 2}, "top_p", "top_p"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens"),
        ({"n": 0}, "n", "n"),
        ({"top_k": -5}, "top_k", "top_k"),
        ({"logprobs": 50}, "logprobs", "logprobs"),
        ({"temperature": "hot"}, "temperature", "temperature"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": [10**7]}, "prompt", "vocabulary"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "logit_bias"),
        ({"stop_token_ids": [10**7]}, "stop_token_ids", "vocabulary"),
        # integers past 64 bits: a top_k of 2**63 stopped the engine core, the others were 500s
        ({"top_k": 2**63}, "top_k", "top_k"),
        ({"seed": 2**64}, "seed", "seed"),
        ({"priority": 2**64}, "priority", "priority"),
        ({"priority": 1}, "priority", "--scheduling-policy priority"),  # first come, first served: was ignored
        ({"allowed_token_ids": []}, "allowed_token_ids", "at least 1"),
        ({"cache_salt": ""}, "cache_salt", "at least 1"),  # it hashed as no salt: the shared, unsalted cache
        ({"allowed_token_ids": [10**7]}, "allowed_token_ids", "vocabulary"),
        ({"bad_words": [""]}, "bad_words", "at least 1"),
        ({"max_tokens": 400, "prompt": "word " * 300}, "max_tokens", "512"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "stream"),  # as OpenAI answers
    ],
)
def test_bad_values_get_400_naming_the_parameter(server, body, param, fragment):
    payload = {"model": MODEL, "prompt": "hi", **body}
    response = httpx.post(f"{server.base_url}/v1/completions", json=payload, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"


def test_allowed_token_ids_and_bad_words_through_the_api(client, embedded_tokenizer):
    allowed = embedded_tokenizer.encode(" yes no", add_special_tokens=False)
    sampled = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=8, temperature=1.0, seed=2,
                                        logprobs=0, extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    assert sampled.choices[0].logprobs.tokens and set(sampled.choices[0].logprobs.tokens) <= {" yes", " no"}
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Capital of Japan?"}],
                                            max_tokens=12, temperature=0, extra_body={"bad_words": ["Tokyo"]})
    assert "Tokyo" not in answer.choices[0].message.content


@pytest.mark.parametrize("part", [{"type": "text", "text": 5}, {"type": "text"}, {"type": "image_url"}])
def test_chat_content_parts_without_text_are_400s(server, part):
    # a number was rendered as its digits and a missing text as nothing, answered 200 (vLLM: 400)
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [part]}]}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    assert "chat template" not in response.json()["error"]["message"]  # the content's fault, not the template's


def test_echo_continues_a_final_message_of_text_parts_as_of_a_string(server):
    """echo with the final assistant message as content parts echoed nothing
    (streamed: an empty first delta); vLLM joins the parts, as the template sees them."""
    texts = []
    for content in ("Once upon a time", [{"type": "text", "text": "Once upon"}, {"type": "text", "text": "a time"}]):
        body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "echo": True, "add_generation_prompt": False,
                "continue_final_message": True,
                "messages": [{"role": "user", "content": "A story."}, {"role": "assistant", "content": content}]}
        answer = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30).json()
        texts.append(answer["choices"][0]["message"]["content"])
        with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json={**body, "stream": True},
                          timeout=30) as stream:
            chunks = [json.loads(line[6:]) for line in stream.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert streamed == texts[-1]
    assert texts[0].startswith("Once upon a time") and texts[1].startswith("Once upon\na time")


def test_context_overflow_message_says_both_numbers(server):
    response = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "word " * 300}], "max_completion_tokens": 400})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "512" in message and "400" in message and response.json()["error"]["code"] == "context_length_exceeded"


def test_unknown_model_is_404_and_unknown_fields_are_ignored(server, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "frobnicate": True})
    assert response.status_code == 200
    assert "frobnicate" in server.read_log()


def test_server_processes_freeze_their_start_up_objects(server):
    """Both long-running processes keep full garbage collections off their
    start-up objects (a ~100 ms pause each time otherwise)."""
    log = server.read_log()
    for process in ("engine core", "API server"):
        assert re.search(rf"{process}: froze [1-9][0-9]* start-up objects", log), log[-3000:]


def test_malformed_json_and_unknown_route(server):
    response = httpx.post(f"{server.base_url}/v1/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "error" in response.json()
    response = httpx.get(f"{server.base_url}/v1/nothing-here")
    assert response.status_code == 404 and "error" in response.json()


def test_a_request_the_engine_ends_with_an_error_is_counted_as_one(server):
    """A structured request whose constraint no allowed token meets is a 400; it
    was counted request_success{finished_reason="abort"}, beside no abort."""
    served = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}  # the counter has a sample to read
    assert httpx.post(f"{server.base_url}/v1/completions", json=served, timeout=60).status_code == 200
    before_abort = aborted_count(server)
    before_error = server.metric("heron:request_success_total", finished_reason="error")
    body = {"model": MODEL, "prompt": "Give JSON:", "max_tokens": 5, "allowed_token_ids": [100, 101],
            "response_format": {"type": "json_object"}}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert "allowed_token_ids" in response.json()["error"]["message"]
    assert aborted_count(server) == before_abort
    assert server.metric("heron:request_success_total", finished_reason="error") == before_error + 1


def test_metrics_move_with_requests(server, client):
    before_success = server.metric("heron:request_success_total")
    before_tokens = server.metric("heron:generation_tokens_total")
    before_ttft = server.metric("heron:time_to_first_token_seconds_count")
    client.completions.create(model=MODEL, prompt="Count to ten:", max_tokens=10, temperature=0,
                              extra_body={"ignore_eos": True})
    assert server.metric("heron:request_success_total") == before_success + 1
    assert server.metric("heron:generation_tokens_total") == before_tokens + 10
    assert server.metric("heron:time_to_first_token_seconds_count") == before_ttft + 1
    assert server.metric("heron:inter_token_latency_seconds_count") > 0
    assert server.metric("heron:e2e_request_latency_seconds_sum") > 0
    wait_idle(server)
    assert server.metric("heron:num_requests_waiting") == 0
