"""`heron serve --data-parallel-size 2`: two engine-core processes behind one API
server. Follow-ups sharing a prefix go to the engine that cached it; requests
sent together spread over both; answers are the single engine's."""

from __future__ import annotations

import os
import time

import httpx
import pytest
from openai import OpenAI

from tests.e2e.server_process import ServerProcess, complete_together

pytestmark = pytest.mark.slow

SYSTEM = ("You are a patient guide to the birds of estuaries and salt marshes. Answer in one short sentence, "
          "name the bird, and say where it feeds. ") * 3


def engine_requests(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=5).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("heron:engine_requests{"):
            engine = line.split('engine="', 1)[1].split('"', 1)[0]
            counts[engine] = float(line.rsplit(" ", 1)[1])
    return counts


def placement(pid: int) -> tuple[set[int], str]:
    """An engine core's CPUs (its affinity) and its OMP_NUM_THREADS."""
    with open(f"/proc/{pid}/environ", "rb") as environ:
        variables = environ.read().split(b"\0")
    threads = next((item.split(b"=", 1)[1].decode() for item in variables if item.startswith(b"OMP_NUM_THREADS=")), "")
    return os.sched_getaffinity(pid), threads


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except OSError:
                continue
    return found


def test_two_engine_cores_place_by_prefix_and_spread_what_arrives_together():
    events = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"}'
    server = ServerProcess("--data-parallel-size", "2", "--max-num-seqs", "8", "--kv-events-config", events)
    try:
        assert len(children(server.process.pid)) == 2
        if "OMP_NUM_THREADS" not in os.environ and len(os.sched_getaffinity(0)) >= 2:
            # each on CPUs of its own, with as many threads (both took every core, spinning against each other)
            (first, first_threads), (second, second_threads) = map(placement, children(server.process.pid))
            assert not first & second, (first, second)
            assert (first_threads, second_threads) == (str(len(first)), str(len(second)))
        # a router follows both engines' caches (it saw rank 0's alone)
        info = httpx.get(f"{server.base_url}/v1/kv_events", timeout=5).json()
        ranks = info["ranks"]
        assert len(ranks) == 2 and ranks[0]["endpoint"] == info["endpoint"]
        assert len({rank["endpoint"] for rank in ranks}) == 2
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        answer = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "What is the capital of Japan?"}],
            max_tokens=8, temperature=0)
        assert "Tokyo" in answer.choices[0].message.content
        before = engine_requests(server)
        hits_before = server.metric("heron:prefix_cache_hits_total")
        for question in ("Which bird stands still?", "Which bird probes the mud?", "Which bird dives?",
                         "Which bird skims the water?"):
            client.chat.completions.create(
                model="SmolLM2-135M-Instruct", max_tokens=2, temperature=0,
                messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
            time.sleep(0.3)  # the engine's KV events reach the API server
        after = engine_requests(server)
        added = sorted(after[engine] - before.get(engine, 0) for engine in after)
        assert added == [0, 4], after  # one engine took every follow-up of the shared prompt
        assert server.metric("heron:prefix_cache_hits_total") - hits_before >= 3 * 3 * 16

        complete_together(server.base_url, 6)
        spread = engine_requests(server)
        assert all(spread[engine] > after[engine] for engine in spread), (after, spread)
        a_reset_refused_by_one_engine_forgets_nothing_on_the_other(server)
    finally:
        server.stop()


def a_reset_refused_by_one_engine_forgets_nothing_on_the_other(server: ServerProcess) -> None:
    """With one engine busy, POST /reset_prefix_cache answered 409, but the idle
    one had reset: its prefixes, and the files of a disk tier the engines share,
    were gone (found by the fleet review). Every engine is now asked first."""
    def cached_tokens() -> int:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "Egrets and herons share the marsh at dawn. " * 6,
                "max_tokens": 2}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    long_stream = {"model": "SmolLM2-135M-Instruct", "prompt": "Tell me everything about the marsh.",
                   "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=long_stream, timeout=60) as response:
        lines = response.iter_lines()  # held: a generator closed with the expression closes the stream
        assert next(line for line in lines if line.startswith("data: {"))
        cached_tokens()  # on the other engine, the idle one (placed by load)
        busy = httpx.post(f"{server.base_url}/reset_prefix_cache", timeout=30)
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "prefix_cache_in_use"
    assert cached_tokens() >= 32  # the idle engine kept its prefix
