"""The router's POST /reset_prefix_cache sums up its replicas' answers (a live
fleet: tests/e2e/test_router.py)."""

from __future__ import annotations

import asyncio

import aiohttp

from heron.router.prefix_reset import reset_every_replica
from tests.e2e.server_process import free_port


def test_an_unreachable_replica_is_named_and_no_replica_is_503():
    async def scenario() -> tuple[tuple[int, dict], tuple[int, dict]]:
        async with aiohttp.ClientSession() as session:
            unreachable = f"http://127.0.0.1:{free_port()}"
            return (await reset_every_replica(session, [unreachable], {}),
                    await reset_every_replica(session, [], {}))

    (status, body), (none_status, none_body) = asyncio.run(scenario())
    assert status == 502 and body["error"]["code"] == "replica_error"
    [answer] = body["replicas"].values()
    assert answer["status"] is None and answer["answer"].startswith("unreachable: ")
    assert none_status == 503 and none_body["error"]["code"] == "no_replica"
