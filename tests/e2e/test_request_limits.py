"""The documented request limits of a live server (README, "Request limits";
``heron/entrypoints/openai/limits.py``): a request exactly at each limit is
served, one past it gets a 4xx in OpenAI's error shape naming the parameter,
and the server goes on serving."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from heron.entrypoints.openai.limits import (
    MAX_BAD_WORDS,
    MAX_N,
    MAX_PROMPTS_PER_REQUEST,
    MAX_REPETITION_PENALTY,
    MAX_SAMPLING_TEMPERATURE,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    MIN_REPETITION_PENALTY,
)
from tests.e2e.server_process import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 256
BODY_LIMIT = 64 << 10
HEADER_LIMIT = 4096


@pytest.fixture(scope="module")
def server():
    process = ServerProcess("--max-model-len", str(MAX_MODEL_LEN), "--max-request-body-bytes", str(BODY_LIMIT),
                            "--max-header-bytes", str(HEADER_LIMIT))
    yield process
    process.stop()


def complete(server: ServerProcess, path: str = "/v1/completions", **fields) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 1, **fields}
    if path == "/v1/completions":
        body.setdefault("prompt", "hi")
    else:
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120)


def assert_rejected(response: httpx.Response, param: str | None, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error", error
    assert error["param"] == param, error
    return error


def test_n(server):
    response = complete(server, n=MAX_N)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == MAX_N
    assert_rejected(complete(server, n=MAX_N + 1), "n")
    assert_rejected(complete(server, "/v1/chat/completions", n=MAX_N + 1), "n")


def test_prompts_per_request(server):
    texts = [f"{i} herons" for i in range(MAX_PROMPTS_PER_REQUEST)]
    response = complete(server, prompt=texts)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == MAX_PROMPTS_PER_REQUEST
    assert_rejected(complete(server, prompt=[*texts, "one more"]), "prompt")
    assert_rejected(complete(server, prompt=[[1, 2]] * (MAX_PROMPTS_PER_REQUEST + 1)), "prompt")


def test_stop_strings(server):
    stops = [chr(ord("a") + i) * MAX_STOP_STRING_CHARS for i in range(MAX_STOP_STRINGS)]
    assert complete(server, stop=stops).status_code == 200
    assert complete(server, stop=stops[0]).status_code == 200
    assert_rejected(complete(server, stop=[*stops, "z"]), "stop")
    assert_rejected(complete(server, stop=["x" * (MAX_STOP_STRING_CHARS + 1)]), "stop")
    assert_rejected(complete(server, stop="x" * (MAX_STOP_STRING_CHARS + 1)), "stop")


def test_logprobs(server):
    response = complete(server, logprobs=MAX_TOP_LOGPROBS)
    assert response.status_code == 200 and response.json()["choices"][0]["logprobs"]["top_logprobs"][0]
    assert_rejected(complete(server, logprobs=MAX_TOP_LOGPROBS + 1), "logprobs")
    chat = complete(server, "/v1/chat/completions", logprobs=True, top_logprobs=MAX_TOP_LOGPROBS)
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == MAX_TOP_LOGPROBS
    assert_rejected(complete(server, "/v1/chat/completions", logprobs=True, top_logprobs=MAX_TOP_LOGPROBS + 1),
                    "top_logprobs")
    assert_rejected(complete(server, prompt_logprobs=MAX_TOP_LOGPROBS + 1), "prompt_logprobs")


def test_bad_words_and_allowed_token_ids(server):
    words = [f"w{i}" + "x" * (MAX_STOP_STRING_CHARS - 5) for i in range(MAX_BAD_WORDS)]
    assert complete(server, bad_words=words).status_code == 200
    assert_rejected(complete(server, bad_words=[*words, "one more"]), "bad_words")
    assert_rejected(complete(server, bad_words=["x" * (MAX_STOP_STRING_CHARS + 1)]), "bad_words")
    assert complete(server, allowed_token_ids=[0]).status_code == 200
    assert_rejected(complete(server, allowed_token_ids=[]), "allowed_token_ids")


def test_temperature_and_repetition_penalty_keep_the_sampler_finite(server):
    for fields in ({"temperature": MAX_SAMPLING_TEMPERATURE, "min_tokens": 1},
                   {"repetition_penalty": MIN_REPETITION_PENALTY}, {"repetition_penalty": MAX_REPETITION_PENALTY}):
        response = complete(server, max_tokens=2, seed=1, **fields)
        assert response.status_code == 200 and response.json()["choices"][0]["text"], response.text
    assert_rejected(complete(server, temperature=MAX_SAMPLING_TEMPERATURE * 10), "temperature")
    assert_rejected(complete(server, repetition_penalty=MIN_REPETITION_PENALTY / 10), "repetition_penalty")
    assert_rejected(complete(server, "/v1/chat/completions", repetition_penalty=MAX_REPETITION_PENALTY * 10),
                    "repetition_penalty")


def test_max_tokens_fills_the_context_and_no_more(server):
    prompt = "word " * 200
    count = httpx.post(f"{server.base_url}/tokenize", json={"prompt": prompt}).json()["count"]
    assert complete(server, prompt=prompt, max_tokens=MAX_MODEL_LEN - count).status_code == 200
    error = assert_rejected(complete(server, prompt=prompt, max_tokens=MAX_MODEL_LEN - count + 1), "max_tokens")
    assert error["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in error["message"]
    messages = [{"role": "user", "content": prompt}]
    count = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages}).json()["count"]
    chat = "/v1/chat/completions"
    assert complete(server, chat, messages=messages, max_completion_tokens=MAX_MODEL_LEN - count).status_code == 200
    assert_rejected(complete(server, chat, messages=messages, max_completion_tokens=MAX_MODEL_LEN - count + 1),
                    "max_completion_tokens")
    assert "needs echo" in assert_rejected(complete(server, max_tokens=0), "max_tokens")["message"]


def padded_body(size: int) -> bytes:
    """A valid completion request of exactly ``size`` bytes (JSON whitespace as padding)."""
    raw = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    return raw + b" " * (size - len(raw))


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_request_body_size(server, chunked):
    def post(body: bytes) -> httpx.Response:
        # an iterator makes httpx send the body chunked, without a Content-Length
        content = iter([body[: len(body) // 2], body[len(body) // 2:]]) if chunked else body
        return httpx.post(f"{server.base_url}/v1/completions", content=content,
                          headers={"content-type": "application/json"}, timeout=60)

    assert post(padded_body(BODY_LIMIT)).status_code == 200
    error = assert_rejected(post(padded_body(BODY_LIMIT + 1)), None, status=413)
    assert error["code"] == "body_too_large" and str(BODY_LIMIT) in error["message"]


def exchange(server: ServerProcess, head: bytes, timeout: float = 20.0) -> tuple[int, bytes]:
    """Send ``head`` on a fresh connection; the status and body of the answer,
    read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(head)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    status_line, _, rest = received.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def head_with_header_bytes(total: int) -> bytes:
    """A GET /health whose header names and values add up to ``total`` bytes."""
    fixed = len(b"host" + b"127.0.0.1" + b"connection" + b"close" + b"x-pad")
    return (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nX-Pad: "
            + b"a" * (total - fixed) + b"\r\n\r\n")


def test_header_size(server):
    status, body = exchange(server, head_with_header_bytes(HEADER_LIMIT))
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, body = exchange(server, head_with_header_bytes(HEADER_LIMIT + 1))
    assert status == 431, body
    assert json.loads(body)["error"]["code"] == "headers_too_large"
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_a_head_that_never_ends_is_cut_off(server):
    """A client sending an endless header is answered and disconnected once
    its head passes the bound, not buffered until it stops (httptools, which
    uvicorn uses when installed, buffers any size; h11 answers a plain 400)."""
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * (10 * HEADER_LIMIT)  # no end of head
    status, body = exchange(server, head)
    assert status in (431, 400), body
    if status == 431:
        assert json.loads(body)["error"]["code"] == "headers_too_large"
    assert httpx.get(f"{server.base_url}/health").status_code == 200


PLAIN_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


def test_a_request_chat_template_needs_the_trust_flag(server):
    """A request's chat_template is Jinja the server would run: refused unless
    the server was started with --trust-request-chat-template (vLLM's flag)."""
    for path in ("/v1/chat/completions", "/tokenize"):
        error = assert_rejected(complete(server, path, chat_template=PLAIN_TEMPLATE), "chat_template")
        assert "--trust-request-chat-template" in error["message"]
    trusting = ServerProcess("--max-model-len", str(MAX_MODEL_LEN), "--trust-request-chat-template")
    try:
        response = complete(trusting, "/tokenize", chat_template=PLAIN_TEMPLATE)
        assert response.status_code == 200, response.text
        tokens = response.json()["tokens"]
        assert httpx.post(f"{trusting.base_url}/detokenize", json={"tokens": tokens}).json()["prompt"] == "<user>hi"
        assert complete(trusting, "/v1/chat/completions", chat_template=PLAIN_TEMPLATE).status_code == 200
    finally:
        trusting.stop()
