"""`heron router` over two live `heron serve` replicas on loopback: prefix
affinity proven by the replicas' own prefix-cache hit counters, the official
client through the router, 4xx answers that never open a breaker, a killed
replica routed around (a stream it was serving ends with an error event), and
the replica used again once it is back."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest
from openai import OpenAI

from tests.e2e.router_process import RouterProcess
from tests.e2e.server_process import ServerProcess, complete_together, wait_for

pytestmark = pytest.mark.slow

KV_EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"})
SYSTEM = ("You are a patient guide to the birds of estuaries and salt marshes. Answer in one short sentence, "
          "name the bird, and say where it feeds. ") * 3


def replica(port: int | None = None) -> ServerProcess:
    return ServerProcess("--kv-events-config", KV_EVENTS, "--max-num-seqs", "8", port=port)


def hits(server: ServerProcess) -> float:
    """Prompt tokens the replica found in its prefix cache (0 before its first request)."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=5).text
    assert "# TYPE heron:prefix_cache_hits_total counter" in text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("heron:prefix_cache_hits_total{"))


@pytest.fixture(scope="module")
def fleet():
    replicas = [replica(), replica()]
    router = RouterProcess([r.base_url for r in replicas])
    try:
        wait_for(lambda: all(state["kv_events"] for state in router.replicas().values()))
        yield router, replicas
    finally:
        router.stop()
        for server in replicas:
            server.stop()


def chat(router: RouterProcess, question: str, **extra) -> httpx.Response:
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}], **extra}
    return httpx.post(f"{router.base_url}/v1/chat/completions", json=body, timeout=60)


def test_a_shared_prefix_goes_where_it_is_cached(fleet):
    router, replicas = fleet
    before = {r.base_url: hits(r) for r in replicas}
    requests_before = {url: state["requests"] for url, state in router.replicas().items()}
    assert chat(router, "Which bird stands still in the shallows?").status_code == 200
    first = next(url for url, state in router.replicas().items() if state["requests"] > requests_before[url])
    wait_for(lambda: router.replicas()[first]["cached_blocks"] > 0)  # its events reached the router
    for question in ("Which bird probes the mud?", "Which bird dives for fish?", "Which bird skims the water?"):
        assert chat(router, question).status_code == 200
    after = {url: state["requests"] for url, state in router.replicas().items()}
    assert after[first] - requests_before[first] == 4, after  # every follow-up went to the cached replica
    cached = next(r for r in replicas if r.base_url == first)
    other = next(r for r in replicas if r.base_url != first)
    assert hits(cached) - before[first] >= 3 * 16 * 3  # each follow-up hit the system prompt's blocks
    assert hits(other) == before[other.base_url]


def test_a_router_joining_late_rebuilds_each_replicas_cache_from_replayed_events(fleet):
    """A second router started after traffic it never saw: its index of each
    replica comes from the replayed event batches alone, equals the live
    router's (both equal the replica's cache), and routes by it."""
    router, replicas = fleet
    system = "You are a careful tide-table reader. Give the time of the next high water and nothing else. " * 3
    served = replicas[1]
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Leith, today?"}]}
    assert httpx.post(f"{served.base_url}/v1/chat/completions", json=body, timeout=60).status_code == 200
    late = RouterProcess([r.base_url for r in replicas])
    try:
        wait_for(lambda: all(state["kv_events"] for state in late.replicas().values()))

        def same_index() -> bool:
            live, replayed = router.replicas(), late.replicas()
            return all(live[url]["cached_blocks"] == replayed[url]["cached_blocks"] > 0 for url in live)

        wait_for(same_index)
        other = next(r for r in replicas if r is not served)
        before = {r.base_url: hits(r) for r in replicas}
        body["messages"][1]["content"] = "Dover, tomorrow?"
        assert httpx.post(f"{late.base_url}/v1/chat/completions", json=body, timeout=60).status_code == 200
        assert late.replicas()[served.base_url]["requests"] == 1  # sent where the replay said the prefix is
        assert hits(served) - before[served.base_url] >= 3 * 16
        assert hits(other) == before[other.base_url]
    finally:
        late.stop()


def test_the_openai_client_streams_through_the_router(fleet):
    router, _ = fleet
    client = OpenAI(base_url=f"{router.base_url}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "What is the capital of Japan?"}],
        max_tokens=8, temperature=0, stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert "Tokyo" in text
    assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
    assert client.models.retrieve("SmolLM2-135M-Instruct").id == "SmolLM2-135M-Instruct"
    # the chat page, whose relative requests then come through the router too (it was a 404)
    page = httpx.get(f"{router.base_url}/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'fetch("v1/chat/completions"' in page.text


def test_stored_responses_are_followed_to_the_replica_that_holds_them(fleet):
    """Each replica keeps its own responses: a follow-up, a GET and a DELETE
    reach the one that answered (the router learns the id from the answer)."""
    router, _ = fleet
    client = OpenAI(base_url=f"{router.base_url}/v1", api_key="unused")
    answer = client.responses.create(model="SmolLM2-135M-Instruct", input="Name a heron.", max_output_tokens=4)
    for turn in range(6):  # spread by load, half of these would miss without affinity
        stream = client.responses.create(model="SmolLM2-135M-Instruct", input=f"And another ({turn})?",
                                         previous_response_id=answer.id, max_output_tokens=4, stream=turn % 2 == 1)
        answer = list(stream)[-1].response if turn % 2 == 1 else stream
        assert answer.status in ("completed", "incomplete")
    assert client.responses.retrieve(answer.id).id == answer.id
    # its input items too, with their query (order, limit) passed on: the path was a 404 at the router
    for _ in range(4):
        [item] = client.responses.input_items.list(answer.id, order="asc", limit=5).data
        assert item.content[0].text.startswith("And another (5)")
    client.responses.delete(answer.id)
    assert httpx.get(f"{router.base_url}/v1/responses/{answer.id}", timeout=10).status_code == 404


def test_client_errors_pass_through_and_never_open_a_breaker(fleet):
    router, _ = fleet
    for _ in range(8):
        response = chat(router, "hello", max_tokens=-1)
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    assert all(state["state"] == "closed" for state in router.replicas().values())


def test_a_prefix_cache_reset_through_the_router_reaches_every_replica(fleet):
    """The router answered 404: each replica had to be called."""
    router, replicas = fleet
    question = "Which bird nests on the saltmarsh?"
    assert chat(router, question).status_code == 200
    wait_for(lambda: sum(state["cached_blocks"] for state in router.replicas().values()) > 0)
    reset = httpx.post(f"{router.base_url}/reset_prefix_cache", timeout=60)
    assert reset.status_code == 200, reset.text
    answers = reset.json()["replicas"]
    assert reset.json()["reset"] is True and answers.keys() == {r.base_url for r in replicas}
    assert all(answer == {"status": 200, "answer": {"reset": True}} for answer in answers.values()), answers
    # the replicas' "all blocks cleared" events emptied the router's index
    wait_for(lambda: all(state["cached_blocks"] == 0 for state in router.replicas().values()))
    before = {r.base_url: hits(r) for r in replicas}
    assert chat(router, question).status_code == 200
    assert all(hits(r) == before[r.base_url] for r in replicas)  # nothing was left to hit


def test_a_killed_replica_is_routed_around_and_used_again_when_back(fleet):
    router, replicas = fleet
    # a long stream, then kill the replica serving it
    lines: list[str] = []

    def stream() -> None:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 400,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{router.base_url}/v1/completions", json=body, timeout=60) as response:
            lines.extend(line for line in response.iter_lines() if line)

    reader = threading.Thread(target=stream)
    reader.start()
    wait_for(lambda: any(state["in_flight"] for state in router.replicas().values()))
    busy_url = next(url for url, state in router.replicas().items() if state["in_flight"])
    victim = next(r for r in replicas if r.base_url == busy_url)
    survivor = next(r for r in replicas if r is not victim)
    wait_for(lambda: len(lines) > 3)
    os.kill(victim.engine_core_pid(), signal.SIGKILL)
    victim.process.kill()
    reader.join(30)
    assert not reader.is_alive(), "the client hung on a dead replica's stream"
    assert lines[-1] == "data: [DONE]" and any('"error"' in line for line in lines[-3:]), lines[-3:]
    # no request is lost: every new one lands on the survivor (retried before its first byte if needed)
    for question in ("Which bird hunts at night?", "Which bird nests on cliffs?", "Which bird wades?"):
        assert chat(router, question).status_code == 200
    wait_for(lambda: router.replicas()[busy_url]["state"] != "closed")
    assert router.replicas()[busy_url]["cached_blocks"] == 0  # its index went with it
    victim.stop()
    # back on the same port: probes close its breaker, it re-subscribes, and it takes requests again
    replicas[replicas.index(victim)] = revived = replica(port=int(busy_url.rsplit(":", 1)[1]))
    wait_for(lambda: router.replicas()[busy_url]["state"] == "closed" and router.replicas()[busy_url]["kv_events"])
    before = router.replicas()[revived.base_url]["requests"]

    complete_together(router.base_url, 4)
    assert router.replicas()[revived.base_url]["requests"] > before
    assert router.replicas()[survivor.base_url]["state"] == "closed"


def test_a_chat_stream_whose_engine_dies_before_its_first_token_is_served_by_the_other_replica():
    """A replica's API server whose engine core dies before a stream's first token
    answers that stream with the engine_dead error as its first event (after the
    head): the router passed it on though the other replica was idle (found by
    the fleet review). It is now that replica's refusal, retried elsewhere."""
    replicas = [ServerProcess(), ServerProcess()]
    router = RouterProcess([r.base_url for r in replicas], "--policy", "round_robin")
    try:
        held = replicas[0].engine_core_pid()
        os.kill(held, signal.SIGSTOP)  # its stream waits for a first output that never comes
        streams: list[list[str]] = [[], []]

        def stream(lines: list[str]) -> None:
            body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0, "stream": True,
                    "messages": [{"role": "user", "content": "What is the capital of Japan?"}]}
            with httpx.stream("POST", f"{router.base_url}/v1/chat/completions", json=body, timeout=60) as response:
                lines.extend(line for line in response.iter_lines() if line)

        readers = [threading.Thread(target=stream, args=(lines,)) for lines in streams]
        for reader in readers:
            reader.start()
        wait_for(lambda: all(state["in_flight"] == 1 for state in router.replicas().values()),
                 what="one stream on each replica")
        os.kill(held, signal.SIGKILL)
        for reader in readers:
            reader.join(60)
            assert not reader.is_alive()
        texts = []
        for lines in streams:
            assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines), lines
            chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
            texts.append("".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]))
        assert texts[0] == texts[1] and "Tokyo" in texts[0]
        metrics = httpx.get(f"{router.base_url}/metrics", timeout=5).text
        assert "heron_router_retries_total 1.0" in metrics.splitlines()
    finally:
        router.stop()
        for server in replicas:
            server.stop()
