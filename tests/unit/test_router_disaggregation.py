"""Prefill/decode disaggregation in the router (``router/disaggregation.py``),
against fake prefill and decode replicas (aiohttp servers on loopback) that
record the bodies they receive: which requests go through the prefill stage,
what the prefill copy asks for, and the prefill replicas' breakers."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from heron.router.disaggregation import PrefillStage
from heron.router.replica import ReplicaSet
from heron.router.server import RouterServer
from heron.routing.health import BreakerState
from heron.routing.policies import Router

_PARAMS = {"remote_request_id": "r1"}


class RecordingReplica:
    """Answers every generation request 200, as a prefill replica would (with
    ``kv_transfer_params``), and keeps the (path, body) of each."""

    def __init__(self, health: dict[str, Any] | None = None) -> None:
        self.health = health or {"status": "ok"}
        self.hold: asyncio.Event | None = None  # set: every answer waits for it (a hung host)
        self.params: dict[str, Any] | None = _PARAMS  # None: answers with nothing to transfer (a short prompt)
        self.status = 200  # what it answers generation requests with
        self.error_code: str | None = None  # the code of its error answer (status not 200)
        self.seen: list[tuple[str, dict[str, Any]]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self.answer_health)  # read at each probe: a test may change it
        for path, answer in (("/v1/kv_events", {"enabled": False}), ("/metrics", {})):
            app.router.add_get(path, _answer(answer))
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
            app.router.add_post(path, self.generate)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    async def answer_health(self, _: web.Request) -> web.Response:
        return web.json_response(self.health)

    async def generate(self, request: web.Request) -> web.Response:
        self.seen.append((request.path, await request.json()))
        if self.hold is not None:
            await self.hold.wait()
        if self.status != 200:
            return web.json_response({"error": {"message": "no", "type": "server_error", "param": None,
                                                "code": self.error_code}}, status=self.status)
        return web.json_response({"id": "resp_1", **({"kv_transfer_params": self.params} if self.params else {})})


def _answer(value: dict[str, Any]) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(_: web.Request) -> web.Response:
        return web.json_response(value)
    return handler


def run_disaggregated(test: Callable[..., Awaitable[None]], *decodes: RecordingReplica,
                      with_router: bool = False, prefill_health: dict[str, Any] | None = None) -> None:
    """``test(client, prefill, decode, ...)`` against a router over one prefill
    replica (its /health: ``prefill_health``) and ``decodes`` (default: one that
    answers /health as vLLM would); ``with_router``: ``test(client, router,
    prefill, decode, ...)``."""
    async def main(prefill: RecordingReplica) -> None:
        decode_replicas = list(decodes) or [RecordingReplica()]
        for replica in (prefill, *decode_replicas):
            await replica.start()
        server = RouterServer(ReplicaSet([d.url for d in decode_replicas], {}, probe_interval=30.0),
                              Router("round_robin"), None,
                              prefill_replicas=ReplicaSet([prefill.url], {}, probe_interval=30.0))
        await server.start()
        front = await server.listen("127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{front.sockets[0].getsockname()[1]}") as client:
                await asyncio.wait_for(test(client, *([server] if with_router else []), prefill, *decode_replicas),
                                       30)
        finally:
            front.close()
            await server.stop()
            for replica in (prefill, *decode_replicas):
                await replica.stop()

    asyncio.run(main(RecordingReplica(prefill_health)))


def test_a_decode_replica_that_pulls_no_kv_gets_the_request_as_it_came():
    """A plain heron serve among the decode replicas got the router's
    kv_transfer_params and answered 400, naming a field the client never sent;
    with no replica that pulls KV, the prefill stage only held a lease. A
    prefilled request goes to one that pulls while one is usable."""
    body = {"prompt": "a heron", "max_tokens": 4}

    async def mixed(client: httpx.AsyncClient, prefill: RecordingReplica, plain: RecordingReplica,
                    pulling: RecordingReplica) -> None:
        for _ in range(4):
            assert (await client.post("/v1/completions", json=body)).status_code == 200
        assert len(prefill.seen) == 4
        assert plain.seen == []
        assert pulling.seen == [("/v1/completions", {**body, "kv_transfer_params": _PARAMS})] * 4
        await pulling.stop()
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        assert plain.seen == [("/v1/completions", body)]

    run_disaggregated(mixed, RecordingReplica({"status": "ok", "kv_role": None}),
                      RecordingReplica({"status": "ok", "kv_role": "kv_consumer"}))

    async def plain_only(client: httpx.AsyncClient, prefill: RecordingReplica, plain: RecordingReplica) -> None:
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        assert prefill.seen == [] and plain.seen == [("/v1/completions", body)]

    run_disaggregated(plain_only, RecordingReplica({"status": "ok", "kv_role": None}))


def test_requests_of_several_samples_or_prompts_go_to_a_decode_replica_unchanged():
    """A decode server pulls one prompt's KV for one sequence: n or best_of > 1,
    or several prompts, skip the prefill stage (its copy used to drop n, and the
    decode server rejected the request with 400)."""
    bodies = [
        {"prompt": "a heron", "max_tokens": 4, "n": 2},
        {"prompt": "a heron", "max_tokens": 4, "n": 3, "best_of": 3},
        {"prompt": "a heron", "max_tokens": 4, "best_of": 2},
        {"prompt": ["a heron", "a stork"], "max_tokens": 4},
        {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 4},
    ]

    async def test(client: httpx.AsyncClient, prefill: RecordingReplica, decode: RecordingReplica) -> None:
        for body in bodies:
            assert (await client.post("/v1/completions", json=body)).status_code == 200
        chat = {"messages": [{"role": "user", "content": "hi"}], "n": 2}
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
        assert prefill.seen == []
        assert decode.seen == [("/v1/completions", body) for body in bodies] + [("/v1/chat/completions", chat)]
        # one prompt (as text, a one-element list, or token ids), one sample: prefilled first
        for prompt in ("a heron", ["a heron"], [1, 2, 3], [[1, 2, 3]]):
            body = {"prompt": prompt, "max_tokens": 4, "n": 1, "best_of": 1}
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            assert prefill.seen[-1] == ("/v1/completions", {"prompt": prompt, "max_tokens": 1,
                                                            "kv_transfer_params": {"do_remote_decode": True}})
            assert decode.seen[-1] == ("/v1/completions", {**body, "kv_transfer_params": _PARAMS})

    run_disaggregated(test)


def test_only_completion_and_chat_requests_are_prefilled_first():
    """A Responses request has no one-token form (max_output_tokens ignored the
    injected max_tokens: the prefill server generated the whole answer)."""
    async def test(client: httpx.AsyncClient, prefill: RecordingReplica, decode: RecordingReplica) -> None:
        body = {"input": "hi", "max_output_tokens": 500}
        assert (await client.post("/v1/responses", json=body)).status_code == 200
        assert prefill.seen == [] and decode.seen == [("/v1/responses", body)]
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
        assert [path for path, _ in prefill.seen] == ["/v1/chat/completions"]

    run_disaggregated(test)


def test_the_prefill_copy_asks_for_one_token_whatever_bounds_the_clients_answer():
    """min_tokens > max_tokens = 1 made every prefill fail (disaggregation off
    for any request with min_tokens > 1); the client's request reaches the
    decode replica whole."""
    async def test(client: httpx.AsyncClient, prefill: RecordingReplica, decode: RecordingReplica) -> None:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 50, "min_tokens": 5,
                "stream": True, "stream_options": {"include_usage": True}, "n": 1}
        async with client.stream("POST", "/v1/chat/completions", json=chat) as response:
            assert response.status_code == 200
            await response.aread()
        assert prefill.seen == [("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}})]
        assert decode.seen == [("/v1/chat/completions", {**chat, "kv_transfer_params": _PARAMS})]

    run_disaggregated(test)


def test_a_prefill_replica_resting_from_failures_gets_one_trial_at_a_time():
    """Its breaker's rest over, a prefill replica gets one trial; the trial's
    failure opens it again for longer (it used to get every prompt, its failures
    ignored as late, until the next probe round)."""
    async def main() -> None:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        replicas = ReplicaSet([f"http://127.0.0.1:{listener.getsockname()[1]}"], {})
        replica = replicas.replicas[0]
        for _ in range(3):
            replicas.record(replica, None)
        replica.breaker._opened_at -= 10  # noqa: SLF001 (its rest is over; no probe ran yet)
        stage = PrefillStage(replicas, Router("round_robin"), CollectorRegistry())
        try:
            async with aiohttp.ClientSession() as session:
                for _ in range(3):
                    assert await stage.run(session, "/v1/completions", {"prompt": "x"}, {}, [], []) is None
        finally:
            listener.close()
        assert replica.breaker.state is BreakerState.OPEN and not replica.breaker.usable
        assert stage.outcomes.labels("failed")._value.get() == 1  # noqa: SLF001 (the counter's value)
        assert stage.outcomes.labels("no_replica")._value.get() == 2  # noqa: SLF001

    asyncio.run(main())



def test_a_prompt_waiting_on_a_prefill_replica_taken_out_is_computed_by_the_decode_replica():
    """A prefill replica that stopped answering (a hung host, a partition) held
    the requests in their prefill stage for its whole timeout (600 s), though
    its breaker had opened and the decode replica could compute the prompts."""
    async def test(client: httpx.AsyncClient, router: RouterServer, prefill: RecordingReplica,
                   decode: RecordingReplica) -> None:
        prefill.hold = asyncio.Event()
        body = {"prompt": "a heron", "max_tokens": 4}
        answer = asyncio.create_task(client.post("/v1/completions", json=body, timeout=20))
        while not prefill.seen:
            await asyncio.sleep(0.01)
        assert router.prefill is not None
        replica = router.prefill.replicas.replicas[0]
        for _ in range(3):  # its probes fail
            router.prefill.replicas.record(replica, None)
        response = await asyncio.wait_for(answer, 5)
        assert response.status_code == 200
        assert decode.seen == [("/v1/completions", body)]  # as it came: computed there
        assert not replica.out_waiters and replica.load.in_flight == 0
        prefill.hold.set()

    run_disaggregated(test, with_router=True)


def test_a_prompt_with_nothing_to_transfer_is_no_failed_prefill():
    """A prompt of no whole block comes back 200 with no kv_transfer_params: it
    was counted heron_router_prefills_total{outcome="failed"}."""
    async def main() -> None:
        prefill = RecordingReplica()
        prefill.params = None
        await prefill.start()
        stage = PrefillStage(ReplicaSet([prefill.url], {}), Router("round_robin"), CollectorRegistry())
        try:
            async with aiohttp.ClientSession() as session:
                assert await stage.run(session, "/v1/completions", {"prompt": "hi"}, {}, [], []) is None
        finally:
            await prefill.stop()
        assert stage.outcomes.labels("nothing_to_transfer")._value.get() == 1  # noqa: SLF001
        assert stage.outcomes.labels("failed")._value.get() == 0  # noqa: SLF001

    asyncio.run(main())


def test_a_client_naming_its_own_kv_transfer_params_is_refused():
    """The router writes the handle in disaggregated mode: a client's own went to
    a decode replica as it came, which connected to whatever address it named.
    A null one is none (the request is prefilled as usual)."""
    async def test(client: httpx.AsyncClient, prefill: RecordingReplica, decode: RecordingReplica) -> None:
        own = {"remote_engine_address": "10.0.0.9:5555", "remote_request_id": "x", "remote_num_blocks": 1}
        for path, body in (("/v1/completions", {"prompt": "a heron", "max_tokens": 4}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "a heron", "n": 2})):
            answer = await client.post(path, json={**body, "kv_transfer_params": own})
            assert answer.status_code == 400
            error = answer.json()["error"]
            assert error["param"] == "kv_transfer_params" and "--prefill" in error["message"]
        assert prefill.seen == [] and decode.seen == []
        body = {"prompt": "a heron", "max_tokens": 4, "kv_transfer_params": None}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        assert [path for path, _ in prefill.seen] == ["/v1/completions"]
        assert decode.seen == [("/v1/completions", {**body, "kv_transfer_params": _PARAMS})]

    run_disaggregated(test)


def test_a_prefill_replica_no_decode_replica_can_pull_from_is_skipped():
    """Blocks of another size cannot be pulled: such a prefill held a lease for
    nothing, and the decode server warned on every request. /health names the
    block size; the router skips those prefill replicas (once said in its log),
    counts the outcome, and a decode replica of the same size is still used."""
    body = {"prompt": "a heron", "max_tokens": 4}

    async def mismatched(client: httpx.AsyncClient, router: RouterServer, prefill: RecordingReplica,
                         decode: RecordingReplica) -> None:
        prefill.health = {"status": "ok", "kv_role": "kv_producer", "block_size": 32}
        await router.prefill.replicas._round(router.session)
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        assert prefill.seen == [] and decode.seen == [("/v1/completions", body)]
        metrics = (await client.get("/metrics")).text
        assert 'heron_router_prefills_total{outcome="block_size_mismatch"} 1.0' in metrics
        described = (await client.get("/router/replicas")).json()
        assert [r["block_size"] for r in described["prefill_replicas"]] == [32]
        assert [r["block_size"] for r in described["replicas"]] == [16]
        decode_32 = RecordingReplica({"status": "ok", "kv_role": "kv_consumer", "block_size": 32})
        await decode_32.start()
        try:  # one decode replica of its size is enough to prefill
            router.replicas.set_discovered([decode_32.url])
            await router.replicas._round(router.session)
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            assert [path for path, _ in prefill.seen] == ["/v1/completions"]
        finally:
            await decode_32.stop()

    run_disaggregated(mismatched, RecordingReplica({"status": "ok", "kv_role": "kv_consumer", "block_size": 16}),
                      with_router=True)


def test_a_prefilled_request_goes_to_a_decode_replica_that_can_pull_it():
    """Of decode replicas of 16 and 32 tokens a block, round robin sent every
    other prefilled request to the 16 one, which cannot pull a 32-block
    prefill's KV: it recomputed the prompt while the prefill replica held the
    blocks until their lease expired. The 32 one gets them all; the 16 one gets
    the request as it came only when the 32 one is out."""
    body = {"prompt": "a heron", "max_tokens": 4}

    async def mixed(client: httpx.AsyncClient, router: RouterServer, prefill: RecordingReplica,
                    small: RecordingReplica, large: RecordingReplica) -> None:
        prefill.params = {**_PARAMS, "remote_block_size": 32}
        for _ in range(4):
            assert (await client.post("/v1/completions", json=body)).status_code == 200
        assert small.seen == []
        assert large.seen == [("/v1/completions", {**body, "kv_transfer_params": prefill.params})] * 4
        await large.stop()
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        assert small.seen == [("/v1/completions", body)]  # a handle it could not pull would be a 400

    prefill_health = {"status": "ok", "kv_role": "kv_producer", "block_size": 32}
    run_disaggregated(mixed, RecordingReplica({"status": "ok", "kv_role": "kv_consumer", "block_size": 16}),
                      RecordingReplica({"status": "ok", "kv_role": "kv_consumer", "block_size": 32}),
                      with_router=True, prefill_health=prefill_health)


@pytest.mark.parametrize(("failure", "second_gets_handle"), [
    ("500", False), ("503 model_loading", True), ("503 engine_dead", False), ("503 server_stopping", False),
    ("stopped", True)])
def test_a_retry_passes_the_prefill_handle_on_only_where_no_replica_may_have_used_it(failure, second_gets_handle):
    """A decode replica that pulled the prompt's KV (the prefill replica frees
    its copy then) and failed before answering: the retry went to the next one
    with the same handle, whose pull found nothing (under kv_load_failure_policy
    "fail", a 500 for a failure the client never saw). After a failure where
    the request never began (no connection, a 503 of a model still loading) the
    handle is still good; other 503s (an engine that died, a server stopping)
    may end a request that had begun."""
    body = {"prompt": "a heron", "max_tokens": 4}
    consumer = {"status": "ok", "kv_role": "kv_consumer", "block_size": 16}

    async def retried(client: httpx.AsyncClient, prefill: RecordingReplica, first: RecordingReplica,
                      second: RecordingReplica) -> None:
        if failure == "stopped":
            await first.stop()  # its breaker still closed: the router finds it gone by connecting
        else:
            status, _, first.error_code = failure.partition(" ")
            first.status = int(status)
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        prefilled = {**body, "kv_transfer_params": _PARAMS}
        assert first.seen == ([] if failure == "stopped" else [("/v1/completions", prefilled)])
        assert second.seen == [("/v1/completions", prefilled if second_gets_handle else body)]
        if failure == "stopped":
            await first.start()  # for the harness to stop

    run_disaggregated(retried, RecordingReplica(consumer), RecordingReplica(consumer),
                      prefill_health={"status": "ok", "kv_role": "kv_producer", "block_size": 16})


def test_prefill_replicas_show_in_the_routers_health_and_metrics():
    """Only the decode replicas did: a dead prefill server showed only in
    heron_router_prefills_total (found by the router review)."""
    async def shown(client: httpx.AsyncClient, prefill: RecordingReplica, decode: RecordingReplica) -> None:
        health = (await client.get("/health")).json()
        assert [r["url"] for r in health["prefill_replicas"]] == [prefill.url]
        assert [r["url"] for r in health["replicas"]] == [decode.url]
        metrics = (await client.get("/metrics")).text
        assert f'heron_router_replica_usable{{replica="{prefill.url}"}} 1.0' in metrics
        assert f'heron_router_in_flight{{replica="{prefill.url}"}} 0.0' in metrics

    run_disaggregated(shown)
