"""The router's Ray discovery runs in a child process (router/ray_discovery.py):
the router joined the cluster itself, and Ray ended it (exit 0) when the
cluster went away, though it had healthy replicas of its own. Here the child is
a script standing in for it: the router takes the lists it writes, keeps the
last one when the child ends, and starts another."""

from __future__ import annotations

import asyncio
import sys

from heron.router import ray_discovery
from heron.router.ray_discovery import RayDiscovery

CHILD = """
import json, pathlib, sys, time
runs = pathlib.Path(sys.argv[1])
run = int(runs.read_text()) + 1 if runs.exists() else 1
written = runs.with_suffix(".new")
written.write_text(str(run))
written.replace(runs)  # whole: the test read it between write_text's truncation and its write
if run == 1:
    print(json.dumps({"replicas": ["http://10.0.0.1:8000"]}), flush=True)
    time.sleep(0.3)
    print("not json", flush=True)
    print(json.dumps({"replicas": ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]}), flush=True)
    time.sleep(0.3)
    sys.exit(3)  # the cluster went away
print(json.dumps({"error": "no Ray cluster answers"}), flush=True)
sys.exit(1)
"""


def test_the_last_list_is_kept_when_the_child_ends_and_another_child_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(ray_discovery, "RESTART_DELAY_S", 0.2)
    runs = tmp_path / "runs"

    async def scenario() -> None:
        discover = RayDiscovery("10.0.0.9:6379", 1.0, [sys.executable, "-c", CHILD, str(runs)])
        try:
            # the first call waits for the first list (or, on a slow machine, a later one read with it)
            assert (await discover())[:1] == ["http://10.0.0.1:8000"]
            while len(await discover()) < 2:  # its next list (past a line it should not have written)
                await asyncio.sleep(0.05)
            assert await discover() == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
            while not runs.exists() or int(runs.read_text()) < 3:  # ended, started again (and again)
                await asyncio.sleep(0.05)
            assert await discover() == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]  # kept
        finally:
            await discover.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_child_that_never_lists_lets_the_first_round_go_on(tmp_path, monkeypatch):
    monkeypatch.setattr(ray_discovery, "FIRST_LIST_TIMEOUT_S", 0.5)

    async def scenario() -> None:
        discover = RayDiscovery("10.0.0.9:6379", 1.0, [sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            assert await discover() == []
            child = discover._child  # noqa: SLF001
        finally:
            await discover.close()
        assert child is not None and child.returncode is not None  # killed

    asyncio.run(asyncio.wait_for(scenario(), 30))
