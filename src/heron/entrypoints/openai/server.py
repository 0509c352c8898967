"""``heron serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

The HTTP server starts at once and answers /health and every /v1 route with 503
until the engine core process reports ready; errors always use OpenAI's error
shape. The routes live in ``routes.py``; this module assembles the app and runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from heron import __version__
from heron.config import EngineConfig
from heron.engine.args import EngineArgs
from heron.engine.async_llm import AsyncLLM, EngineDeadError, StartedEngineCore
from heron.engine.core_client import OwnedEngineCore
from heron.entrypoints.openai.api_server_pool import ENGINE_GONE_SIGNAL
from heron.entrypoints.openai.cli_args import check_gateway, collect_api_keys, read_chat_template
from heron.entrypoints.openai.cors import CorsSettings, add_cors, cors_settings_from_args
from heron.entrypoints.openai.gateway import APIKeyChecker, GatewayMiddleware, TokenBucketLimiter
from heron.entrypoints.openai.http_limits import RequestSizeLimitMiddleware, bounded_http_protocol, head_limit
from heron.entrypoints.openai.limits import DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_REQUEST_BODY_BYTES
from heron.entrypoints.openai.routes import install_error_handlers, install_openapi, router
from heron.entrypoints.openai.serving_common import ServingContext, engine_unavailable
from heron.entrypoints.openai.shared_gateway import SharedGatewayState
from heron.entrypoints.openai.stop_signals import StopSignals, stop_signals_heard
from heron.entrypoints.openai.streaming import ConnectionAbortMiddleware
from heron.gc_freeze import freeze_startup_objects

logger = logging.getLogger(__name__)


@dataclass
class GatewaySettings:
    api_keys: list[str]
    rate_limit: float | None = None
    rate_limit_burst: float | None = None
    max_waiting_requests: int | None = None
    request_timeout_s: float | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    log_requests: bool = False
    protect_metrics: bool = False
    stream_stall_timeout_s: float | None = 60.0
    trust_request_chat_template: bool = False
    chat_template: str | None = None  # --chat-template, read
    tool_call_parser: str | None = None
    cors: CorsSettings | None = None  # --allowed-origins and company; None: no cross-origin page reads an answer

    def __post_init__(self) -> None:
        check_gateway(self.api_keys, self.protect_metrics)


@dataclass(frozen=True)
class APIServerRole:
    """One of several API-server processes on one port (``--api-server-count``)."""

    index: int
    count: int
    shared: SharedGatewayState


def build_app(engine: AsyncLLM, settings: GatewaySettings, role: APIServerRole | None = None) -> FastAPI:
    """The app: gateway middleware (keys, rate limit, readiness, body and header sizes),
    OpenAI-shaped errors, and the routes of ``routes.py``. ``role``: which of
    several API-server processes this is (they share the limits' state)."""
    shared = role.shared if role else None
    model = engine.config.model
    keys = APIKeyChecker(settings.api_keys)
    limiter = (
        TokenBucketLimiter(settings.rate_limit, settings.rate_limit_burst or max(1.0, 2 * settings.rate_limit),
                           shared=shared)
        if settings.rate_limit
        else None
    )
    if shared is not None:
        engine.on_waiting_changed = shared.publish_waiting

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        freezing = asyncio.create_task(_freeze_once_the_tokenizer_is_loaded(engine))
        yield
        freezing.cancel()
        engine.shutdown()

    app = FastAPI(title="heron", version=__version__, lifespan=lifespan)
    app.state.serving = ServingContext(
        engine=engine,
        served_model_name=model.served_model_name,
        served_model_aliases=model.served_model_aliases,
        max_model_len=model.max_model_len,
        max_waiting_requests=settings.max_waiting_requests,
        request_timeout_s=settings.request_timeout_s,
        log_requests=settings.log_requests,
        stream_stall_timeout_s=settings.stream_stall_timeout_s,
        trust_request_chat_template=settings.trust_request_chat_template,
        chat_template=settings.chat_template,
        tool_call_parser=settings.tool_call_parser,
        shared=shared,
        health_extra={"api_server": role.index, "api_server_count": role.count} if role else {},
    )
    app.state.created = int(time.time())
    app.add_middleware(RequestSizeLimitMiddleware, max_body_bytes=settings.max_request_body_bytes,
                       max_header_bytes=settings.max_header_bytes)
    # outermost: keys, rate limit and readiness before the body is read
    app.add_middleware(GatewayMiddleware, keys=keys, limiter=limiter, unavailable=lambda: engine_unavailable(engine),
                       protect_all=settings.protect_metrics)
    if settings.cors is not None:  # outside the gateway: a preflight carries no key, a refusal needs the headers
        add_cors(app, settings.cors)
    app.add_middleware(ConnectionAbortMiddleware)  # around them all: it finds the connection (streaming.py)
    install_error_handlers(app)
    app.include_router(router)
    install_openapi(app)
    return app


class StartLoadError(ValueError):
    """What a start could not load and the user must fix: the tokenizer (its
    files, or ``--tokenizer``), or the model in the engine core (a checkpoint
    with a tensor missing or misshapen, unreadable files, a setting the model
    refuses). A usage error, told as ``heron generate`` tells it, by ``heron
    serve`` and by each of several API servers, not as a crash."""


async def _freeze_once_the_tokenizer_is_loaded(engine: AsyncLLM) -> None:
    """The start-up objects are frozen once the last of them, the tokenizer's, exist."""
    await engine.wait_for_tokenizer()
    if engine.tokenizer_loaded:
        freeze_startup_objects("API server")


def gateway_settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    return GatewaySettings(
        api_keys=collect_api_keys(args.api_key, args.api_key_file),
        rate_limit=args.rate_limit,
        rate_limit_burst=args.rate_limit_burst,
        max_waiting_requests=args.max_waiting_requests,
        request_timeout_s=args.request_timeout,
        max_request_body_bytes=args.max_request_body_bytes,
        max_header_bytes=args.max_header_bytes,
        log_requests=args.log_requests,
        protect_metrics=args.protect_metrics,
        stream_stall_timeout_s=args.stream_stall_timeout or None,
        trust_request_chat_template=args.trust_request_chat_template,
        chat_template=read_chat_template(args.chat_template),
        tool_call_parser=args.tool_call_parser,
        cors=cors_settings_from_args(args),
    )


def run_server(args: argparse.Namespace, started: list[OwnedEngineCore], listener: socket.socket) -> int:
    """Serve. ``started``: the engine cores (one per data-parallel rank), already
    started on the same flags (``heron serve`` starts them before importing the
    web stack or torch: they resolve the flags themselves and load the model
    while this process resolves them too and loads the tokenizer). ``listener``:
    the socket to answer on, taken before they started (``listen_socket.py``)."""
    try:
        engine_args = EngineArgs.from_cli_args(args, usage="serve")
        # on Ray, routers on the cluster find this server by a name it holds while it runs
        registration = _register_on_ray(args) if engine_args.data_parallel_backend == "ray" else None
        if args.api_server_count == 1:
            config = engine_args.create_engine_config()
            settings = gateway_settings_from_args(args)
    except BaseException:  # a bad flag or a Ctrl-C before the server runs: no engine core outlives it
        listener.close()
        for process in started:
            process.kill()
        raise
    if args.api_server_count > 1:
        from heron.entrypoints.openai.api_server_pool import run_api_servers

        return run_api_servers(args, started, listener)
    logger.info("starting heron %s (loading %s)", __version__, config.model.served_model_name)
    try:
        return asyncio.run(serve_api(args, config, settings, started, listener=listener))
    finally:
        listener.close()
        del registration


async def _exit_when_the_engine_dies(engine: AsyncLLM, server: Any, grace: float) -> None:
    """Once the engine core is dead, answer 503 for ``grace`` s, then stop the
    server (an engine that never served: at once, without the grace, its reason
    logged where start-up waits for it; it said it answered 503 for 5 s)."""
    while not engine.is_dead:
        await asyncio.sleep(0.1)
    if not engine.engine_info:
        return
    logger.error("the engine core is dead: answering 503 for %.1f s, then exiting with code 1 "
                 "(a supervisor restarts heron)", grace)
    await asyncio.sleep(grace)
    server.should_exit = True


def _register_on_ray(args: argparse.Namespace) -> object:
    from heron.engine.ray_engines import register_replica, this_node_ip

    host = args.host if args.host not in ("", "0.0.0.0", "::") else this_node_ip()
    host = f"[{host}]" if ":" in host else host
    url = f"{'https' if args.ssl_certfile else 'http'}://{host}:{args.port}"
    logger.info("registered on the Ray cluster as %s", url)
    if _is_loopback(host.strip("[]")):
        logger.warning("%s is reachable from this machine only: a router on another node cannot use it "
                       "(serve on --host 0.0.0.0 or this node's address for those)", url)
    return register_replica(url)


def _is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is this machine's loopback."""
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def uvicorn_config(app: Any, args: argparse.Namespace, settings: GatewaySettings) -> Any:
    """How uvicorn serves ``app`` for ``heron serve``'s arguments."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        # uvicorn's own lines, its access log among them, with --log-level DEBUG
        log_level="debug" if args.log_level == "DEBUG" else "warning",
        # the request head a connection buffers is bounded (http_limits.py)
        http=bounded_http_protocol(settings.max_header_bytes) or "auto",
        h11_max_incomplete_event_size=head_limit(settings.max_header_bytes),
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        timeout_graceful_shutdown=args.shutdown_timeout,
        timeout_keep_alive=args.keep_alive_timeout,
        # uvicorn trusts X-Forwarded-For from 127.0.0.1 by default: without keys, a local client (an SSH tunnel,
        # a TCP proxy) got a fresh rate-limit bucket a request by naming another address
        proxy_headers=args.forwarded_allow_ips is not None,
        forwarded_allow_ips=args.forwarded_allow_ips,
    )


async def serve_api(
    args: argparse.Namespace, config: EngineConfig, settings: GatewaySettings,
    started: Sequence[StartedEngineCore] | None = None, role: APIServerRole | None = None,
    listener: socket.socket | None = None) -> int:
    """Run one API server on ``listener`` until it is told to stop: SIGTERM or
    SIGINT stop it gracefully from this coroutine's first line (stop_signals.py)."""
    with stop_signals_heard() as stop_signals:
        return await _serve_api(args, config, settings, started, role, listener, stop_signals)


async def _serve_api(
    args: argparse.Namespace, config: EngineConfig, settings: GatewaySettings,
    started: Sequence[StartedEngineCore] | None, role: APIServerRole | None,
    listener: socket.socket | None, stop_signals: StopSignals) -> int:
    from heron.entrypoints.openai.uvicorn_server import Server

    # created inside the event loop (its ZMQ sockets belong to it); each of several API servers counts the
    # tokens of its own requests: its periodic line says whose
    scope = f"API server {role.index + 1} of {role.count} (its requests)" if role is not None else ""
    engine = AsyncLLM(config, log_level=args.log_level, log_stats_interval_s=args.log_stats_interval, started=started,
                      record_engine_stats=role is None or role.index == 0, stats_scope=scope,
                      heartbeat_timeout_s=args.engine_heartbeat_timeout, step_timeout_s=args.engine_step_timeout,
                      # the server answers (503 "loading") while the tokenizer loads, not only once it has
                      load_tokenizer_in_background=True)
    server = Server(uvicorn_config(build_app(engine, settings, role), args, settings))
    stop_signals.stop(server)
    scheme = "https" if args.ssl_certfile else "http"
    base_url = f"{scheme}://{f'[{args.host}]' if ':' in args.host else args.host}:{args.port}"  # IPv6 in brackets
    name = config.model.served_model_name
    auth = ' -H "Authorization: Bearer $HERON_API_KEY"' if settings.api_keys else ""

    async def announce_when_ready() -> None:
        try:
            await engine.wait_until_ready()
        except Exception as exc:  # start-up failed: stop the server
            # a dead engine's reason was logged where it was found; the tokenizer's error is raised below
            if not isinstance(exc, EngineDeadError) and exc is not engine.tokenizer_error:
                logger.error("%s", exc)
            server.should_exit = True
            return
        if role is not None:
            role.shared.publish_ready()
            if role.index > 0:
                return  # the first of several API servers speaks for them
        logger.info(
            "heron is ready at %s (model %r). Try:\n  curl %s/v1/chat/completions%s "
            "-H 'Content-Type: application/json' -d '{\"model\": \"%s\", \"messages\": "
            "[{\"role\": \"user\", \"content\": \"What is the capital of Japan?\"}]}'",
            base_url, name, base_url, auth, name,
        )

    async def end_requests_before_the_stop_deadline() -> None:
        # at --shutdown-timeout uvicorn cancels the handlers still running: a non-streamed request got its
        # plain-text 500, a stream was cut without an error event. heron ends them itself just before (a
        # timeout too short for that cuts them, as it says)
        if args.shutdown_timeout <= _STOP_MARGIN_S:
            return
        while not server.should_exit:
            await asyncio.sleep(0.1)
        await asyncio.sleep(args.shutdown_timeout - _STOP_MARGIN_S)
        ended = engine.fail_in_flight(f"the request did not finish within --shutdown-timeout "
                                      f"({args.shutdown_timeout:g} s)")
        if ended:
            logger.warning("stopping: %d request(s) still running after %g s end with 503 / an error event",
                           ended, args.shutdown_timeout - _STOP_MARGIN_S)

    watchers = [asyncio.create_task(announce_when_ready()),
                asyncio.create_task(_exit_when_the_engine_dies(engine, server, args.dead_engine_grace)),
                asyncio.create_task(end_requests_before_the_stop_deadline())]
    main_thread = threading.current_thread() is threading.main_thread()
    if hears_the_launcher := role is not None and main_thread:  # one of several: told when an engine core ends
        _listen_to_the_launcher(engine, listen=True)
    try:
        if role is None or role.index == 0 or await _may_listen(engine, role, server):
            await server.serve(sockets=[listener] if listener is not None else None)
    finally:
        stop_signals.restore()
        if hears_the_launcher:
            _listen_to_the_launcher(engine, listen=False)
        for watcher in watchers:
            watcher.cancel()
        if main_thread:
            exit_within(STOP_DEADLINE_S, 1 if engine.is_dead else 0)
        engine.shutdown()
    _raise_a_failed_start(engine)
    return 1 if engine.is_dead else 0


def _raise_a_failed_start(engine: AsyncLLM) -> None:
    """The model or the tokenizer could not be loaded: raised as a usage error
    (``heron: error: ...``, exit 2) where it is the user's to fix."""
    if engine.load_error is not None:
        raise StartLoadError(engine.load_error)
    if isinstance(engine.tokenizer_error, (ValueError, OSError)):  # as a bad flag's: "heron: error: cannot load ..."
        raise StartLoadError(str(engine.tokenizer_error)) from engine.tokenizer_error
    if engine.tokenizer_error is not None:
        raise engine.tokenizer_error


async def _may_listen(engine: AsyncLLM, role: APIServerRole, server: Any) -> bool:
    """Wait until a second (or later) API server of several may serve: once it and
    the first are ready. Until it listens, the kernel hands new connections to
    those that do. Listening while it loaded, it answered 503 "loading" to its
    share of them while the first one's /health said 200 (and, ready before the
    first, its own 200s drew traffic to the first one's 503s). False: told to
    stop, or the engine or the tokenizer failed, before that."""
    engine.start()
    while not server.should_exit and not engine.is_dead and engine.tokenizer_error is None:
        if engine.is_ready and role.shared.is_ready(0):
            return True
        await asyncio.sleep(0.05)
    return False


def _listen_to_the_launcher(engine: AsyncLLM, listen: bool) -> None:
    """An API server of several hears the launcher's word (``ENGINE_GONE_SIGNAL``) that an engine
    core has ended: held since its start (a signal mask), delivered once handled; after the
    serving, ignored (a late word is of no use, and its default action kills)."""
    loop = asyncio.get_running_loop()
    if listen:
        loop.add_signal_handler(ENGINE_GONE_SIGNAL, engine.engine_gone,
                                "an engine core exited (the launcher saw it end, and logs its code)")
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {ENGINE_GONE_SIGNAL})
    else:
        loop.remove_signal_handler(ENGINE_GONE_SIGNAL)
        signal.signal(ENGINE_GONE_SIGNAL, signal.SIG_IGN)


# how long the engines' shutdown (and the interpreter's exit after it) may take once the server has stopped
STOP_DEADLINE_S = 30.0


def exit_within(seconds: float, code: int) -> None:
    """End the process with ``code`` if it has not exited ``seconds`` from now. A
    stop that hangs must not hold the exit: a Ray engine core's cleanup after its
    cluster went away waits on the cluster for a minute, and the supervisor saw
    a dead server that answered nothing and did not exit."""
    def force_exit() -> None:
        logger.error("the stop has taken %g s: exiting now (code %d)", seconds, code)
        logging.shutdown()
        os._exit(code)

    timer = threading.Timer(seconds, force_exit)
    timer.daemon = True
    timer.start()


# how long before --shutdown-timeout heron ends the requests still running, so their answers are written
_STOP_MARGIN_S = 1.0

