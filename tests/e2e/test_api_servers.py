"""`heron serve --api-server-count 2 --data-parallel-size 2`: two API-server
processes on one port, each talking to both engine cores. Connections reach
both; answers are right; /metrics from either counts every request once; the
rate limit holds for the server, not per process; a dying API server takes the
whole server down cleanly, and so does SIGINT (two API servers over one
engine core there); the waiting-request bound holds for the server too."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.server_process import ServerProcess, descendants, wait_for

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEYS = ("key-traffic", "key-limited")
BURST = 12


def api_server_pids(server: ServerProcess) -> list[int]:
    return [pid for pid, command in descendants(server.process.pid).items() if "api_server_proc" in command]


def gone(pids: list[int], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(os.path.exists(f"/proc/{pid}") for pid in pids):
            return True
        time.sleep(0.2)
    return False


def start(data_parallel_size: int = 2, *more: str) -> ServerProcess:
    keys = [arg for key in KEYS for arg in ("--api-key", key)]
    return ServerProcess("--api-server-count", "2", "--data-parallel-size", str(data_parallel_size),
                         "--max-num-seqs", "8", "--rate-limit", "0.001", "--rate-limit-burst", str(BURST), *keys,
                         *more)


def test_two_api_servers_share_the_port_the_metrics_and_the_limits():
    server = start()
    try:
        family = descendants(server.process.pid)
        assert len(api_server_pids(server)) == 2
        assert sum("heron.engine.core_proc" in command for command in family.values()) == 2
        # new connections land on both API servers (SO_REUSEPORT spreads them)
        answered = {httpx.get(f"{server.base_url}/health", timeout=5).json()["api_server"] for _ in range(40)}
        assert answered == {0, 1}

        client = OpenAI(base_url=f"{server.base_url}/v1", api_key=KEYS[0])
        client.completions.create(model=MODEL, prompt="Warm up", max_tokens=1)  # the counters' first series
        time.sleep(0.5)
        success_before = server.metric("heron:request_success_total")
        queries_before = server.metric("heron:prefix_cache_queries_total")
        prompt_tokens = 0
        for _ in range(3):  # each on a fresh connection
            fresh = OpenAI(base_url=f"{server.base_url}/v1", api_key=KEYS[0], http_client=httpx.Client())
            answer = fresh.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "What is the capital of Japan?"}],
                max_tokens=8, temperature=0)
            assert "Tokyo" in answer.choices[0].message.content
            prompt_tokens += answer.usage.prompt_tokens
        stream = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                           temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "Paris" in "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
        prompt_tokens += chunks[-1].usage.prompt_tokens
        time.sleep(0.5)  # the last step's statistics reach the API servers
        # request metrics add up over both processes; the engines' counters are not doubled
        for _ in range(4):
            assert server.metric("heron:request_success_total") - success_before == 4
            assert server.metric("heron:prefix_cache_queries_total") - queries_before == prompt_tokens
        assert server.metric("heron:compute_path_info", device="cpu") == 1.0
        assert sum(server.metric("heron:engine_requests", engine=str(rank)) for rank in (0, 1)) >= 4
        # what a router's probe asks for: those samples alone, whichever process answers
        wanted = {"heron:num_requests_running", "heron:request_success_total"}
        for _ in range(4):
            only = httpx.get(f"{server.base_url}/metrics", params=[("name[]", name) for name in wanted],
                             headers=server.headers, timeout=5)
            named = {sample.name for family in text_string_to_metric_families(only.text) for sample in family.samples}
            assert named == wanted

        # one burst for the key across both processes (a per-process limit would pass up to twice as many)
        statuses = [httpx.get(f"{server.base_url}/v1/models", timeout=5,
                              headers={"Authorization": f"Bearer {KEYS[1]}"}).status_code for _ in range(3 * BURST)]
        assert statuses.count(200) == BURST and statuses.count(429) == 2 * BURST, statuses
    finally:
        server.stop()
    assert server.process.returncode == 0


def test_a_dead_api_server_stops_the_whole_server_and_sigint_stops_it_cleanly():
    server = start(data_parallel_size=1)  # two API servers over one engine core
    answer = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                        headers={"Authorization": f"Bearer {KEYS[0]}"},
                        json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
                              "temperature": 0})
    assert answer.status_code == 200 and "Paris" in answer.json()["choices"][0]["text"]
    family = list(descendants(server.process.pid))
    victim = api_server_pids(server)[0]
    os.kill(victim, signal.SIGKILL)
    assert server.process.wait(30) == 1  # the launcher noticed and stopped the rest
    assert gone(family), descendants(server.process.pid)
    assert "exited with code -9: stopping the others" in server.read_log()
    server.stop()

    # started as a background job of a script starts it (SIGINT ignored, inherited): SIGINT still stops it
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        server = start()
    finally:
        signal.signal(signal.SIGINT, previous)
    family = list(descendants(server.process.pid))
    server.process.send_signal(signal.SIGINT)
    try:
        assert server.process.wait(30) == 0
    except subprocess.TimeoutExpired:
        server.process.kill()
        raise
    assert gone(family)
    server.stop()


def test_a_dead_engine_core_gets_503s_for_the_grace_under_several_api_servers():
    """--dead-engine-grace holds with several API servers: the launcher used to
    stop them as soon as an engine core ended, so /health and new requests met
    refused connections after 0.3 s instead of 503s for the grace. The reason
    no longer reads "code -1" (an API server cannot know the code)."""
    server = start(1, "--dead-engine-grace", "3")
    family = list(descendants(server.process.pid))
    [engine] = [pid for pid, command in descendants(server.process.pid).items() if "heron.engine.core_proc" in command]
    killed = time.monotonic()
    os.kill(engine, signal.SIGKILL)
    answers = []
    while time.monotonic() - killed < 2.5:
        try:
            answers.append(httpx.get(f"{server.base_url}/health", timeout=5).status_code)
        except httpx.TransportError as exc:
            answers.append(type(exc).__name__)
        time.sleep(0.2)
    health = httpx.get(f"{server.base_url}/health", timeout=5) if answers[-1] == 503 else None
    assert server.process.wait(30) == 1
    assert gone(family), descendants(server.process.pid)
    assert 503 in answers and all(answer in (200, 503) for answer in answers), answers
    assert answers[answers.index(503):] == [503] * (len(answers) - answers.index(503)), answers
    assert health is not None and "code -1" not in health.text and "exited" in health.text, health
    server.stop()


def test_an_engine_core_that_dies_while_the_api_servers_start_is_reported_by_each():
    """The launcher tells its API servers when an engine core ends (SIGUSR1): one
    still starting had no handler yet, and the signal's default action killed it
    at once, with nothing in the log, while the launcher said they answered 503.
    The signal waits now until each API server handles it."""
    server = ServerProcess("--api-server-count", "2", "--dead-engine-grace", "1", wait_ready=False)
    try:
        deadline = time.monotonic() + 60
        while len(api_server_pids(server)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        [engine] = [pid for pid, command in descendants(server.process.pid).items()
                    if "heron.engine.core_proc" in command]
        os.kill(engine, signal.SIGKILL)  # the API servers are still importing
        assert server.process.wait(90) == 1
        log = server.read_log()
        # each says why, once, and stops at once: it never served, so it answers no 503s for the grace
        assert log.count("heron.engine.async_llm: an engine core exited") == 2, log[-4000:]
        assert "the engine core is dead: answering 503" not in log
    finally:
        server.stop()


# put on the path of every process of the server (sitecustomize): the API server of index $HERON_TEST_HELD_API_SERVER
# holds its tokenizer's load until the file $HERON_TEST_RELEASE exists; each API server that has loaded its
# tokenizer says so with a file named after the release file and its index
HOLD_ONE_API_SERVER = """
import os
if "HERON_TEST_HELD_API_SERVER" in os.environ:
    from heron.entrypoints.openai import shared_gateway
    create_state = shared_gateway.SharedGatewayState.__init__
    def created(self, path, server_index):
        create_state(self, path, server_index)
        import time
        import heron.engine.async_llm as async_llm
        release = os.environ["HERON_TEST_RELEASE"]
        load = async_llm.load_tokenizer
        def held(model_config):
            while server_index == int(os.environ["HERON_TEST_HELD_API_SERVER"]) and not os.path.exists(release):
                time.sleep(0.05)
            tokenizer = load(model_config)
            open(f"{release}.loaded{server_index}", "w").close()
            return tokenizer
        async_llm.load_tokenizer = held
    shared_gateway.SharedGatewayState.__init__ = created
"""


def answers_on_fresh_connections(server: ServerProcess, path: str, count: int = 20) -> list[tuple[int, object]]:
    """(status, the answering API server's index or the error code) of ``count`` GETs, each on a new connection."""
    answers: list[tuple[int, object]] = []
    for _ in range(count):
        response = httpx.get(f"{server.base_url}{path}", timeout=10)
        body = response.json()
        answers.append((response.status_code, body.get("api_server", body.get("error", {}).get("code"))))
    return answers


@pytest.mark.parametrize("held", [0, 1])
def test_no_api_server_answers_loading_once_another_said_ready(tmp_path, held):
    """Each API server listened from its start: one still loading answered 503
    "loading" to its share of new connections while another's /health said 200
    (a load balancer that probed once sent traffic to a 503; a test's stream got
    none). The others listen now only once they and the first are ready: while
    the first loads, every answer says loading; once it is ready, none does."""
    (tmp_path / "sitecustomize.py").write_text(HOLD_ONE_API_SERVER)
    release = tmp_path / "release"
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    server = ServerProcess("--api-server-count", "2", wait_ready=False,
                           env={"PYTHONPATH": path, "HERON_TEST_HELD_API_SERVER": str(held),
                                "HERON_TEST_RELEASE": str(release)})
    try:
        loaded = tmp_path / f"release.loaded{1 - held}"
        wait_for(loaded.exists, timeout=120, what="the API server not held to load its tokenizer")
        wait_for(lambda: server.read_log().count("engine core ready") == 2, timeout=120, what="both engine clients")
        time.sleep(0.5)  # ready: and listening, where it did from the start
        if held == 0:  # the first loads: no answer may say ready
            assert answers_on_fresh_connections(server, "/health") == [(503, None)] * 20
            assert answers_on_fresh_connections(server, "/v1/models") == [(503, "model_loading")] * 20
            release.touch()
            server.wait_ready(60)
        else:  # the first serves alone until the other is ready
            server.wait_ready(60)
            assert answers_on_fresh_connections(server, "/health") == [(200, 0)] * 20
            assert answers_on_fresh_connections(server, "/v1/models") == [(200, None)] * 20
            release.touch()
        wait_for(lambda: {index for _, index in answers_on_fresh_connections(server, "/health")} == {0, 1},
                 timeout=60, what="both API servers to answer")
        assert all(status == 200 for status, _ in answers_on_fresh_connections(server, "/v1/models", 40))
    finally:
        server.stop()
    assert server.process.returncode == 0


def test_ctrl_c_lets_every_api_server_finish_the_streams_it_serves():
    """A terminal's Ctrl-C signals the whole process group: each API server
    starts its graceful stop, then the launcher told them to stop again with
    SIGINT, which uvicorn takes as "force exit": streams under way were cut.
    (A stream still running after the grace is cut even so: 60 s, which 64
    tokens end well within on a loaded machine too, where 5 s was tight.)"""
    server = start(1, "--shutdown-timeout", "60")
    received: list[str] = []
    refused: list[str] = []
    first_chunk = threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60,
                              headers={"Authorization": f"Bearer {KEYS[0]}"}) as response:
                if response.status_code != 200:
                    refused.append(f"{response.status_code}: {response.read()[:300]!r}")
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        received.append(line[6:])
                        first_chunk.set()
        finally:
            first_chunk.set()  # a refusal or an error: the assertion below names it

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        assert first_chunk.wait(60) and received and not refused, (refused, server.read_log()[-3000:])
        # the group, as a terminal does: every process gets its SIGINT before the launcher, acting on its own,
        # can signal the others
        for pid in [*descendants(server.process.pid), server.process.pid]:
            os.kill(pid, signal.SIGINT)
        # while they finish their streams, new connections are refused (a load balancer fails over at once):
        # the launcher's own copy of the listening socket queued them, unanswered, until it exited
        time.sleep(1.0)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.base_url}/health", timeout=5)
        reader.join(60)
        assert received and received[-1] == "[DONE]", (received[-3:], server.read_log()[-3000:])
        assert sum(1 for chunk in received if chunk != "[DONE]") >= 48  # the stream ran to its end, not cut
        assert server.process.wait(30) == 0
    finally:
        server.stop()


def test_the_waiting_bound_holds_for_the_server_not_per_process():
    """One engine slot (--max-num-seqs 1) and room for 2 waiting requests: once a
    long request runs (its first token has arrived), of 9 more sent a moment
    apart on fresh connections (spread over both API servers), 2 wait and the
    other 7 get 429 at once, wherever they land. A bound per process would admit
    up to 4. (A request counts as waiting until its first token: the others are
    sent only after the running one's, or a slow first step on a loaded machine
    counts it among the waiting and refuses one too many.)"""
    server = ServerProcess("--api-server-count", "2", "--max-num-seqs", "1", "--max-waiting-requests", "2")
    try:
        body = {"model": MODEL, "prompt": "Tell me about herons.", "max_tokens": 8, "ignore_eos": True}
        statuses: list[int] = []
        servers_seen: set[int] = set()
        running, sent = threading.Event(), threading.Event()

        def run_first() -> None:
            """Holds the slot until the others are sent (a fixed length either freed it mid-sending on a fast
            machine or outlasted the timeout on a loaded one), then ends it by closing the stream."""
            with httpx.Client() as fresh:
                servers_seen.add(fresh.get(f"{server.base_url}/health", timeout=60).json()["api_server"])
                with fresh.stream("POST", f"{server.base_url}/v1/completions", timeout=120,
                                  json={**body, "max_tokens": 1000, "stream": True}) as response:
                    statuses.append(response.status_code)
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            running.set()
                            if sent.is_set():
                                break
            running.set()  # a refusal: the assertion below names it

        def send() -> None:
            with httpx.Client() as fresh:  # a new connection: SO_REUSEPORT picks the process, kept for both calls
                servers_seen.add(fresh.get(f"{server.base_url}/health", timeout=60).json()["api_server"])
                statuses.append(fresh.post(f"{server.base_url}/v1/completions", json=body, timeout=120).status_code)

        threads = [threading.Thread(target=run_first)]
        threads[0].start()
        assert running.wait(120)
        for _ in range(9):
            threads.append(threading.Thread(target=send))
            threads[-1].start()
            time.sleep(0.2)  # each arrives after the ones before were admitted or refused
        deadline = time.monotonic() + 30  # the refusals come at once; the admitted wait for the slot
        while statuses.count(429) < 7 and time.monotonic() < deadline:
            time.sleep(0.1)
        sent.set()
        for thread in threads:
            thread.join(180)
        assert sorted(statuses) == [200] * 3 + [429] * 7, statuses
        assert servers_seen == {0, 1}
    finally:
        server.stop()
