"""A stored response the router does not know where it lives (the router
restarted, or remembered newer ones in its place) is sought on each replica in
turn: a GET, a DELETE or a follow-up (previous_response_id) went to whichever
replica the policy picked, and one without it answered 404 or 400 though
another held it (found by the router review)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from aiohttp import web

from heron.router.replica import ReplicaSet
from heron.router.server import RouterServer
from heron.routing.policies import Router


class StoringReplica:
    """Holds some stored responses; answers for others as heron does."""

    def __init__(self, held: set[str], cut_stream: bool = False) -> None:
        self.held = held
        self.cut_stream = cut_stream  # a stream's head, then it dies
        self.asked = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        for path, value in (("/health", {"status": "ok"}), ("/v1/kv_events", {"enabled": False}), ("/metrics", {})):
            app.router.add_get(path, _constant(value))
        app.router.add_get("/v1/responses/{id}", self.retrieve)
        app.router.add_post("/v1/responses", self.create)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def retrieve(self, request: web.Request) -> web.Response:
        self.asked += 1
        response_id = request.match_info["id"]
        if response_id in self.held:
            return await _json({"id": response_id, "object": "response"})
        return await _json(_error("response_not_found", "response_id"), 404)

    async def create(self, request: web.Request) -> web.Response:
        self.asked += 1
        body = await request.json()
        if self.cut_stream:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            assert request.transport is not None
            request.transport.abort()
            return response
        if body.get("input") == "":  # checked first, as heron checks the body before the stored response
            return await _json(_error("invalid_value", "input"), 400)
        previous = body.get("previous_response_id")
        if previous is not None and previous not in self.held:
            return await _json(_error("previous_response_not_found", "previous_response_id"), 400)
        return await _json({"id": "resp_next", "object": "response"})


async def _json(value: dict[str, Any], status: int = 200) -> web.Response:
    return web.json_response(value, status=status)


def _constant(value: dict[str, Any]) -> Any:
    async def answer(_: web.Request) -> web.Response:
        return await _json(value)
    return answer


def _error(code: str, param: str) -> dict[str, Any]:
    return {"error": {"message": "not here", "type": "invalid_request_error", "param": param, "code": code}}


def run_router(replicas: list[StoringReplica], test: Any) -> None:
    async def main() -> None:
        for replica in replicas:
            await replica.start()
        server = RouterServer(ReplicaSet([r.url for r in replicas], {}, probe_interval=30.0), Router("round_robin"),
                              None)  # a fresh router: it never saw resp_kept answered
        await server.start()
        front = await server.listen("127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{front.sockets[0].getsockname()[1]}") as client:
                await test(client, server)
        finally:
            front.close()
            await server.stop()
            for replica in replicas:
                assert replica.runner is not None
                await replica.runner.cleanup()

    asyncio.run(main())


def test_a_stored_response_is_sought_on_every_replica():
    replicas = [StoringReplica(set()) for _ in range(3)] + [StoringReplica({"resp_kept"})]

    async def test(client: httpx.AsyncClient, server: RouterServer) -> None:
        found = await client.get("/v1/responses/resp_kept")
        assert (found.status_code, found.json()["id"]) == (200, "resp_kept")
        follow_up = await client.post("/v1/responses", json={"input": "more", "previous_response_id":
                                                             "resp_kept"})
        assert follow_up.status_code == 200, follow_up.text
        missing = await client.get("/v1/responses/resp_gone")  # none has it: a replica's own 404
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "response_not_found"
        asked = sum(r.asked for r in replicas)
        refused = await client.post("/v1/responses", json={"input": "", "previous_response_id": "resp_kept"})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_value"
        assert sum(r.asked for r in replicas) == asked + 1  # another 400 is the answer: not sought further
        # found once, it is remembered: asked again, only the replica holding it is asked
        for _ in range(len(replicas)):  # (round robin would start each seek at another replica)
            asked = sum(r.asked for r in replicas)
            again = await client.get("/v1/responses/resp_kept")
            assert again.status_code == 200 and sum(r.asked for r in replicas) == asked + 1
        assert server.metrics.failed._value.get() == 0  # noqa: SLF001 (no replica failed)
        assert server.metrics.retries._value.get() == 0  # noqa: SLF001 (asking the next replica is no retry)
        assert all(r.breaker.consecutive_failures == 0 for r in server.replicas.replicas)

    run_router(replicas, test)


def test_a_stream_whose_head_is_out_ends_with_the_next_replicas_error():
    """A replica cut a stream after its head; the next one, sought for the
    stored response, answered another 400: the router raised passing it on as
    a whole answer behind the head, and the client saw a broken body."""
    async def test(client: httpx.AsyncClient, _: RouterServer) -> None:
        body = {"input": "", "previous_response_id": "resp_kept", "stream": True}
        async with client.stream("POST", "/v1/responses", json=body) as response:
            lines = [line async for line in response.aiter_lines() if line]
        # a Responses stream's last event, in that API's form (no [DONE])
        assert response.status_code == 200 and lines[0] == "event: error" and len(lines) == 2, lines
        assert json.loads(lines[1].removeprefix("data: "))["code"] == "invalid_value"

    run_router([StoringReplica(set(), cut_stream=True), StoringReplica({"resp_kept"})], test)
