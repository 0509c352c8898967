"""The HTTP routes of ``heron serve`` and the handlers that give every error
OpenAI's shape (the OpenAPI schema says so too). Each route finds the server's
``ServingContext`` on the app (``app.state.serving``, set by ``server.build_app``)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from importlib import resources
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from heron import __version__
from heron.core.hashing import BLOCK_HASH_SCHEME
from heron.engine.input_processor import InvalidRequestError, check_text
from heron.engine.kv_events_publisher import connectable
from heron.entrypoints.openai.errors import APIError, ErrorResponse, bad_request, invalid_body, unavailable
from heron.entrypoints.openai.gateway import key_owner
from heron.entrypoints.openai.off_loop import prepare
from heron.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeRequest,
)
from heron.entrypoints.openai.protocol_responses import ResponsesRequest
from heron.entrypoints.openai.responses_store import UnknownItem, input_items_page
from heron.entrypoints.openai.serving_chat import chat_prompt, create_chat_completion
from heron.entrypoints.openai.serving_common import ServingContext, check_model_name, engine_unavailable, invalid_input
from heron.entrypoints.openai.serving_completion import create_completion
from heron.entrypoints.openai.serving_responses import create_response
from heron.entrypoints.openai.tools.choice import tool_choice_of

logger = logging.getLogger(__name__)

router = APIRouter()
CHAT_PAGE = (resources.files("heron.entrypoints.openai") / "static" / "chat.html").read_text(encoding="utf-8")


def serving_context(request: Request) -> ServingContext:
    return request.app.state.serving


Serving = Annotated[ServingContext, Depends(serving_context)]
# what a body outside its request model gets (``install_error_handlers``), as the schema states it
INVALID_BODY: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "A field missing, of the wrong type or outside its limits"}
}


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)  # HEAD too, as the router answers it
async def chat_page() -> HTMLResponse:
    """The chat page (static/chat.html): one file, no build step, nothing from elsewhere."""
    return HTMLResponse(CHAT_PAGE)


@router.get("/health")
async def health(ctx: Serving) -> Response:
    engine = ctx.engine
    if engine.is_dead:
        return JSONResponse({"status": "dead", "reason": engine.dead_reason}, status_code=503)
    if not engine.is_ready:
        return JSONResponse({"status": "loading"}, status_code=503)
    events = engine.engine_info.get("kv_events")
    # which numbering of KV events this replica publishes: a router resubscribes when it changes (a restart)
    epoch = {"kv_events_epoch": events["epoch"]} if events else {}
    # whether it pulls a prefill engine's KV (a router adds kv_transfer_params only where it does)
    transfer = engine.config.kv_transfer
    role = {"kv_role": transfer.kv_role if transfer is not None else None}
    # a decode server pulls only from a prefill server of the same block size: a router skips the others
    blocks = {"block_size": ctx.engine.engine_info.get("block_size", ctx.engine.config.cache.block_size)}
    return JSONResponse({"status": "ok", **epoch, **role, **blocks, **ctx.health_extra})


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


def model_card(ctx: ServingContext, raw_request: Request, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": raw_request.app.state.created,
        "owned_by": "heron",
        "root": ctx.engine.config.model.model,
        "max_model_len": ctx.max_model_len,
    }


@router.get("/v1/models")
async def models(ctx: Serving, raw_request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(ctx, raw_request, name) for name in ctx.served_model_names]}


@router.get("/v1/models/{model:path}")
async def model(model: str, ctx: Serving, raw_request: Request) -> dict[str, Any]:
    """OpenAI's model retrieval (``client.models.retrieve``): the served model, else 404."""
    check_model_name(ctx, model)
    return model_card(ctx, raw_request, model)


@router.post("/v1/completions", responses=INVALID_BODY)
async def completions(request: CompletionRequest, raw_request: Request, ctx: Serving) -> Any:
    return await _releasing_refused_prefill(ctx, request, create_completion(ctx, request, raw_request))


@router.post("/v1/chat/completions", responses=INVALID_BODY)
async def chat_completions(request: ChatCompletionRequest, raw_request: Request, ctx: Serving) -> Any:
    return await _releasing_refused_prefill(ctx, request, create_chat_completion(ctx, request, raw_request))


async def _releasing_refused_prefill(ctx: ServingContext, request: CompletionRequest | ChatCompletionRequest,
                                     answer: Awaitable[Any]) -> Any:
    """``answer``; a request it refuses (4xx) that carries a prefill engine's
    handle frees that engine's lease at once (``AsyncLLM.release_refused_prefill``)."""
    try:
        return await answer
    except APIError as exc:
        if 400 <= exc.status_code < 500:
            ctx.engine.release_refused_prefill(request.kv_transfer_params)
        raise


def _release_prefill_of_invalid_body(request: Request, body: Any) -> None:
    """A completion or chat body that fails the request schema (``max_tokens: 0``) but names a prefill
    engine's handle frees that engine's lease too: it was refused before its handle was read, and the
    prefill engine held the blocks for the lease's 30 s."""
    route = request.scope.get("route")
    if getattr(route, "endpoint", None) not in (completions, chat_completions) or not isinstance(body, dict):
        return
    serving: ServingContext | None = getattr(request.app.state, "serving", None)
    if serving is not None:
        serving.engine.release_refused_prefill(body.get("kv_transfer_params"))


@router.post("/v1/responses", responses=INVALID_BODY)
async def responses(request: ResponsesRequest, raw_request: Request, ctx: Serving) -> Any:
    return await create_response(ctx, request, raw_request)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, ctx: Serving, raw_request: Request) -> Any:
    stored = ctx.responses.get(response_id, key_owner(raw_request))
    if stored is None:
        raise response_not_found(response_id)
    return stored.response


@router.get("/v1/responses/{response_id}/input_items")
async def get_response_input_items(
    response_id: str,
    ctx: Serving,
    raw_request: Request,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> dict[str, Any]:
    stored = ctx.responses.get(response_id, key_owner(raw_request))
    if stored is None:
        raise response_not_found(response_id)
    try:
        return input_items_page(stored.input_items, limit, order, after)
    except UnknownItem as exc:
        raise bad_request(f"No input item with id {after!r} in response {response_id!r}", "after") from exc


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, ctx: Serving, raw_request: Request) -> Any:
    """OpenAI cancels only responses created with ``background: true``, which
    heron does not run: every stored response has already finished."""
    if ctx.responses.get(response_id, key_owner(raw_request)) is None:
        raise response_not_found(response_id)
    raise bad_request(f"Response {response_id!r} was not created in the background (background is not supported): "
                      "it has finished and cannot be cancelled", "response_id")


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, ctx: Serving, raw_request: Request) -> dict[str, Any]:
    if not ctx.responses.delete(response_id, key_owner(raw_request)):
        raise response_not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def response_not_found(response_id: str) -> APIError:
    return APIError(404, f"No response with id {response_id!r} (not stored, or no longer)", "invalid_request_error",
                    "response_id", "response_not_found")


@router.post("/tokenize", responses=INVALID_BODY)
async def tokenize(body: TokenizeRequest, ctx: Serving, raw_request: Request) -> dict[str, Any]:
    """A prompt (``{"prompt": ...}``) or a conversation (``{"messages": [...]}``),
    checked as the completion or chat request it previews (tools included)."""
    check_model_name(ctx, body.model)
    check_tokenizer_loaded(ctx)

    def token_ids_of() -> list[int]:
        if isinstance(body, TokenizeChatRequest):
            try:
                tool_choice_of(body.tools, None, None)
            except InvalidRequestError as exc:
                raise invalid_input(exc) from exc
            return chat_prompt(ctx, body).token_ids
        check_text(body.prompt, "prompt")  # a lone surrogate has no UTF-8 form: the tokenizer raised TypeError
        return ctx.engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)

    token_ids = await prepare(raw_request, token_ids_of)
    token_strs = ctx.engine.tokenizer.convert_ids_to_tokens(token_ids) if body.return_token_strs else None
    return {"tokens": token_ids, "count": len(token_ids), "max_model_len": ctx.max_model_len,
            "token_strs": token_strs}


@router.post("/detokenize", responses=INVALID_BODY)
async def detokenize(request: DetokenizeRequest, ctx: Serving, raw_request: Request) -> dict[str, Any]:
    check_model_name(ctx, request.model)
    check_tokenizer_loaded(ctx)
    vocab_size = ctx.engine.config.model.vocab_size

    def text_of() -> str:
        bad = [t for t in request.tokens if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"token ids outside the vocabulary (size {vocab_size}): {bad[:5]}", "tokens")
        return ctx.engine.tokenizer.decode(request.tokens)

    # a long list decodes for seconds: on a worker thread, as a long prompt is tokenized, not holding every stream
    return {"prompt": await prepare(raw_request, text_of)}


def check_tokenizer_loaded(ctx: ServingContext) -> None:
    """/tokenize and /detokenize answer before the engine core is ready, once the
    tokenizer has loaded (the server loads it while it answers)."""
    if not ctx.engine.tokenizer_loaded:
        raise unavailable("The tokenizer is still loading; retry shortly.", "model_loading")


@router.get("/v1/kv_events")
async def kv_events(ctx: Serving, raw_request: Request) -> dict[str, Any]:
    """Where this replica publishes its KV-cache events, as a router dials it
    (a wildcard bind is reported with the host the client used)."""
    info = ctx.engine.engine_info.get("kv_events")
    body: dict[str, Any] = {
        "enabled": info is not None,
        "block_size": ctx.engine.engine_info.get("block_size", ctx.engine.config.cache.block_size),
        "hash": BLOCK_HASH_SCHEME,
    }
    if info is not None:
        host = raw_request.url.hostname or "127.0.0.1"
        body.update(_dialled(info, host))
        ranks = ctx.engine.engine_info.get("kv_events_ranks")
        if ranks and len(ranks) > 1:  # data parallelism: every engine's cache, rank 0's first (the fields above)
            body["ranks"] = [_dialled(rank, host) for rank in ranks if rank is not None]
    return body


def _dialled(info: dict[str, Any], host: str) -> dict[str, Any]:
    """One engine's event endpoints as a router dials them."""
    return {"endpoint": connectable(info["endpoint"], host),
            "replay_endpoint": connectable(info["replay_endpoint"], host), "topic": info["topic"],
            "epoch": info.get("epoch")}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(ctx: Serving) -> dict[str, bool]:
    """Forget every cached prefix, the pool's and the offload tiers', in every
    engine core, as vLLM's development endpoint does: for measuring without a
    warm cache. A 409 while requests hold blocks (nothing is forgotten where
    they run; engines already idle have forgotten theirs)."""
    unavailable = engine_unavailable(ctx.engine)
    if unavailable is not None:
        raise unavailable
    if not await ctx.engine.reset_prefix_cache():
        raise APIError(409, "The prefix cache was not reset: requests are running; retry when the server is idle.",
                       "invalid_request_error", None, "prefix_cache_in_use")
    return {"reset": True}


@router.get("/metrics")
async def metrics(ctx: Serving, raw_request: Request) -> Response:
    """Prometheus text; ``?name[]=heron:num_requests_running&name[]=...`` keeps only those samples."""
    ctx.engine.refresh_engine_metrics()
    names = raw_request.query_params.getlist("name[]")
    return Response(ctx.engine.metrics.render(names), media_type="text/plain; version=0.0.4; charset=utf-8")


def install_openapi(app: FastAPI) -> None:
    """``/openapi.json`` without the 422 FastAPI documents for a body that fails
    validation: heron answers those with a 400 in OpenAI's shape (``INVALID_BODY``)."""

    def schema() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in document.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                document.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = schema  # type: ignore[method-assign]


def install_error_handlers(app: FastAPI) -> None:
    """Every error a route raises, and every unexpected one, as OpenAI's error object."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return invalid_input(exc).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        _release_prefill_of_invalid_body(request, exc.body)
        return invalid_body(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = str(exc.detail)
        if isinstance(exc.__cause__, RecursionError):  # FastAPI's body parser ran out of stack
            message = "the body is nested too deeply to parse"
        return APIError(exc.status_code, message, error_type).response()

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error")
        return APIError(500, f"Internal server error: {type(exc).__name__}", "server_error").response()
