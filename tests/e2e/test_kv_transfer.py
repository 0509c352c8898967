"""Prefill/decode disaggregation through live processes: `heron router --prefill
URL --decode URL` over a prefill server (kv_producer) and a decode server
(kv_consumer). The decode server pulls each prompt's KV from the prefill
server instead of prefilling it, answers exactly what a plain server answers
(greedy, official `openai` client, streamed and not), the prefill server's
blocks are freed once pulled, and a dead prefill server costs a recompute,
never a failed request."""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import zmq

from tests.e2e.router_process import RouterProcess
from tests.e2e.server_process import ServerProcess, wait_for

PROMPT = "A grey heron stands motionless in the shallows of the estuary, " * 12  # ~150 tokens


def kv_role(role: str) -> tuple[str, str]:
    return "--kv-transfer-config", json.dumps({"kv_connector": "HeronConnector", "kv_role": role})


@pytest.fixture(scope="module")
def disaggregated():
    prefill = ServerProcess(*kv_role("kv_producer"))
    decode = ServerProcess(*kv_role("kv_consumer"))
    router = RouterProcess([decode.base_url], "--prefill", prefill.base_url, "--policy", "round_robin")
    yield prefill, decode, router
    router.stop()
    decode.stop()
    prefill.stop()


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def complete(base_url: str, prompt: str = PROMPT, **extra):
    return client(base_url).completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=12,
                                               temperature=0, **extra)


def pulled_tokens(usage) -> int:
    """Every full block of the prompt but one holding its last token."""
    return (usage.prompt_tokens - 1) // 16 * 16


def test_the_decode_server_pulls_the_prompt_and_answers_as_a_plain_server(disaggregated):
    prefill, decode, router = disaggregated
    routed = complete(router.base_url)  # the decode server never saw this prompt
    assert routed.usage.prompt_tokens_details.cached_tokens == pulled_tokens(routed.usage) > 0
    assert routed.choices[0].text == complete(prefill.base_url).choices[0].text  # a server on its own
    other = PROMPT.replace("estuary", "mudflat")
    stream = client(router.base_url).completions.create(model="SmolLM2-135M-Instruct", prompt=other, max_tokens=12,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True})
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens == pulled_tokens(usage)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == complete(prefill.base_url, other).choices[0].text
    assert prefill.metric("heron:request_success_total") >= 4  # two one-token prefills, two direct requests
    # once pulled, the prefill server's blocks are free again
    wait_for(lambda: prefill.metric("heron:kv_cache_usage_perc") == 0, what="the prefill server's leases released")


def test_chat_goes_through_a_prefill_server_too(disaggregated):
    _, decode, router = disaggregated
    messages = [{"role": "user", "content": "Name three wading birds that live on estuaries, please. " * 6}]
    routed = client(router.base_url).chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                                             max_tokens=10, temperature=0)
    assert routed.usage.prompt_tokens_details.cached_tokens > 0  # pulled, not computed
    direct = client(decode.base_url).chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                                             max_tokens=10, temperature=0)
    assert routed.choices[0].message.content == direct.choices[0].message.content


def test_a_client_that_reuses_a_request_id_is_answered(disaggregated):
    _, decode, _ = disaggregated
    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)  # takes the pull and never answers: the engine keeps the request
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    handle = {"do_remote_prefill": True, "remote_engine_address": f"tcp://127.0.0.1:{port}",
              "remote_request_id": "elsewhere", "remote_num_blocks": 5, "remote_block_size": 16}
    url = f"{decode.base_url}/v1/completions"
    prompt = PROMPT.replace("heron", "egret")  # not cached there: the engine pulls it
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "request_id": "reused"}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up while the pull waits
        httpx.post(url, json={**body, "kv_transfer_params": handle}, timeout=1)
    assert silent.poll(10_000)  # the pull is under way: the engine still holds that request
    with ThreadPoolExecutor(2) as pool:  # the same id again, twice at once
        answers = list(pool.map(lambda _: httpx.post(url, json=body, timeout=60), range(2)))
    for answer in answers:
        assert answer.status_code == 200 and answer.json()["id"] == "reused"
        choice = answer.json()["choices"][0]
        assert choice["finish_reason"] == "length" and choice["text"]
    silent.close(0)
    context.term()


def test_a_streamed_prefill_for_another_engine_is_a_400(disaggregated):
    """The handle comes in the finished body: a stream never carried it, and the
    prefill server held the blocks for nothing until the lease ran out."""
    prefill, _, _ = disaggregated
    response = httpx.post(f"{prefill.base_url}/v1/completions", json={
        "prompt": "hi", "max_tokens": 1, "stream": True, "kv_transfer_params": {"do_remote_decode": True}}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream", response.text


@pytest.mark.parametrize("refused_for", [{"max_tokens": 1000}, {"max_tokens": 0}, {"max_tokens": 1, "n": "two"}],
                         ids=["too-long", "max_tokens-0", "n-not-a-number"])
def test_a_request_the_decode_server_refuses_frees_its_prefill_lease_at_once(disaggregated, refused_for):
    """A request the decode server refuses (a 400: too long for its context, or
    a body that fails the request schema itself) left the prefill server's
    blocks under their lease for its 30 s: a burst of such mistakes filled the
    prefill server's pool. (It runs before the test that kills the prefill
    server.)"""
    prefill, decode, _ = disaggregated
    wait_for(lambda: prefill.metric("heron:kv_cache_usage_perc") == 0, what="earlier leases released")
    prefilled = httpx.post(f"{prefill.base_url}/v1/completions", timeout=60, json={
        "prompt": PROMPT.replace("heron", "egret"), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    handle = prefilled.json()["kv_transfer_params"]
    assert prefill.metric("heron:kv_cache_usage_perc") > 0  # held for the decode server
    refused = httpx.post(f"{decode.base_url}/v1/completions", timeout=60, json={
        "prompt": PROMPT.replace("heron", "egret"), **refused_for, "kv_transfer_params": handle})
    assert refused.status_code == 400, refused.text
    wait_for(lambda: prefill.metric("heron:kv_cache_usage_perc") == 0, timeout=10, what="the lease released")


def test_a_dead_prefill_server_costs_a_recompute_not_a_request(disaggregated):
    prefill, decode, router = disaggregated
    prefill.process.send_signal(signal.SIGKILL)
    prefill.process.wait(10)
    answer = complete(router.base_url, extra_body={"user": "after the prefill server died"})
    assert answer.choices[0].text and answer.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body, message", [
    ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_consumer"),
    ({"kv_transfer_params": {"do_remote_prefill": True, "remote_engine_address": "http://x", "remote_request_id": "r",
                             "remote_num_blocks": 1, "remote_block_size": 16}}, "tcp://"),
    ({"kv_transfer_params": {"do_remote_prefill": True, "remote_engine_address": "tcp://127.0.0.1:1",
                             "remote_request_id": "r", "remote_num_blocks": -1, "remote_block_size": 16}},
     "remote_num_blocks"),
    ({"n": 2, "kv_transfer_params": {"do_remote_decode": True}}, "n = 1"),
])
def test_kv_transfer_params_a_server_cannot_honour_are_400s(disaggregated, body, message):
    _, decode, _ = disaggregated
    response = httpx.post(f"{decode.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body},
                          timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == "kv_transfer_params"


def test_a_failed_pull_under_the_fail_policy_is_a_500_naming_why():
    """The engine serves on; the client is told, not handed an empty 200 with
    finish_reason "abort" (the reason only in the server's log), and the metric
    counts it as finished_reason "error"."""
    strict = ServerProcess(*kv_role("kv_consumer"), "--kv-load-failure-policy", "fail")
    try:
        handle = {"do_remote_prefill": True, "remote_engine_address": "tcp://127.0.0.1:9",
                  "remote_request_id": "r", "remote_num_blocks": 5, "remote_block_size": 8}  # this engine's are 16
        body = {"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": handle}
        url = f"{strict.base_url}/v1/completions"
        response = httpx.post(url, json=body, timeout=60)
        assert response.status_code == 500, response.text
        error = response.json()["error"]
        assert error["code"] == "engine_error" and "blocks hold 8 tokens" in error["message"]
        assert response.headers["x-heron-request-failure"] == "kv_load"  # a router blames no replica for it
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as streamed:
            lines = [line for line in streamed.iter_lines() if line]
        assert streamed.status_code == 200 and "blocks hold 8 tokens" in lines[-2] and lines[-1] == "data: [DONE]"
        assert strict.metric("heron:request_success_total", finished_reason="error") == 2
        assert complete(strict.base_url).choices[0].finish_reason == "length"  # it serves on
    finally:
        strict.stop()
