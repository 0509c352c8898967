"""`heron serve --data-parallel-size 2 --data-parallel-backend ray` on a real
two-node Ray cluster (a head and a second node process on this machine): one
engine-core actor per node, answers right, both used, a killed actor makes
the server say it is dead; `heron router --ray-address` finds the server and
drops it when it stops, and the cluster's resources come back."""

from __future__ import annotations

import os
import re
import signal

import httpx
import pytest
from openai import OpenAI

from tests.e2e.ray_cluster import RayCluster
from tests.e2e.router_process import RouterProcess
from tests.e2e.server_process import ServerProcess, complete_together, wait_for

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


def engine_requests(server: ServerProcess) -> list[float]:
    return [server.metric("heron:engine_requests", engine=str(rank)) for rank in (0, 1)]


@pytest.fixture(scope="module")
def ray_cluster():
    cluster = RayCluster(cpus_per_node=1)
    yield cluster
    cluster.stop()


def test_engine_cores_as_ray_actors_on_two_nodes_behind_one_server_and_a_router(ray_cluster):
    env = {"RAY_ADDRESS": ray_cluster.address, "RAY_USAGE_STATS_ENABLED": "0"}
    server = ServerProcess("--data-parallel-size", "2", "--data-parallel-backend", "ray", "--max-num-seqs", "8",
                           env=env)
    router = None
    try:
        placed = re.search(r"2 engine core\(s\) on Ray nodes (\w+), (\w+)", server.read_log())
        assert placed and placed.group(1) != placed.group(2), server.read_log()[-3000:]  # one per node (SPREAD)

        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is the capital of Japan?"}],
            max_tokens=8, temperature=0)
        assert "Tokyo" in answer.choices[0].message.content
        before = engine_requests(server)
        complete_together(server.base_url, 6)
        after = engine_requests(server)
        assert all(now > then for now, then in zip(after, before, strict=True)), (before, after)

        os.environ["RAY_ADDRESS"] = ray_cluster.address  # the router joins the cluster too
        router = RouterProcess([], "--ray-address", ray_cluster.address)
        assert list(router.replicas()) == [server.base_url], router.replicas()
        routed = httpx.post(f"{router.base_url}/v1/completions", timeout=60,
                            json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
                                  "temperature": 0})
        assert routed.status_code == 200 and "Paris" in routed.json()["choices"][0]["text"]

        # the actor holding its registration dies (an out-of-memory kill): it was gone for good, and the healthy
        # server unlisted for every router
        registration = re.compile(r"\(ReplicaRegistration pid=(\d+)[^)]*\)\S* holds the registration")

        def registration_pids() -> set[str]:
            return set(registration.findall(server.read_log()))

        wait_for(registration_pids, timeout=30, what="the registration's log line")
        os.kill(int(registration_pids().pop()), signal.SIGKILL)
        wait_for(lambda: len(registration_pids()) == 2, timeout=60, what="the registration to be restarted")
        wait_for(lambda: list(router.replicas()) == [server.base_url], timeout=60,
                 what="the router to list the server again")

        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(30) in (0, 130)  # 130: Ctrl-C's conventional code
        wait_for(lambda: not router.replicas(), timeout=30, what="the router to drop the stopped server")
        wait_for(lambda: ray_cluster.cpus_in_use() == 0, timeout=30, what="the engine actors' CPUs to come back")
    finally:
        os.environ.pop("RAY_ADDRESS", None)
        if router is not None:
            router.stop()
        server.stop()


@pytest.mark.parametrize("api_servers", [1, 2])
def test_a_killed_engine_actor_makes_the_server_dead(ray_cluster, api_servers):
    """With several API servers (none of which owns an actor to watch), /health
    said ok and requests hung until the launcher stopped them: it now tells them."""
    env = {"RAY_ADDRESS": ray_cluster.address, "RAY_USAGE_STATS_ENABLED": "0"}
    server = ServerProcess("--data-parallel-size", "2", "--data-parallel-backend", "ray",
                           "--api-server-count", str(api_servers), env=env)
    try:
        actor_pids = [int(pid) for pid in re.findall(r"\(EngineCoreActor pid=(\d+)\)", server.read_log())]
        assert actor_pids, server.read_log()[-3000:]
        os.kill(actor_pids[0], signal.SIGKILL)

        def dead() -> bool:
            response = httpx.get(f"{server.base_url}/health", timeout=5)
            return response.status_code == 503 and response.json()["status"] == "dead"

        wait_for(dead, timeout=10, what="the server to report the engine core dead")
        if api_servers == 1:  # (several hear it from the launcher first, which says only that one ended)
            reason = httpx.get(f"{server.base_url}/health", timeout=5).json()["reason"]
            # Ray's own word, not "exited (code 1)" whatever happened
            assert "Ray actor died" in reason and "code 1" not in reason, reason
        for _ in range(2 * api_servers):  # whichever API server the connection lands on
            failed = httpx.post(f"{server.base_url}/v1/completions", timeout=10,
                                json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
            assert failed.status_code == 503 and failed.json()["error"]["code"] == "engine_dead"
    finally:
        server.stop()
