"""Gateway duties of a live server: API keys (flag, env var, file), per-key rate
limits, request-size limits, timeouts, admission bounds, a dead engine, TLS."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import ssl
import threading
import time

import httpx
import openai
import pytest

from tests.e2e.server_process import ServerProcess
from tests.e2e.tls_chain import make_certificate_chain, verifies

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text("# team keys\nkey-from-file\n")
    process = ServerProcess(
        "--api-key", "key-from-flag", "--api-key-file", str(key_file),
        "--rate-limit", "1", "--rate-limit-burst", "3",
        "--max-request-body-bytes", "4096", "--request-timeout", "1.5",
        env={"HERON_API_KEY": "key-from-env-a,key-from-env-b"},
    )
    # the first completion of a fresh server pays a one-off warm-up that can outlast --request-timeout 1.5 on a
    # loaded machine (a 504 the tests below would take for their own failure)
    deadline = time.monotonic() + 120
    while post(process, "key-from-env-b", {"model": MODEL, "prompt": "hi", "max_tokens": 1}).status_code != 200:
        assert time.monotonic() < deadline, "the guarded server never answered a completion"
        time.sleep(1.0)
    time.sleep(3.0)  # its bucket full again
    yield process
    process.stop()


def post(server: ServerProcess, key: str | None, body: dict, path: str = "/v1/completions") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=30)


def test_api_keys_from_flag_env_and_file(guarded):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    for key in ("key-from-flag", "key-from-env-b", "key-from-file"):
        assert post(guarded, key, body).status_code == 200, key
    for key in (None, "wrong-key"):
        response = post(guarded, key, body)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    # the official client passes the key the same way
    client = openai.OpenAI(base_url=f"{guarded.base_url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    # health, metrics and version stay open for probes and scrapers (without --protect-metrics)
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{guarded.base_url}{path}").status_code == 200, path
    # /tokenize and /detokenize serve the API: they want the key like /v1
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        assert post(guarded, None, body, path).status_code == 401, path
        assert post(guarded, "key-from-env-b", body, path).status_code == 200, path
    # and so does emptying the prefix cache (not done here: the tests below count on this server's warm cache
    # within --request-timeout 1.5; test_server.py resets one)
    assert post(guarded, None, {}, "/reset_prefix_cache").status_code == 401


def send(server: ServerProcess, method: str, path: str, key: str, body: dict | None = None) -> httpx.Response:
    """One request under ``key``, waiting out the rate limit (1/s here) when it answers 429."""
    for _ in range(10):
        response = httpx.request(method, f"{server.base_url}{path}", json=body, timeout=30,
                                 headers={"Authorization": f"Bearer {key}"})
        if response.status_code != 429:
            return response
        time.sleep(float(response.headers.get("retry-after", "1")))
    return response


def test_a_stored_response_is_found_only_under_the_key_that_made_it(guarded):
    """Any key could read, continue, list and delete another key's stored
    responses (one store per process, no owner): OpenAI scopes them to their project."""
    made = send(guarded, "POST", "/v1/responses", "key-from-flag",
                {"model": MODEL, "input": "What is the capital of France?", "max_output_tokens": 4})
    assert made.status_code == 200, made.text
    response_id = made.json()["id"]
    for method, path in (("GET", f"/v1/responses/{response_id}"), ("GET", f"/v1/responses/{response_id}/input_items"),
                         ("DELETE", f"/v1/responses/{response_id}")):
        other = send(guarded, method, path, "key-from-file")
        assert other.status_code == 404 and other.json()["error"]["code"] == "response_not_found", (path, other.text)
    chained = send(guarded, "POST", "/v1/responses", "key-from-env-a",
                   {"model": MODEL, "input": "And of Germany?", "previous_response_id": response_id})
    assert chained.status_code == 400 and chained.json()["error"]["code"] == "previous_response_not_found"
    assert send(guarded, "GET", f"/v1/responses/{response_id}", "key-from-flag").json()["id"] == response_id
    assert send(guarded, "DELETE", f"/v1/responses/{response_id}", "key-from-flag").json()["deleted"] is True


PROTECTED_KEY = "key-for-everything"


@pytest.fixture(scope="module")
def protected():
    process = ServerProcess("--api-key", PROTECTED_KEY, "--protect-metrics", api_key=PROTECTED_KEY)
    yield process
    process.stop()


def test_protect_metrics_puts_every_route_behind_the_key(protected):
    for path in ("/health", "/metrics", "/version", "/openapi.json", "/v1/models"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = httpx.get(f"{protected.base_url}{path}", headers=headers)
            assert response.status_code == 401, (path, response.text)
            assert response.json()["error"]["code"] == "invalid_api_key"
        response = httpx.get(f"{protected.base_url}{path}", headers={"Authorization": f"Bearer {PROTECTED_KEY}"})
        assert response.status_code == 200, (path, response.text)
    assert protected.metric("heron:num_requests_running") == 0  # a scraper with the key reads the metrics
    # but the chat page, which asks for the key itself: behind it, a browser could never load the page
    assert httpx.get(f"{protected.base_url}/").status_code == 200
    assert post(protected, PROTECTED_KEY, {"model": MODEL, "prompt": "hi", "max_tokens": 1}).status_code == 200


def test_a_huge_prompt_is_counted_off_the_event_loop(protected):
    """An 8 MB prompt (under the default 10 MiB body limit, refused once
    counted) was tokenized on the event loop: for its ~10 s every stream froze
    and /health did not answer."""
    prompt = "the heron stood in the shallow water at dawn. " * 180_000
    finished: dict = {}

    def send_it() -> None:
        answer = httpx.post(f"{protected.base_url}/v1/completions", timeout=300,
                            headers={"Authorization": f"Bearer {PROTECTED_KEY}"},
                            json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
        finished.update(at=time.monotonic(), status=answer.status_code)

    sender = threading.Thread(target=send_it)
    sender.start()
    time.sleep(1.0)  # its body is in; its tokens are being counted
    asked = time.monotonic()
    health = httpx.get(f"{protected.base_url}/health", headers={"Authorization": f"Bearer {PROTECTED_KEY}"},
                       timeout=300)
    answered = time.monotonic()
    sender.join(300)
    assert health.status_code == 200 and finished["status"] == 400  # past max_model_len
    assert answered - asked < 1.5, f"/health waited {answered - asked:.1f} s"
    assert finished["at"] > answered, "the prompt was counted before /health was asked: no overlap to judge"


def test_protect_metrics_without_a_key_is_refused_at_start_up():
    process = ServerProcess("--protect-metrics", env={"HERON_API_KEY": ""}, wait_ready=False)
    try:
        assert process.process.wait(60) == 2
        log = process.read_log()
        assert "--protect-metrics needs an API key" in log, log
        assert "engine core" not in log  # refused before anything started
    finally:
        process.stop()


def test_rate_limit_is_per_key_with_retry_after(guarded):
    """The burst is spent on /v1/models, which the limit counts and which takes
    milliseconds: completions taking 0.5 s or more each (a loaded machine) let
    the bucket refill as fast as it drained, and no 429 ever came."""
    time.sleep(3.0)  # refill the bucket used by the previous test
    with httpx.Client(base_url=guarded.base_url, headers={"Authorization": "Bearer key-from-env-a"}) as client:
        codes = [client.get("/v1/models").status_code for _ in range(6)]
        assert codes[:3] == [200, 200, 200] and 429 in codes[3:], codes
        limited = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert limited.status_code == 429 and int(limited.headers["Retry-After"]) >= 1
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert post(guarded, "key-from-file", {"model": MODEL, "prompt": "hi", "max_tokens": 1}).status_code == 200


def test_request_body_size_limit(guarded):
    response = post(guarded, "key-from-flag", {"model": MODEL, "prompt": "x" * 10000, "max_tokens": 1})
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"


def test_request_timeout_aborts_and_reports(guarded):
    time.sleep(1.0)
    body = {"model": MODEL, "prompt": "Go on and on.", "max_tokens": 400, "ignore_eos": True}
    started = time.monotonic()
    response = post(guarded, "key-from-flag", body)
    assert response.status_code == 504 and response.json()["error"]["code"] == "request_timeout"
    assert time.monotonic() - started < 10
    deadline = time.monotonic() + 5
    while guarded.metric("heron:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert guarded.metric("heron:num_requests_running") == 0
    time.sleep(1.0)
    chunks = []
    headers = {"Authorization": "Bearer key-from-file"}
    with httpx.stream("POST", f"{guarded.base_url}/v1/completions", json={**body, "stream": True},
                      headers=headers, timeout=30) as stream:
        chunks = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert '"request_timeout"' in chunks[-2] and chunks[-1] == "data: [DONE]"
    # a Responses stream ends with its own event, response.failed, and no [DONE] (it sent the chat
    # error line and [DONE], which the official client turns into an exception with no failed response)
    time.sleep(1.0)
    body = {"model": MODEL, "input": "Go on and on.", "max_output_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{guarded.base_url}/v1/responses", json=body, headers=headers, timeout=30) as stream:
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: ")]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    terminal = events[-1]
    if terminal["type"] == "response.failed":
        assert terminal["response"]["status"] == "failed"
        assert "did not finish within 1.5 s" in terminal["response"]["error"]["message"]
        assert all(item["status"] != "in_progress" for item in terminal["response"]["output"])
    else:  # the model ended its answer (EOS: the Responses API has no ignore_eos) within the timeout
        assert terminal["type"] in ("response.completed", "response.incomplete")


@pytest.fixture(scope="module")
def bounded():
    process = ServerProcess("--max-waiting-requests", "2", "--max-num-seqs", "2")
    yield process
    process.stop()


def test_max_waiting_requests_rejects_the_overflow(bounded):
    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=300) as client:
            async def one(i: int) -> int:
                body = {"model": MODEL, "prompt": f"Story {i}: " + "once upon a time " * 20, "max_tokens": 12,
                        "ignore_eos": True}
                response = await client.post(f"{bounded.base_url}/v1/completions", json=body)
                if response.status_code == 429:
                    assert response.json()["error"]["code"] == "server_overloaded"
                    assert "Retry-After" in response.headers
                return response.status_code
            return await asyncio.gather(*[one(i) for i in range(12)])

    codes = asyncio.run(run())
    assert set(codes) <= {200, 429}
    assert codes.count(200) >= 2 and codes.count(429) >= 1


def test_the_waiting_bound_counts_each_prompt_and_choice(bounded):
    """A completion of 256 prompts passed a bound of 2 whole: the bound was checked once per request."""
    def post_batch(prompts: list[str], n: int = 1) -> httpx.Response:
        return httpx.post(f"{bounded.base_url}/v1/completions", timeout=120,
                          json={"model": MODEL, "prompt": prompts, "max_tokens": 2, "n": n})

    assert post_batch(["a", "b"]).status_code == 200  # two sequences: within the bound
    for prompts, n in ((["a", "b", "c"], 1), (["a", "b"], 2)):
        refused = post_batch(prompts, n)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "too_many_sequences", refused.text


def test_dead_engine_gives_503_and_health_says_so(bounded):
    os.kill(bounded.engine_core_pid(), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while httpx.get(f"{bounded.base_url}/health").status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    health = httpx.get(f"{bounded.base_url}/health")
    assert health.status_code == 503 and health.json()["status"] == "dead"
    response = httpx.post(f"{bounded.base_url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=10)
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make certificates")
def test_tls_with_a_certificate_chain(tmp_path):
    """The server presents its certificate and the intermediate CA's; a client
    trusting only the root CA verifies it (by address and by name), a client
    that does not trust that root refuses it, and plain HTTP is not served."""
    chain = make_certificate_chain(tmp_path)
    assert verifies(chain, with_intermediate=True) and not verifies(chain, with_intermediate=False)
    process = ServerProcess("--ssl-keyfile", chain.server_key, "--ssl-certfile", chain.server_chain,
                            tls_cert=chain.root_ca)
    try:
        assert process.base_url.startswith("https://")
        trusting = ssl.create_default_context(cafile=chain.root_ca)
        client = openai.OpenAI(base_url=f"{process.base_url}/v1", api_key="unused", max_retries=0,
                               http_client=httpx.Client(verify=trusting))
        assert client.models.list().data[0].id == MODEL
        completion = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert completion.usage.completion_tokens == 2
        assert httpx.get(f"https://localhost:{process.port}/health", verify=trusting).status_code == 200
        (tmp_path / "other").mkdir()
        stranger = make_certificate_chain(tmp_path / "other")  # another root, as an impostor's
        for verify in (ssl.create_default_context(), ssl.create_default_context(cafile=stranger.root_ca)):
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                httpx.get(f"{process.base_url}/health", verify=verify, timeout=5)
        untrusting = openai.OpenAI(base_url=f"{process.base_url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIConnectionError):
            untrusting.models.list()
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served
            httpx.get(f"http://127.0.0.1:{process.port}/health", timeout=5)
    finally:
        process.stop()
