"""``heron router``'s HTTP front door (aiohttp): the OpenAI endpoints, proxied to
the replica the policy picks, responses (SSE included) passed through chunk by
chunk as they arrive.

A request that fails before its first byte (no connection, a timeout, a 5xx)
is retried on another replica, up to ``max_attempts``; a stream cut by a dying
replica ends with an error event and ``[DONE]``, so a client never hangs.
Every outcome feeds the replica's circuit breaker; 4xx answers are passed
through and never count against a replica.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from heron.gc_freeze import freeze_startup_objects
from heron.router.disaggregation import PrefillStage
from heron.router.prompt_hashes import CHAT_PATH, PromptHasher
from heron.router.replica import Replica, ReplicaSet
from heron.router.response_affinity import RESPONSES_PATH, ResponseAffinity, ResponseIdScanner
from heron.routing.policies import Router

logger = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/completions", CHAT_PATH, RESPONSES_PATH)
FORWARDED_PATHS = ("/v1/models", "/tokenize", "/detokenize", "/version")
# request headers passed to the replica (the client's key reaches the replica's gateway)
_PASSED_HEADERS = ("authorization", "content-type", "accept", "x-request-id")
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding", "keep-alive", "server",
                "date"}


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("heron_router_requests", "Requests sent to a replica", ["replica", "reason"],
                                registry=self.registry)
        self.retries = Counter("heron_router_retries", "Requests retried on another replica before their first byte",
                               registry=self.registry)
        self.failed = Counter("heron_router_failed_requests", "Requests no replica could serve", registry=self.registry)
        self.cut_streams = Counter(
            "heron_router_cut_streams", "Streams cut by a failing replica", registry=self.registry
        )
        self.matched_blocks = Counter(
            "heron_router_matched_blocks", "Prompt blocks found cached on the chosen replica", registry=self.registry
        )
        self.prompt_blocks = Counter("heron_router_prompt_blocks", "Prompt blocks routed", registry=self.registry)
        self.decision_seconds = Histogram("heron_router_decision_seconds", "Hashing and choosing a replica",
                                          buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2),
                                          registry=self.registry)
        self.in_flight = Gauge("heron_router_in_flight", "Requests under way per replica", ["replica"],
                               registry=self.registry)
        self.usable = Gauge("heron_router_replica_usable", "1 while a replica's circuit is not open", ["replica"],
                            registry=self.registry)


class RouterServer:
    def __init__(self, replicas: ReplicaSet, router: Router, hasher: PromptHasher | None, max_attempts: int = 3,
                 request_timeout: float = 600.0, prefill_replicas: ReplicaSet | None = None) -> None:
        """``prefill_replicas``: prefill/decode disaggregation, ``replicas`` decode
        (``router/disaggregation.py``)."""
        self.replicas = replicas
        self.router = router
        self.hasher = hasher
        self.max_attempts = max_attempts
        self.timeout = aiohttp.ClientTimeout(total=request_timeout, sock_connect=2.0)
        self.metrics = RouterMetrics()
        self.responses = ResponseAffinity()
        self.session: aiohttp.ClientSession | None = None
        self.prefill = (PrefillStage(prefill_replicas, router, self.metrics.registry, request_timeout)
                        if prefill_replicas is not None else None)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        for path in GENERATION_PATHS:
            app.router.add_post(path, self.generate)
        for path in FORWARDED_PATHS:
            app.router.add_route("*", path, self.forward)
        app.router.add_route("*", RESPONSES_PATH + "/{response_id}", self.forward_response)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/router/replicas", self.describe)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _: web.Application) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        await self.replicas.start(self.session)
        if self.prefill is not None:
            await self.prefill.replicas.start(self.session)
        freeze_startup_objects("router")  # the tokenizer and transformers' objects: no full-collection pauses

    async def _stop(self, _: web.Application) -> None:
        await self.replicas.stop()
        if self.prefill is not None:
            await self.prefill.replicas.stop()
        if self.session is not None:
            await self.session.close()

    # ---- routes ------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        started = time.perf_counter()
        body = _json_object(raw)
        hashes = self.hasher.block_hashes(request.path, body, self.replicas.block_size) if self.hasher and body else []
        session = (body.get("user") if body else None) or request.headers.get("X-Session-Id")
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        if self.prefill is not None and body is not None and "kv_transfer_params" not in body:
            assert self.session is not None
            headers = {k: v for k, v in request.headers.items() if k.lower() in _PASSED_HEADERS}
            kv_transfer_params = await self.prefill.run(self.session, request.path, body, headers, hashes)
            if kv_transfer_params is not None:
                raw = json.dumps({**body, "kv_transfer_params": kv_transfer_params}).encode()
        previous = body.get("previous_response_id") if body and request.path == RESPONSES_PATH else None
        pinned = self.responses.replica_of(previous if isinstance(previous, str) else None)
        return await self._proxy(request, raw, hashes, session if isinstance(session, str) else None, pinned)

    async def forward(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, await request.read(), [], None)

    async def forward_response(self, request: web.Request) -> web.StreamResponse:
        """GET or DELETE of a stored response: to the replica that holds it."""
        pinned = self.responses.replica_of(request.match_info["response_id"])
        return await self._proxy(request, await request.read(), [], None, pinned)

    async def health(self, _: web.Request) -> web.Response:
        usable = self.replicas.usable()
        status = 200 if usable else 503
        return web.json_response({"status": "ok" if usable else "no replica available",
                                  "replicas": self._replica_states()}, status=status)

    async def describe(self, _: web.Request) -> web.Response:
        described: dict[str, Any] = {"policy": self.router.policy, "replicas": self._replica_states()}
        if self.prefill is not None:
            described["prefill_replicas"] = self._replica_states(self.prefill.replicas)
        return web.json_response(described)

    async def prometheus(self, _: web.Request) -> web.Response:
        for replica in self.replicas.replicas:
            self.metrics.in_flight.labels(replica.url).set(replica.load.in_flight)
            self.metrics.usable.labels(replica.url).set(1 if replica.breaker.usable else 0)
        return web.Response(body=generate_latest(self.metrics.registry), content_type="text/plain")

    def _replica_states(self, replicas: ReplicaSet | None = None) -> list[dict[str, Any]]:
        return [{"url": r.url, "state": r.breaker.state.value, "in_flight": r.load.in_flight,
                 "load": r.load.score(), "cached_blocks": len(r.index.blocks), "requests": r.num_requests,
                 "kv_events": r.subscription is not None} for r in (replicas or self.replicas).replicas]

    # ---- proxying ----------------------------------------------------------------

    async def _proxy(self, request: web.Request, raw: bytes, hashes: list[bytes],
                     session: str | None, pinned: str | None = None) -> web.StreamResponse:
        """``pinned``: the replica holding the stored response the request names
        (tried first while usable; elsewhere it answers that it has no such response)."""
        tried: list[Replica] = []
        headers = {k: v for k, v in request.headers.items() if k.lower() in _PASSED_HEADERS}
        for attempt in range(self.max_attempts):
            candidates = self.replicas.usable(exclude=tried)
            if not candidates:
                break
            candidates = [r for r in candidates if r.url == pinned] or candidates
            decision = self.router.choose(candidates, hashes, session)
            replica = decision.replica
            assert isinstance(replica, Replica)
            tried.append(replica)
            if not replica.breaker.allows():
                continue
            if attempt:
                self.metrics.retries.inc()
            self.metrics.requests.labels(replica.url, decision.reason).inc()
            self.metrics.prompt_blocks.inc(len(hashes))
            self.metrics.matched_blocks.inc(decision.matched_blocks)
            replica.index.expect(hashes)
            response = await self._send(request, replica, raw, headers, decision.uncached_blocks)
            if response is not None:
                return response
        self.metrics.failed.inc()
        return _error(503, "no replica could serve the request", "service_unavailable")

    async def _send(self, request: web.Request, replica: Replica, raw: bytes, headers: dict[str, str],
                    uncached_blocks: int) -> web.StreamResponse | None:
        """The replica's answer passed through, or None when it failed before
        its first byte (the caller retries elsewhere). The replica's load
        carries the request (and its prefill work) until it ends."""
        assert self.session is not None
        replica.load.dispatch(uncached_blocks)
        replica.num_requests += 1
        try:
            async with self.session.request(request.method, replica.url + request.path_qs, data=raw or None,
                                            headers=headers, timeout=self.timeout) as upstream:
                if upstream.status >= 500:
                    self.replicas.record(replica, upstream.status)
                    await upstream.read()
                    return None
                self.replicas.record(replica, upstream.status)
                return await self._relay(request, replica, upstream)
        except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
            logger.warning("replica %s failed before answering: %s", replica.url, exc)
            self.replicas.record(replica, None)
            return None
        finally:
            replica.load.release(uncached_blocks)

    async def _relay(self, request: web.Request, replica: Replica,
                     upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        response = web.StreamResponse(status=upstream.status)
        for key, value in upstream.headers.items():
            if key.lower() not in _HOP_HEADERS:
                response.headers[key] = value
        await response.prepare(request)
        event_stream = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
        scanner = ResponseIdScanner() if request.path == RESPONSES_PATH and upstream.status == 200 else None
        try:
            async for chunk in upstream.content.iter_any():
                if scanner is not None and scanner.found is None:
                    scanner.feed(chunk)
                    if scanner.found is not None:
                        self.responses.remember(scanner.found, replica.url)
                await response.write(chunk)
        except (TimeoutError, aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            logger.warning("replica %s cut a response: %s", replica.url, exc)
            self.metrics.cut_streams.inc()
            self.replicas.record(replica, None)
            if event_stream:
                error = {"error": {"message": "the replica serving this stream failed", "type": "server_error",
                                   "param": None, "code": "replica_failed"}}
                await response.write(f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()
        return response


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _error(status: int, message: str, code: str) -> web.Response:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return web.json_response(body, status=status)
