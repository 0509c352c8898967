"""``heron router``'s front door: the OpenAI endpoints, each request proxied to
the replica the policy picks, its answer (SSE included) passed through as it
arrives, over the raw HTTP/1.1 front (``http_front.py``) and kept-alive replica
connections (``upstream.py``).

A request that fails before its first byte (no connection, a 5xx) is retried
on another replica, up to ``max_attempts``, and so is a stream cut before its
first byte (its head, sent at once, already went out: the next replica's
events follow it); a stream cut later by a dying replica ends with an error
event and ``[DONE]`` (after the cut event is terminated, so that the error is
an event of its own), so a client never hangs; a
client that leaves takes its replica request with it (the connection to the
replica is closed, which aborts the request there). Every outcome feeds the
replica's circuit breaker; 4xx answers are passed through and never count
against a replica. ``request_timeout`` (``--request-timeout``; None: no limit)
bounds a request from its arrival to its answer's end, prefill stage included:
past it the client gets 504 (before the answer's head) or a stream ending with
an error event (after it), the request is not tried elsewhere, and nothing
counts against the replica (a long generation is no replica failure). Health
probes and the prefill stage of disaggregation use aiohttp's client: they are
not on a request's latency path.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import json
import logging
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from typing import Any

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from heron.gc_freeze import freeze_startup_objects
from heron.http_bounds import DEFAULT_BOUNDS, ConnectionBounds
from heron.router.answer_waits import STALL_S, Outcome, Refusal, read_kept, until_or_stalled
from heron.router.disaggregation import CLIENT_KV_TRANSFER, PrefillStage, block_sizes_match, prefills_first
from heron.router.first_event import RESPONSES_HEAD_EVENT_TYPES, FirstEventGate
from heron.router.http_front import FrontConnection, HttpRequest, serve
from heron.router.prefix_reset import RESET_PATH, reset_every_replica
from heron.router.prompt_hashes import CHAT_PATH, PromptHasher
from heron.router.replica import Replica, ReplicaSet, TakenOut, unless_taken_out
from heron.router.replica_errors import error_code, error_of, json_object, refused_at_the_door
from heron.router.response_affinity import RESPONSES_PATH, ResponseAffinity, ResponseIdScanner, stored_response_id
from heron.router.response_writer import ResponseWriter, error_body, is_event_stream
from heron.router.router_metrics import RouterMetrics
from heron.router.upstream import UpstreamConnection, UpstreamFailed, UpstreamPool
from heron.routing.health import is_replica_failure, is_request_failure
from heron.routing.policies import Router

logger = logging.getLogger(__name__)

# bodies up to this size are hashed on the event loop (a fraction of a millisecond); larger on a thread
INLINE_HASH_BYTES = 16384
GENERATION_PATHS = ("/v1/completions", CHAT_PATH, RESPONSES_PATH)
MODELS_PATH = "/v1/models"  # and /v1/models/{id}, forwarded too
FORWARDED_PATHS = (MODELS_PATH, "/tokenize", "/detokenize", "/version")
# request headers passed to the replica (the client's key reaches the replica's gateway)
_PASSED_HEADERS = ("authorization", "content-type", "accept", "x-request-id",
                   # CORS: the replica's --allowed-origins answers a browser's requests and preflights
                   "origin", "access-control-request-method", "access-control-request-headers")
# the replica's framing and connection headers: the router frames its own answer
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive"}


@functools.cache
def chat_page() -> bytes:
    """``heron serve``'s chat page, served by the router too (read once)."""
    return (resources.files("heron.entrypoints.openai") / "static" / "chat.html").read_bytes()


class RouterServer:
    def __init__(self, replicas: ReplicaSet, router: Router, hasher: PromptHasher | None, max_attempts: int = 3,
                 request_timeout: float | None = None, prefill_replicas: ReplicaSet | None = None,
                 allowed_origins: tuple[str, ...] = ()) -> None:
        """``prefill_replicas``: prefill/decode disaggregation, ``replicas`` decode
        (``router/disaggregation.py``). ``request_timeout``: seconds a request may
        take from its arrival to its answer's end (None: no limit). ``allowed_origins``:
        the browser pages ('*': any) that may read the router's own answers (its
        errors; a replica's answers carry the replica's CORS headers)."""
        self.replicas = replicas
        self.allowed_origins = allowed_origins
        self.router = router
        self.hasher = hasher
        self.max_attempts = max_attempts
        self.request_timeout = request_timeout
        self.metrics = RouterMetrics()
        self._gauged_replicas: set[str] = set()  # the replicas /metrics has gauges for
        self.responses = ResponseAffinity()
        self.upstream = UpstreamPool()
        self.session: aiohttp.ClientSession | None = None
        self.prefill = (PrefillStage(prefill_replicas, router.with_own_state(), self.metrics.registry)
                        if prefill_replicas is not None else None)
        # large prompts are hashed here, one at a time, off the event loop
        self._hash_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="heron-router-hash")
        self._requests_under_way = 0
        self._all_answered = asyncio.Event()
        self._all_answered.set()

    async def listen(self, host: str, port: int, connections: set[FrontConnection] | None = None,
                     bounds: ConnectionBounds = DEFAULT_BOUNDS) -> asyncio.Server:
        """The front, listening: every request to ``counted_handle``, every answer it
        writes itself (a refused head or body) with this router's CORS headers."""
        return await serve(self.counted_handle, host, port, connections, bounds, self._cors_headers)

    async def run(self, host: str, port: int, shutdown_timeout: float = 5.0,
                  bounds: ConnectionBounds = DEFAULT_BOUNDS) -> None:
        """Serves until SIGINT or SIGTERM; then stops listening (an idle kept-alive
        connection is closed, a request sent on a busy one refused with 503), gives
        the requests under way up to ``shutdown_timeout`` seconds to finish, and
        ends the rest with a 503 or an error event."""
        await self.start()
        connections: set[FrontConnection] = set()
        try:
            server = await self.listen(host, port, connections, bounds)
        except OSError as exc:  # the port taken, an address not of this machine, a host that does not resolve
            await self.stop()
            raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping.set)
        try:
            await stopping.wait()
            server.close()  # new connections are refused from here
            for connection in list(connections):  # and requests on kept-alive ones
                connection.drain()
            if self._requests_under_way:
                logger.info("stopping: waiting up to %.0f s for %d request(s) under way", shutdown_timeout,
                            self._requests_under_way)
            try:
                async with asyncio.timeout(shutdown_timeout):  # never wait_for: 3.11's can swallow a cancel
                    await self._all_answered.wait()
            except TimeoutError:
                logger.warning("stopping: %d request(s) still under way after %.0f s end with 503 / an error event",
                               self._requests_under_way, shutdown_timeout)
                for connection in list(connections):
                    connection.cut()
                await asyncio.sleep(0)  # the cancelled handlers let go of their upstream connections
        finally:
            server.close()
            await self.stop()

    async def counted_handle(self, request: HttpRequest, writer: ResponseWriter) -> None:
        """``handle``, counting the requests under way for a graceful stop."""
        self._requests_under_way += 1
        self._all_answered.clear()
        try:
            await self.handle(request, writer)
        finally:
            self._requests_under_way -= 1
            if not self._requests_under_way:
                self._all_answered.set()

    def _cors_headers(self, origin: str | None) -> list[tuple[str, str]]:
        if not origin or not self.allowed_origins:
            return []
        if "*" in self.allowed_origins:
            return [("access-control-allow-origin", "*")]
        if origin in self.allowed_origins:
            return [("access-control-allow-origin", origin), ("vary", "origin")]
        return []

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        await self.replicas.start(self.session)
        if self.prefill is not None:
            await self.prefill.replicas.start(self.session)
        freeze_startup_objects("router")  # the tokenizer and transformers' objects: no full-collection pauses

    async def stop(self) -> None:
        await self.replicas.stop()
        if self.prefill is not None:
            await self.prefill.replicas.stop()
        self.upstream.close()
        self._hash_executor.shutdown(wait=False, cancel_futures=True)
        if self.session is not None:
            await self.session.close()

    # ---- routes ------------------------------------------------------------------

    async def handle(self, request: HttpRequest, writer: ResponseWriter) -> None:
        writer.own_headers = self._cors_headers(request.headers.get("origin"))
        path = request.path
        if path in GENERATION_PATHS:
            if request.method == "OPTIONS":  # a browser's CORS preflight: the replica's --allowed-origins answers
                await self._proxy(request, writer, request.body, [], None, deadline=self._deadline())
                return
            if request.method != "POST":
                writer.send_json(405, error_body(405, f"{path} takes POST", "method_not_allowed"))
                return
            await self.generate(request, writer)
        elif path in FORWARDED_PATHS or path.startswith(MODELS_PATH + "/"):
            await self._proxy(request, writer, request.body, [], None, deadline=self._deadline())
        elif (response_id := stored_response_id(path)) is not None:
            # GET or DELETE of a stored response, or its input items: to the replica that holds it
            pinned = self.responses.replica_of(response_id)
            await self._proxy(request, writer, request.body, [], None, pinned, self._deadline(),
                              seek=response_id if pinned is None else None)
        elif path == "/" and request.method in ("GET", "HEAD"):
            # the chat page: its requests (v1/models, v1/chat/completions) are relative, so they come here too
            writer.send(200, chat_page(), "text/html; charset=utf-8")
        elif path == "/health" and request.method in ("GET", "HEAD"):
            # a replica never heard from counts only once it answers: a breaker starts closed, and /health said
            # ok for the first probes to a replica where nothing listens
            usable = [replica for replica in self.replicas.usable() if replica.answered]
            writer.send_json(200 if usable else 503, {"status": "ok" if usable else "no replica available",
                                                      **self._describe()})
        elif path == "/metrics" and request.method in ("GET", "HEAD"):
            writer.send(200, self._prometheus(), CONTENT_TYPE_LATEST)
        elif path == "/router/replicas" and request.method in ("GET", "HEAD"):
            writer.send_json(200, self._describe())
        elif path == RESET_PATH and request.method == "POST" and self.session is not None:
            replicas = self.replicas.replicas + (self.prefill.replicas.replicas if self.prefill is not None else [])
            writer.send_json(*await reset_every_replica(self.session, [r.url for r in replicas], request.headers))
        else:
            writer.send_json(404, error_body(404, f"no route for {request.method} {path}", "not_found"))

    def _deadline(self) -> float | None:
        """When a request arriving now must have its answer (the loop's time; None: never)."""
        if not self.request_timeout:
            return None
        return asyncio.get_running_loop().time() + self.request_timeout

    async def generate(self, request: HttpRequest, writer: ResponseWriter) -> None:
        deadline = self._deadline()
        raw = request.body
        started = time.perf_counter()
        body = json_object(raw)
        writer.responses_events = request.path == RESPONSES_PATH  # a stream cut there ends in its own form
        if self.prefill is not None and body is not None and body.get("kv_transfer_params") is not None:
            writer.send_json(400, error_body(400, CLIENT_KV_TRANSFER, "invalid_request_error", "kv_transfer_params"))
            return
        hashes = await self._block_hashes(request.path, body, len(raw)) if self.hasher and body else []
        session = (body.get("user") if body else None) or request.headers.get("x-session-id")
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        prefilled, prefilled_block_size = None, None
        pulling = [replica for replica in self.replicas.usable() if replica.takes_kv_transfers]
        if self.prefill is not None and body is not None and prefills_first(request.path, body) and pulling:
            assert self.session is not None
            kv_transfer_params = await self.prefill.run(self.session, request.path, body,
                                                        dict(_passed_headers(request)), hashes, pulling, deadline)
            if kv_transfer_params is not None:
                prefilled = json.dumps({**body, "kv_transfer_params": kv_transfer_params}).encode()
                size = kv_transfer_params.get("remote_block_size")
                prefilled_block_size = size if isinstance(size, int) else None
        previous = body.get("previous_response_id") if body and request.path == RESPONSES_PATH else None
        named = previous if isinstance(previous, str) else None
        pinned = self.responses.replica_of(named)
        await self._proxy(request, writer, raw, hashes, session if isinstance(session, str) else None, pinned,
                          deadline, prefilled, prefilled_block_size, seek=named if not pinned else None)

    async def _block_hashes(self, path: str, body: dict[str, Any], body_bytes: int) -> list[Any]:
        """The prompt's block hashes: on the loop for a small body (fast), on the
        hashing thread for a large one, so other clients' streams keep flowing."""
        assert self.hasher is not None
        if body_bytes <= INLINE_HASH_BYTES:
            return self.hasher.block_hashes(path, body, self.replicas.block_size)
        return await asyncio.get_running_loop().run_in_executor(
            self._hash_executor, self.hasher.block_hashes, path, body, self.replicas.block_size)

    def _prometheus(self) -> bytes:
        """The router's metrics, with each replica's gauges (the prefill replicas' too: a dead prefill
        server showed only in heron_router_prefills_total)."""
        replicas = self.replicas.replicas + (self.prefill.replicas.replicas if self.prefill is not None else [])
        present = {replica.url for replica in replicas}
        for gone in self._gauged_replicas - present:  # discovery dropped it: its gauges said 1 for ever
            self.metrics.in_flight.remove(gone)
            self.metrics.usable.remove(gone)
        self._gauged_replicas = present
        for replica in replicas:
            self.metrics.in_flight.labels(replica.url).set(replica.load.in_flight)
            self.metrics.usable.labels(replica.url).set(1 if replica.breaker.usable else 0)
        return generate_latest(self.metrics.registry)

    def _describe(self) -> dict[str, Any]:
        described: dict[str, Any] = {"policy": self.router.policy, "replicas": self._replica_states()}
        if self.prefill is not None:
            described["prefill_replicas"] = self._replica_states(self.prefill.replicas)
        return described

    def _replica_states(self, replicas: ReplicaSet | None = None) -> list[dict[str, Any]]:
        return [{"url": r.url, "state": r.breaker.state.value, "in_flight": r.load.in_flight,
                 "load": r.load.score(), "cached_blocks": r.cached_blocks, "requests": r.num_requests,
                 "block_size": r.block_size,
                 "kv_events": r.subscription is not None} for r in (replicas or self.replicas).replicas]

    # ---- proxying ----------------------------------------------------------------

    async def _proxy(self, request: HttpRequest, writer: ResponseWriter, raw: bytes, hashes: list[bytes],
                     session: str | None, pinned: str | None = None, deadline: float | None = None,
                     prefilled: bytes | None = None, prefilled_block_size: int | None = None,
                     seek: str | None = None) -> None:
        """``pinned``: the replica holding the stored response the request names
        (tried first while usable; elsewhere it answers that it has no such response).
        ``seek``: the id of the stored response the request names where no replica
        is known to hold it (the router restarted, or forgot it for newer ones): a
        replica answering that it has none is asked no more, and the next is, until
        one has it, which is then remembered.
        ``deadline``: the loop's time by which the answer must have ended.
        ``prefilled``: the body with the prefill stage's ``kv_transfer_params``,
        for a replica that pulls KV in blocks of ``prefilled_block_size`` tokens:
        such replicas are chosen first (the prefill replica holds the prompt's
        blocks until one pulls them or the lease expires); one that does not, or
        keeps blocks of another size, gets ``raw`` when no other is usable (it
        could not pull them, and would warn on every request)."""
        tried: list[Replica] = []
        refusals: list[Refusal] = []  # the replicas' own failure answers (a 503 and its Retry-After)
        headers = _passed_headers(request)
        # a replica that failed after the prefilled body reached it may have pulled the KV, which frees the prefill
        # replica's copy: another one given the same handle could pull nothing (under kv_load_failure_policy
        # "fail", a 500 for a failure the client never saw), so later attempts compute the prompt themselves
        prefill_spent = False
        failed = False  # a replica failed it: the next send is a retry (asking another for a stored response is not)
        for _ in range(max(self.max_attempts, len(self.replicas.replicas)) if seek else self.max_attempts):
            if deadline is not None and asyncio.get_running_loop().time() >= deadline:
                self._timed_out(writer)  # spent (in the prefill stage, or on replicas that failed)
                return
            candidates = self.replicas.usable(exclude=tried)
            if not candidates:
                break
            candidates = [r for r in candidates if r.url == pinned] or candidates
            if prefilled is not None and not prefill_spent:  # the prefill replica holds the prompt's KV
                candidates = [r for r in candidates if _pulls(r, prefilled_block_size)] or candidates
            decision = self.router.choose(candidates, hashes, session)
            replica = decision.replica
            assert isinstance(replica, Replica)
            tried.append(replica)
            if not replica.breaker.allows():
                continue
            if failed:
                self.metrics.retries.inc()
            self.metrics.requests.labels(replica.url, decision.reason).inc()
            self.metrics.prompt_blocks.inc(len(hashes))
            self.metrics.matched_blocks.inc(decision.matched_blocks)
            replica.index.expect(hashes)
            pulls = prefilled is not None and not prefill_spent and _pulls(replica, prefilled_block_size)
            payload = prefilled if pulls and prefilled is not None else raw
            attempt_result = await self._send(request, writer, replica, payload, headers, hashes,
                                              decision.uncached_blocks, deadline, refusals, seek)
            if attempt_result is _Attempt.ANSWERED:
                return
            prefill_spent = prefill_spent or (pulls and attempt_result is _Attempt.BEGUN)
            failed = failed or attempt_result is not _Attempt.NOT_STORED_HERE
            replica.index.forget_expected(hashes)  # it failed before answering: nothing will be cached there
        if writer.started:  # a stream's head went out for a replica that failed before the stream's first byte
            self.metrics.failed.inc()
            self.metrics.cut_streams.inc()
            last = refusals[-1] if refusals else None  # a replica's own refusal, as the stream's last event
            writer.fail(502, error_of(last.status, last.body) if last is not None and last.status >= 500
                        else error_body(502, "the replicas serving this stream failed", "replica_failed"))
            return
        if refusals:
            # a replica's own answer (a 503's reason and Retry-After), not a generic one: one that failed rather
            # than one that had no stored response (the response may live on the one that failed)
            refusal = next((r for r in reversed(refusals) if r.status >= 500), refusals[-1])
            if refusal.status >= 500:
                self.metrics.failed.inc()
            _pass_on(writer, refusal.status, refusal.headers, refusal.body)
            return
        self.metrics.failed.inc()
        writer.send_json(503, error_body(503, "no replica could serve the request", "service_unavailable"))

    async def _send(self, request: HttpRequest, writer: ResponseWriter, replica: Replica, raw: bytes,
                    headers: list[tuple[str, str]], hashes: list[bytes], uncached_blocks: int,
                    deadline: float | None, refusals: list[Refusal], seek: str | None = None) -> _Attempt:
        """Passes the replica's answer through (ANSWERED), or says how it failed
        before its first byte (the caller retries elsewhere). Past ``deadline``
        the client is answered 504 and ANSWERED returned: the request is not
        tried again, and the replica is not blamed. The replica's load carries
        the request (and its prefill work) until it ends."""
        replica.load.dispatch(uncached_blocks)
        replica.num_requests += 1
        connection: UpstreamConnection | None = None
        try:
            scope = asyncio.timeout_at(deadline)
            try:
                async with scope:
                    connection = await unless_taken_out(
                        replica, self.upstream.request(replica.url, request.method, request.path_qs, headers, raw))
            except TimeoutError:
                if not scope.expired():
                    raise
                replica.breaker.release_trial()  # no verdict on the replica: a half-open one is tried again
                self._timed_out(writer)
                return _Attempt.ANSWERED
            except asyncio.CancelledError:  # the client left before the answer began: no verdict either
                replica.breaker.release_trial()
                raise
            except (UpstreamFailed, TakenOut) as exc:
                logger.warning("replica %s failed before answering: %s", replica.url, exc)
                self.replicas.record(replica, None)
                return _Attempt.BEGUN if getattr(exc, "delivered", True) else _Attempt.NOT_BEGUN
            status, upstream_headers = connection.head.result()
            request_failure = is_request_failure(upstream_headers)
            self.replicas.record(replica, 200 if request_failure else status)  # the replica serves on
            if 400 <= status < 500 or request_failure:  # refused or failed: nothing of it is cached there
                replica.index.forget_expected(hashes)
            if is_replica_failure(status) and not request_failure:  # nothing sent yet: another may serve it
                outcome, body = await read_kept(connection, deadline)
                if outcome is Outcome.DONE:
                    refusals.append(Refusal(status, upstream_headers, body))
                # only a 503 a model still loading answers is sure to be a refusal at the door: another (the
                # engine died, the server stopping) may end a request that had begun, and pulled the KV
                return _Attempt.NOT_BEGUN if status == 503 and refused_at_the_door(error_code(body)) else _Attempt.BEGUN
            if seek and status in (400, 404) and not request_failure:
                return await self._answer_or_seek_on(writer, connection, status, upstream_headers, deadline,
                                                     refusals)
            if seek and status == 200:
                self.responses.remember(seek, replica.url)  # found: later requests naming it go there at once
            return await self._relay(request, writer, replica, connection, status, upstream_headers, deadline,
                                     refusals)
        finally:
            replica.load.release(uncached_blocks)
            if connection is not None:
                self.upstream.release(replica.url, connection)  # closed unless its answer ended cleanly

    async def _answer_or_seek_on(self, writer: ResponseWriter, connection: UpstreamConnection, status: int,
                                 upstream_headers: list[tuple[str, str]], deadline: float | None,
                                 refusals: list[Refusal]) -> _Attempt:
        """A replica's 400 or 404 to a request naming a stored response: that it
        has no such response (another may: NOT_STORED_HERE, kept as the answer if
        none has), or the request's own answer, passed on."""
        outcome, body = await read_kept(connection, deadline)
        if outcome is Outcome.DEADLINE:
            self._timed_out(writer)
            return _Attempt.ANSWERED
        if outcome is Outcome.DONE and error_code(body) in _NOT_STORED_HERE:
            refusals.append(Refusal(status, upstream_headers, body))
            return _Attempt.NOT_STORED_HERE
        if outcome is Outcome.CUT:
            return _Attempt.BEGUN  # nothing reached the client: another replica may answer
        if writer.started:  # behind a failed replica's stream head: the stream's last event
            writer.fail(status, error_of(status, body))
        else:
            _pass_on(writer, status, upstream_headers, body)
        return _Attempt.ANSWERED

    def _timed_out(self, writer: ResponseWriter) -> None:
        """The deadline passed before the answer began: 504 (as a stream's last
        event where a failed replica's stream head went out)."""
        writer.fail(504, self._timeout_error())

    def _timeout_error(self) -> dict[str, Any]:
        """A request past ``request_timeout``: the body of its 504 or the stream's last event (counted)."""
        self.metrics.timeouts.inc()
        return error_body(504, f"the request took longer than the router's request timeout "
                               f"({self.request_timeout:g} s)", "timeout")

    async def _relay(self, request: HttpRequest, writer: ResponseWriter, replica: Replica,
                     connection: UpstreamConnection, status: int, upstream_headers: list[tuple[str, str]],
                     deadline: float | None, refusals: list[Refusal]) -> _Attempt:
        """Passes the answer on (ANSWERED); BEGUN or NOT_BEGUN when it was an event
        stream the replica cut (or stalled out) before its first byte, or whose
        first event refused it (first_event.py): nothing but its head reached the
        client, so the caller tries another replica, whose stream goes on behind
        that head (a replica killed during a long prefill, the likeliest moment,
        left the client an error where a healthy replica could have answered)."""
        headers = [(name, value) for name, value in upstream_headers if name.lower() not in _HOP_HEADERS]
        if writer.started:  # an earlier replica's stream head is out: this answer must continue it
            if status != 200 or not is_event_stream(headers):
                await self._fail_stream_with(writer, connection, status, deadline)
                return _Attempt.ANSWERED
        else:
            length = next((value for name, value in upstream_headers if name.lower() == "content-length"), None)
            writer.start(status, headers, content_length=int(length) if length and length.isdigit() else None)
        relayed = False  # a body byte has gone to the client
        head_types = RESPONSES_HEAD_EVENT_TYPES if request.path == RESPONSES_PATH else frozenset()
        gate = FirstEventGate(head_types) if writer.event_stream and status == 200 else None
        scanner = ResponseIdScanner() if request.path == RESPONSES_PATH and status == 200 else None
        loop = asyncio.get_running_loop()
        last_byte_at = loop.time()

        def idle_s() -> float:
            """How long the replica has sent nothing (0 while the client holds the relay up)."""
            nonlocal last_byte_at
            if writer.client_paused:
                last_byte_at = loop.time()
            return loop.time() - last_byte_at

        def forward(chunk: bytes) -> None:
            nonlocal last_byte_at, relayed
            last_byte_at = loop.time()
            if gate is not None:
                chunk = gate.feed(chunk)
            relayed = relayed or bool(chunk)
            if scanner is not None and scanner.found is None:
                scanner.feed(chunk)
                if scanner.found is not None:
                    self.responses.remember(scanner.found, replica.url)
            writer.write(chunk)

        assert connection.transport is not None
        writer.on_pause = connection.transport.pause_reading  # a slow client slows the replica, no buffering
        writer.on_resume = connection.transport.resume_reading
        if writer.client_paused:  # an earlier answer filled the client's buffer: wait until it drains
            connection.transport.pause_reading()
        def after_read() -> None:
            """After each read of the replica's answer: what was written goes out,
            and the answer's end with its last bytes, in the same write."""
            if not connection.complete:
                if gate is None or gate.is_open:
                    writer.flush()  # (while the first event is held, nothing was written)
                return
            if gate is not None and gate.refused is None and not gate.is_open:
                forward(gate.release())  # the stream ended before its first event was whole
            if gate is None or gate.refused is None:
                writer.end()

        connection.stream_to(forward, after_read)
        if writer.event_stream:
            # a stream's head goes out now, as the replica sent it, not with the first
            # token: the client reads it while the replica computes (about 0.3 ms of
            # an httpx client's time to first token, measured through the router)
            writer.flush()
        try:
            outcome = await until_or_stalled(replica, connection.done, deadline, idle_s)
        finally:
            # the connection may go back to the pool: it must read again, and pause nobody's relay
            writer.on_pause = writer.on_resume = None
            connection.transport.resume_reading()
        if gate is not None and gate.refused is not None:
            logger.warning("replica %s refused a stream in its first event (%s): trying another", replica.url,
                           gate.refused["error"]["code"])
            self.replicas.record(replica, 503)
            refusals.append(Refusal(503, upstream_headers, json.dumps(gate.refused).encode()))
            return _Attempt.BEGUN if gate.may_have_begun else _Attempt.NOT_BEGUN
        return self._relay_ended(writer, replica, outcome, relayed)

    def _relay_ended(self, writer: ResponseWriter, replica: Replica, outcome: Outcome, relayed: bool) -> _Attempt:
        """How a relayed answer ended: whole (DONE), or past the deadline, stalled
        or cut, where a stream nothing of which reached the client is tried again."""
        if outcome is Outcome.DONE:
            writer.end()
            return _Attempt.ANSWERED
        if outcome is Outcome.DEADLINE:
            # a long answer or a client reading too slowly: not the replica's failure
            logger.warning("an answer from %s ran past the request timeout (%g s)", replica.url,
                           self.request_timeout)
            error = self._timeout_error()
        else:
            if outcome is Outcome.STALLED:
                logger.warning("replica %s was taken out and its answer has stalled for %g s: ending it",
                               replica.url, STALL_S)
            else:
                logger.warning("replica %s cut a response", replica.url)
                self.replicas.record(replica, None)
            if writer.event_stream and not relayed:
                return _Attempt.BEGUN  # nothing of it reached the client: tried elsewhere
            self.metrics.cut_streams.inc()
            error = error_body(502, "the replica serving this stream failed", "replica_failed")
        writer.fail(502, error)  # an error event in a stream; any other answer is aborted, the client sees the cut
        return _Attempt.ANSWERED

    async def _fail_stream_with(self, writer: ResponseWriter, connection: UpstreamConnection, status: int,
                                deadline: float | None) -> None:
        """Ends a stream whose head went out for a failed replica with the error
        another replica answered instead of a stream (a 4xx, say), as its last event."""
        _, body = await read_kept(connection, deadline)
        writer.fail(status, error_of(status if status >= 400 else 502, body))  # a 200 of no stream is no answer


class _Attempt(enum.Enum):
    """How one replica's try at a request went."""

    ANSWERED = "answered"  # the client has its answer (or a 504): not tried again
    NOT_BEGUN = "not begun"  # failed, the request never began there (no connection, a 503 model_loading)
    BEGUN = "begun"  # failed after the replica may have begun it (closed or taken out before answering, a 500)
    NOT_STORED_HERE = "not stored here"  # sought a stored response it does not hold: no failure, another may hold it


# what a replica answers for a stored response it does not hold
_NOT_STORED_HERE = ("response_not_found", "previous_response_not_found")


def _pass_on(writer: ResponseWriter, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
    """A replica's answer read whole, passed to the client as it was."""
    kept = [(name, value) for name, value in headers
            if name.lower() not in _HOP_HEADERS and name.lower() != "content-type"]
    content_type = next((value for name, value in headers if name.lower() == "content-type"), "application/json")
    writer.send(status, body, content_type, kept)


def _pulls(replica: Replica, block_size: int | None) -> bool:
    """Whether ``replica`` can pull a prefill's KV stored in blocks of ``block_size`` tokens."""
    return replica.takes_kv_transfers and block_sizes_match(replica.block_size, block_size)


def _passed_headers(request: HttpRequest) -> list[tuple[str, str]]:
    """The client's headers a replica needs, and X-Forwarded-For with the
    client's address added (a replica started with ``--forwarded-allow-ips``
    naming the router keys its rate limit by it; else every client behind the
    router shared the router's one bucket)."""
    passed = [(name, value) for name, value in request.headers.items() if name in _PASSED_HEADERS]
    if request.client:
        earlier = request.headers.get("x-forwarded-for")
        passed.append(("x-forwarded-for", f"{earlier}, {request.client}" if earlier else request.client))
    return passed
