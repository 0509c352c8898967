"""``heron serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

The HTTP server starts at once and answers /health and every /v1 route with 503
until the engine core process reports ready; errors always use OpenAI's error shape.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from heron import __version__
from heron.config import EngineConfig
from heron.engine.async_llm import AsyncLLM
from heron.engine.core_client import EngineCoreProcess
from heron.engine.input_processor import InvalidRequestError
from heron.entrypoints.openai.errors import APIError, bad_request, model_not_found
from heron.entrypoints.openai.gateway import (
    APIKeyChecker,
    BodySizeLimitMiddleware,
    GatewayMiddleware,
    TokenBucketLimiter,
    collect_api_keys,
)
from heron.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from heron.entrypoints.openai.serving_chat import chat_prompt, create_chat_completion
from heron.entrypoints.openai.serving_common import ServingContext, engine_unavailable, invalid_input
from heron.entrypoints.openai.serving_completion import create_completion
from heron.gc_freeze import freeze_startup_objects

logger = logging.getLogger(__name__)


@dataclass
class GatewaySettings:
    api_keys: list[str]
    rate_limit: float | None = None
    rate_limit_burst: float | None = None
    max_waiting_requests: int | None = None
    request_timeout_s: float | None = None
    max_request_body_bytes: int = 10 << 20


def build_app(engine: AsyncLLM, settings: GatewaySettings) -> FastAPI:
    model = engine.config.model
    ctx = ServingContext(
        engine=engine,
        served_model_name=model.served_model_name,
        max_model_len=model.max_model_len,
        max_waiting_requests=settings.max_waiting_requests,
        request_timeout_s=settings.request_timeout_s,
    )
    keys = APIKeyChecker(settings.api_keys)
    limiter = (
        TokenBucketLimiter(settings.rate_limit, settings.rate_limit_burst or max(1.0, 2 * settings.rate_limit))
        if settings.rate_limit
        else None
    )
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
        engine._ensure_started()
        freeze_startup_objects("API server")
        yield
        engine.shutdown()

    app = FastAPI(title="heron", version=__version__, lifespan=lifespan)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    # outermost: keys, rate limit and readiness before the body is read
    app.add_middleware(GatewayMiddleware, keys=keys, limiter=limiter, unavailable=lambda: engine_unavailable(engine))

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return invalid_input(exc).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(location) or None
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else str(first.get("msg", "invalid request body"))
        return bad_request(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), error_type).response()

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error")
        return APIError(500, f"Internal server error: {type(exc).__name__}", "server_error").response()

    @app.get("/health")
    async def health() -> Response:
        if engine.is_dead:
            return JSONResponse({"status": "dead", "reason": engine.dead_reason}, status_code=503)
        if not engine.is_ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{
                "id": ctx.served_model_name,
                "object": "model",
                "created": created,
                "owned_by": "heron",
                "root": model.model,
                "max_model_len": ctx.max_model_len,
            }],
        }

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Any:
        return await create_completion(ctx, request, raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Any:
        return await create_chat_completion(ctx, request, raw_request)

    @app.post("/tokenize")
    async def tokenize(body: dict[str, Any]) -> dict[str, Any]:
        if "messages" in body:
            chat_request = TokenizeChatRequest.model_validate(body)
            _check_model(ctx, chat_request.model)
            token_ids = chat_prompt(ctx, chat_request).token_ids
        else:
            completion_request = TokenizeCompletionRequest.model_validate(body)
            _check_model(ctx, completion_request.model)
            token_ids = engine.tokenizer.encode(
                completion_request.prompt, add_special_tokens=completion_request.add_special_tokens
            )
        return {"tokens": token_ids, "count": len(token_ids), "max_model_len": ctx.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> dict[str, Any]:
        _check_model(ctx, request.model)
        bad = [t for t in request.tokens if not 0 <= t < model.vocab_size]
        if bad:
            raise bad_request(f"token ids outside the vocabulary (size {model.vocab_size}): {bad[:5]}", "tokens")
        return {"prompt": engine.tokenizer.decode(request.tokens)}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _check_model(ctx: ServingContext, name: str | None) -> None:
    if name is not None and name != ctx.served_model_name:
        raise model_not_found(name)


def gateway_settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    return GatewaySettings(
        api_keys=collect_api_keys(args.api_key, args.api_key_file),
        rate_limit=args.rate_limit,
        rate_limit_burst=args.rate_limit_burst,
        max_waiting_requests=args.max_waiting_requests,
        request_timeout_s=args.request_timeout,
        max_request_body_bytes=args.max_request_body_bytes,
    )


def run_server(args: argparse.Namespace, started: EngineCoreProcess | None = None) -> int:
    """Serve. ``started``: the engine core, already started on the same flags
    (``heron serve`` starts it before importing the web stack or torch: it
    resolves the flags itself and loads the model while this process resolves
    them too and loads the tokenizer)."""
    from heron.entrypoints.engine_args import engine_kwargs_from_args

    engine_kwargs = engine_kwargs_from_args(args, usage="serve")
    started = started or EngineCoreProcess.start(engine_kwargs, args.log_level)
    try:
        config = EngineConfig.create(**engine_kwargs)
    except BaseException:
        started.kill()
        raise
    settings = gateway_settings_from_args(args)
    logger.info("starting heron %s (loading %s)", __version__, config.model.served_model_name)
    return asyncio.run(_serve(args, config, settings, started))


async def _serve(
    args: argparse.Namespace, config: EngineConfig, settings: GatewaySettings, started: EngineCoreProcess | None = None
) -> int:
    import uvicorn

    # created inside the event loop: its ZMQ sockets belong to this loop
    engine = AsyncLLM(config, log_level=args.log_level, log_stats_interval_s=args.log_stats_interval, started=started)
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(engine, settings),
            host=args.host,
            port=args.port,
            log_level="warning",
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            timeout_graceful_shutdown=5,
        )
    )
    scheme = "https" if args.ssl_certfile else "http"
    base_url = f"{scheme}://{args.host}:{args.port}"
    name = config.model.served_model_name
    auth = ' -H "Authorization: Bearer $HERON_API_KEY"' if settings.api_keys else ""

    async def announce_when_ready() -> None:
        try:
            await engine.wait_until_ready()
        except Exception as exc:  # start-up failed: stop the server
            logger.error("%s", exc)
            server.should_exit = True
            return
        logger.info(
            "heron is ready at %s (model %r). Try:\n  curl %s/v1/chat/completions%s "
            "-H 'Content-Type: application/json' -d '{\"model\": \"%s\", \"messages\": "
            "[{\"role\": \"user\", \"content\": \"What is the capital of Japan?\"}]}'",
            base_url, name, base_url, auth, name,
        )

    announcer = asyncio.create_task(announce_when_ready())
    try:
        await server.serve()
    finally:
        announcer.cancel()
        engine.shutdown()
    return 1 if engine.is_dead else 0
