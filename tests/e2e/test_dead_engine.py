"""A dying engine under load (issue #20, item 3): the engine-core process is
SIGKILLed while a stream and a plain request are under way. /health says so
within a second, the stream ends with an error event and [DONE], the plain
request gets a 503, new requests get 503 (engine_dead), and after
--dead-engine-grace seconds `heron serve` exits with code 1, for a supervisor
to restart it, with no process left behind."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx

from tests.e2e.server_process import ServerProcess, wait_for

MODEL = "SmolLM2-135M-Instruct"
GRACE = 5.0


def test_a_killed_engine_fails_every_request_then_the_server_exits_for_its_supervisor():
    server = ServerProcess("--dead-engine-grace", str(GRACE))
    try:
        stream_lines: list[str] = []
        plain: list[httpx.Response] = []
        body = {"model": MODEL, "prompt": "Tell me about herons. " * 4, "max_tokens": 400, "ignore_eos": True}

        def stream() -> None:
            with httpx.stream("POST", f"{server.base_url}/v1/completions", json={**body, "stream": True},
                              timeout=60) as response:
                stream_lines.extend(line for line in response.iter_lines() if line)

        def request() -> None:
            plain.append(httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60))

        readers = [threading.Thread(target=stream), threading.Thread(target=request)]
        for reader in readers:
            reader.start()
        wait_for(lambda: len(stream_lines) > 3, what="the stream to start")
        engine = server.engine_core_pid()
        os.kill(engine, signal.SIGKILL)
        killed = time.monotonic()
        # the API server looks at its engine every 0.5 s: 2.5 s leaves a loaded machine room, within the grace
        wait_for(lambda: httpx.get(f"{server.base_url}/health", timeout=1).status_code == 503, timeout=2.5,
                 what="/health to answer 503")
        assert httpx.get(f"{server.base_url}/health", timeout=1).json()["status"] == "dead"
        for reader in readers:
            reader.join(10)
            assert not reader.is_alive(), "a request hung on a dead engine"
        assert stream_lines[-1] == "data: [DONE]" and '"error"' in stream_lines[-2], stream_lines[-3:]
        assert plain[0].status_code == 503 and plain[0].json()["error"]["code"] == "engine_dead"
        late = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=10)
        assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead"
        # a dead engine runs nothing: the gauges kept its last step's figures (2 running)
        assert server.metric("heron:num_requests_running") == 0 and server.metric("heron:kv_cache_usage_perc") == 0
        assert server.process.wait(GRACE + 15) == 1
        assert time.monotonic() - killed >= GRACE  # clients saw the 503s first
        assert not os.path.exists(f"/proc/{engine}") or open(f"/proc/{engine}/stat").read().split()[2] == "Z"
    finally:
        server.stop()


def test_a_stopped_engine_is_found_by_its_silence_and_killed():
    """A SIGSTOPped engine core never exits: /health said ok for ever and every
    request hung. Its heartbeats stop, and after --engine-heartbeat-timeout it
    counts as dead: the stream ends with an error event, /health says dead, the
    server exits 1 after the grace, and the stopped process is killed."""
    server = ServerProcess("--dead-engine-grace", "2", "--engine-heartbeat-timeout", "3")
    try:
        stream_lines: list[str] = []
        body = {"model": MODEL, "prompt": "Tell me about herons.", "max_tokens": 400, "ignore_eos": True,
                "stream": True}

        def stream() -> None:
            with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
                stream_lines.extend(line for line in response.iter_lines() if line)

        reader = threading.Thread(target=stream)
        reader.start()
        wait_for(lambda: len(stream_lines) > 3, what="the stream to start")
        engine = server.engine_core_pid()
        os.kill(engine, signal.SIGSTOP)
        wait_for(lambda: httpx.get(f"{server.base_url}/health", timeout=1).status_code == 503, timeout=10,
                 what="/health to answer 503")
        assert "--engine-heartbeat-timeout" in httpx.get(f"{server.base_url}/health", timeout=1).text
        reader.join(10)
        assert not reader.is_alive(), "a request hung on a stopped engine"
        assert stream_lines[-1] == "data: [DONE]" and '"error"' in stream_lines[-2], stream_lines[-3:]
        assert server.process.wait(30) == 1
        assert not os.path.exists(f"/proc/{engine}") or open(f"/proc/{engine}/stat").read().split()[2] == "Z"
    finally:
        server.stop()


def test_a_chat_stream_whose_engine_dies_before_its_first_token_begins_with_the_error():
    """A chat stream's first chunk (the role) went out at once, before the
    engine's first output: an engine core that died before it left an error
    after a chunk of the answer, and a router in front could not tell it from
    a stream under way (found by the fleet review). The role now comes with the
    first output, so the error is the stream's first event, which the router
    retries on another replica."""
    server = ServerProcess("--dead-engine-grace", str(GRACE))
    try:
        lines: list[str] = []
        head = threading.Event()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": True}

        def stream() -> None:
            with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=60) as response:
                head.set()
                lines.extend(line for line in response.iter_lines() if line)

        engine = server.engine_core_pid()
        os.kill(engine, signal.SIGSTOP)  # held: the request waits for its first output
        reader = threading.Thread(target=stream)
        reader.start()
        assert head.wait(10)
        time.sleep(1.0)
        assert lines == []  # nothing of the answer before the engine's first output
        os.kill(engine, signal.SIGKILL)
        reader.join(15)
        assert not reader.is_alive()
        assert len(lines) == 2 and lines[-1] == "data: [DONE]", lines
        assert json.loads(lines[0].removeprefix("data: "))["error"]["code"] == "engine_dead"
    finally:
        server.stop()
