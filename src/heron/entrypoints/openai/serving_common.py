"""What the completion and chat handlers share: admission, turning request
fields into ``SamplingParams``, context-length checks, streaming plumbing
(SSE, merging several prompts' streams, timeouts, client disconnects; the
stall guard of streamed responses is ``streaming.py``)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Iterator, Sequence
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from heron.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineNotReadyError,
    EngineRequestError,
    ServerStoppingError,
)
from heron.engine.input_processor import InvalidRequestError, ProcessedPrompt
from heron.entrypoints.openai.errors import (
    APIError,
    bad_request,
    model_not_found,
    timed_out,
    too_many_requests,
    unavailable,
)
from heron.entrypoints.openai.protocol import OpenAIModel, SamplingFields
from heron.entrypoints.openai.request_log import log_prompt, logging_outputs
from heron.entrypoints.openai.responses_store import ResponseStore
from heron.entrypoints.openai.shared_gateway import SharedGatewayState
from heron.entrypoints.openai.streaming import GuardedStreamingResponse
from heron.outputs import RequestOutput
from heron.routing.health import REQUEST_FAILURE_HEADER
from heron.sampling_params import RequestOutputKind, SamplingParamError, SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class ServingContext:
    engine: AsyncLLM
    served_model_name: str  # the name answers report
    max_model_len: int
    max_waiting_requests: int | None = None
    request_timeout_s: float | None = None
    # --log-requests: prompts, sampling parameters and outputs at INFO (request_log.py)
    log_requests: bool = False
    # seconds a streamed response's send may stay pending before the stream is ended (None: no limit)
    stream_stall_timeout_s: float | None = None
    # --trust-request-chat-template: render a request's own chat_template (else a 400)
    trust_request_chat_template: bool = False
    # --chat-template: the template chat requests are rendered with (None: the model's)
    chat_template: str | None = None
    # --tool-call-parser: the format tool calls are read in (None: the template's, else hermes)
    tool_call_parser: str | None = None
    # the Responses API's stored responses (previous_response_id, GET /v1/responses/{id})
    responses: ResponseStore = field(default_factory=ResponseStore)
    # the state every API-server process of this server shares (--api-server-count)
    shared: SharedGatewayState | None = None
    # more of /health's answer when ready (which of several API servers answered)
    health_extra: dict[str, Any] = field(default_factory=dict)
    # more names a request may give for the model (--served-model-name a b: "b" here)
    served_model_aliases: tuple[str, ...] = ()

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.served_model_aliases)

    @contextmanager
    def admitting(self) -> Iterator[int]:
        """Requests without a first token yet, in the whole server, with no
        other admission anywhere in the server until the block ends (the engine's
        count changes synchronously when a request is added, so in one process
        the event loop is the lock; several API servers take the state file's)."""
        if self.shared is not None and self.max_waiting_requests is not None:
            with self.shared.admitting() as waiting:
                yield waiting
        else:
            yield self.engine.num_waiting_requests

    def count_abort(self, reason: str) -> None:
        """An HTTP request this server ended early (``heron:request_aborts_total``)."""
        self.engine.metrics.count_request_abort(reason)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def request_ids(client_id: str | None, prefix: str) -> tuple[str, str]:
    """The answer's id (the client's ``request_id`` when it sent one) and the
    id the engine knows the request by, unique even when clients reuse theirs:
    an engine may still hold a reused id (a P/D pull under way, a lease), and
    two clients may pick the same one. An empty one counts as none (an answer
    whose id is "" is no id)."""
    if not client_id:
        generated = new_request_id(prefix)
        return generated, generated
    return client_id, f"{client_id}-{uuid.uuid4().hex[:12]}"


def engine_unavailable(engine: AsyncLLM) -> APIError | None:
    """The 503 to answer while the engine cannot serve (loading, or dead), else None."""
    if engine.is_dead:
        return unavailable(f"The engine is not running: {engine.dead_reason}", "engine_dead")
    if not engine.is_ready:
        return unavailable("The model is still loading; retry shortly.", "model_loading")
    return None


def check_request(ctx: ServingContext, request: OpenAIModel, model: str | None) -> None:
    """Model name and unknown fields (engine health: the gateway answered 503
    before this ran, and generate raises if the engine dies since; the queue's
    bound is checked where requests are added, by ``start_generation``)."""
    check_model_name(ctx, model)
    unknown = request.unknown_fields()
    if unknown:
        logger.warning("ignoring unknown request fields: %s", loggable_names(unknown))


def check_model_name(ctx: ServingContext, model: str | None) -> None:
    """A 404 for a model name the server does not answer to (None: any)."""
    if model is not None and model not in ctx.served_model_names:
        raise model_not_found(model)


def loggable_names(names: Sequence[str], most: int = 5, longest: int = 64) -> str:
    """Names a client chose, as a log line may hold them: quoted (a newline in
    one forged a log line of its own), each cut short, a few and a count (one
    of 5 MB wrote 5 MB of log a request)."""
    shown = [repr(name[:longest]) + ("..." if len(name) > longest else "") for name in names[:most]]
    rest = len(names) - len(shown)
    return ", ".join(shown) + (f" and {rest} more" if rest else "")


def check_waiting_bound(ctx: ServingContext, waiting: int, adding: int = 1) -> None:
    """429 when the ``adding`` sequences of a request (one per prompt and
    choice) would take the sequences waiting past ``--max-waiting-requests``;
    400 when they alone exceed it (no retry would ever fit them). Counted per
    request, a completion of 256 prompts passed a bound of 8 whole."""
    limit = ctx.max_waiting_requests
    if limit is None:
        return
    if adding > limit:
        raise bad_request(
            f"This request would add {adding} sequences (prompts times n), more than the server lets wait at once "
            f"(--max-waiting-requests {limit}); send them in smaller requests.",
            code="too_many_sequences",
        )
    if waiting + adding > limit:
        raise too_many_requests(
            f"The server is overloaded: {waiting} requests are already waiting "
            f"(limit {limit}); retry later.",
            1.0,
            "server_overloaded",
        )


def check_kv_transfer_params(ctx: ServingContext, request: SamplingFields, num_prompts: int = 1) -> None:
    """400 unless ``kv_transfer_params`` (prefill/decode disaggregation) fits this
    server's ``--kv-transfer-config`` and names what a pull needs."""
    params = request.kv_transfer_params
    if params is None:
        return
    config = ctx.engine.config.kv_transfer
    if config is None:
        raise bad_request("kv_transfer_params needs a server started with --kv-transfer-config", "kv_transfer_params")
    if request.n != 1 or num_prompts != 1:
        raise bad_request("kv_transfer_params takes one prompt and n = 1", "kv_transfer_params")
    if params.get("do_remote_decode") and not config.produces:
        raise bad_request("this server is a kv_consumer: it does not keep prefills for others", "kv_transfer_params")
    if params.get("do_remote_decode") and request.stream:
        # the handle is in the finished answer's body: a stream never carried it, and the prefill's blocks were
        # held for nothing until their lease ran out
        raise bad_request("kv_transfer_params.do_remote_decode answers with the handle in its body: send it "
                          "without stream", "stream")
    if params.get("do_remote_prefill"):
        if not config.consumes:
            raise bad_request("this server is a kv_producer: it does not pull prefills", "kv_transfer_params")
        address = params.get("remote_engine_address")
        if not isinstance(address, str) or not address.startswith("tcp://"):
            raise bad_request("kv_transfer_params.remote_engine_address must be a tcp:// address", "kv_transfer_params")
        if not config.allows_peer(address):
            raise bad_request(f"kv_transfer_params.remote_engine_address {address!r} is not among this server's "
                              f"kv_peers", "kv_transfer_params")
        for key in ("remote_num_blocks", "remote_block_size"):
            if not isinstance(params.get(key), int) or params[key] < 0:
                raise bad_request(f"kv_transfer_params.{key} must be an integer >= 0", "kv_transfer_params")
        if not isinstance(params.get("remote_request_id"), str):
            raise bad_request("kv_transfer_params.remote_request_id must be a string", "kv_transfer_params")


def resolve_max_tokens(
    ctx: ServingContext, num_prompt_tokens: int, requested: int | None, param: str, where: str
) -> int:
    """The completion budget; 400 naming both numbers when it does not fit
    (``where``: the field holding the prompt, ``param``: the budget's field)."""
    limit = ctx.max_model_len
    if num_prompt_tokens >= limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, your {where} has "
            f"{num_prompt_tokens} tokens, leaving no room for the completion. Please shorten it.",
            where,
            "context_length_exceeded",
        )
    if requested is None:
        return limit - num_prompt_tokens
    if num_prompt_tokens + requested > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the {where}, {requested} for "
            f"the completion). Please reduce the length of the {where} or {param}.",
            param,
            "context_length_exceeded",
        )
    return requested


def structured_outputs(request: SamplingFields) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format`` (json_object, json_schema) or vLLM's
    ``structured_outputs`` (json, regex, choice, grammar) -> the engine's params."""
    fmt = request.response_format
    # a plain-text format says nothing to combine with (some clients always send it)
    if fmt is not None and fmt.type != "text" and request.structured_outputs is not None:
        raise bad_request("give either response_format or structured_outputs, not both", "response_format")
    try:
        if request.structured_outputs is not None:
            return StructuredOutputsParams(**request.structured_outputs)
    except TypeError as exc:
        raise bad_request(f"structured_outputs: {exc}", "structured_outputs") from exc
    except SamplingParamError as exc:
        raise bad_request(str(exc), exc.param) from exc
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None:
        raise bad_request("response_format.json_schema is required when type is json_schema", "response_format")
    return StructuredOutputsParams(json=fmt.json_schema.schema_)


def sampling_params(
    request: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None,
    stream: bool,
) -> SamplingParams:
    """OpenAI/vLLM fields -> SamplingParams; bad values become 400s naming the field."""
    if request.stream_options is not None and not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    logit_bias = None
    if request.logit_bias:
        try:
            logit_bias = {int(token): float(bias) for token, bias in request.logit_bias.items()}
        except ValueError as exc:
            raise bad_request("logit_bias keys must be token ids (integers as strings)", "logit_bias") from exc
    try:
        return SamplingParams(
            n=request.n,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=0 if request.top_k is None else request.top_k,
            min_p=0.0 if request.min_p is None else request.min_p,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
            logit_bias=logit_bias,
            seed=request.seed,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            allowed_token_ids=request.allowed_token_ids,
            bad_words=request.bad_words,
            include_stop_str_in_output=request.include_stop_str_in_output,
            ignore_eos=request.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=structured_outputs(request),
            kv_transfer_params=request.kv_transfer_params,
        )
    except SamplingParamError as exc:
        raise bad_request(str(exc), exc.param) from exc


def kv_transfer_field(output: RequestOutput) -> dict[str, Any]:
    """A finished prefill's ``kv_transfer_params`` for the response body (or nothing)."""
    return {"kv_transfer_params": output.kv_transfer_params} if output.kv_transfer_params is not None else {}


def invalid_input(exc: InvalidRequestError) -> APIError:
    return bad_request(str(exc), exc.param)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


# one encoder for every event (json.dumps with options builds a new one per call)
_SSE_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def sse(payload: dict[str, Any]) -> str:
    return f"data: {_SSE_ENCODER.encode(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client gone before the answer


def constraint_param(request: SamplingFields, by_tools: bool, format_param: str = "response_format") -> str:
    """The request field an output constraint's error names: ``tools`` when the
    tool choice made it, else the field that carried it (``format_param`` is
    where the format lives: the Responses API's ``text.format``)."""
    if by_tools:
        return "tools"
    return "structured_outputs" if request.structured_outputs is not None else format_param


async def check_constraints(params: Sequence[SamplingParams], param: str) -> None:
    """Parse each request's output constraint on a worker thread before it is
    added: xgrammar's parse of a schema with large repetition bounds takes
    seconds, and on the event loop it stalled every other request and stream.
    The engine's own check (input_processor) then finds it in the parse cache.
    A bad constraint is a 400 naming ``param``. Only a constrained request
    imports the backend (xgrammar, and with it torch: about 1.5 s and 220 MB,
    which every API server's first completion paid). That first import still
    holds the API server's other streams for most of its time (torch's C
    initialisation holds the GIL, on a worker thread too): once per API server,
    and only where constrained requests come."""
    for sample in params:
        if sample.structured_outputs is not None:
            try:
                await asyncio.to_thread(_validate_constraint, sample.structured_outputs.key())
            except ValueError as exc:
                raise bad_request(str(exc), param) from exc


def _validate_constraint(constraint: tuple[str, str]) -> None:
    from heron.structured_output.xgrammar_backend import validate_constraint

    validate_constraint(*constraint)


def name_constraint_errors(
    streams: list[AsyncIterator[RequestOutput]], params: Sequence[SamplingParams], param: str
) -> list[AsyncIterator[RequestOutput]]:
    """The streams, with a constraint the engine could not compile (after
    admission) reported against ``param`` rather than ``structured_outputs``
    (wrapped only where a request is constrained)."""
    if param == "structured_outputs" or all(sample.structured_outputs is None for sample in params):
        return streams
    return [_renamed_constraint_errors(stream, param) for stream in streams]


async def _renamed_constraint_errors(stream: AsyncIterator[RequestOutput], param: str) -> AsyncGenerator[RequestOutput]:
    async with aclosing(stream):  # type: ignore[type-var]
        try:
            async for output in stream:
                yield output
        except InvalidRequestError as exc:
            if exc.param != "structured_outputs":
                raise
            raise InvalidRequestError(str(exc), param) from exc


def start_generation(
    ctx: ServingContext,
    prompts: list[ProcessedPrompt],
    params: list[SamplingParams],
    request_id: str,
    priority: int,
    cache_salt: str | None,
) -> list[AsyncIterator[RequestOutput]]:
    """Admit the request against ``--max-waiting-requests`` and add its prompts
    to the engine in one step (checks and additions of concurrent requests, in
    this process or another API server, never interleave)."""
    with ctx.admitting() as waiting:
        check_waiting_bound(ctx, waiting, sum(prompt_params.n for prompt_params in params))
        arrival = time.monotonic()
        streams: list[AsyncIterator[RequestOutput]] = []
        try:
            for index, (prompt, prompt_params) in enumerate(zip(prompts, params)):
                prompt_id = f"{request_id}-{index}"
                stream = ctx.engine.generate(
                    prompt, prompt_params, prompt_id, priority=priority, cache_salt=cache_salt, arrival_time=arrival,
                )
                if ctx.log_requests:
                    log_prompt(prompt_id, prompt, prompt_params)
                    stream = logging_outputs(prompt_id, stream, prompt_params.output_kind)
                streams.append(stream)
        except (RuntimeError, ValueError) as exc:  # nothing streamed yet: a plain error response
            discard_requests(ctx, request_id, len(streams))  # forget the prompts already accepted
            error = engine_error(exc)
            if error is None:
                raise
            raise error from exc
        return streams


def discard_requests(ctx: ServingContext, request_id: str, num_prompts: int) -> None:
    """Forget the engine requests of ``start_generation`` whose streams never
    started (nothing was sent to the engine core for them; the others are
    already forgotten, and left as they are)."""
    for index in range(num_prompts):
        ctx.engine.discard(f"{request_id}-{index}")


async def merge_streams(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Interleave several prompts' output streams as (prompt index, output).
    Closing this generator closes every stream (aborting the unfinished ones)."""
    if len(streams) == 1:
        try:
            async for output in streams[0]:
                yield 0, output
        finally:
            await streams[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[tuple[int, RequestOutput] | tuple[int, BaseException] | None] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                await queue.put((index, output))
        except BaseException as exc:  # forwarded to the consumer
            await queue.put((index, exc))
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            index, value = item
            if isinstance(value, BaseException):
                raise value
            yield index, value
    finally:
        for task in tasks:
            task.cancel()
        # a stream cannot be closed while its pump is inside it
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]


def engine_error(exc: BaseException) -> APIError | None:
    if isinstance(exc, EngineDeadError):
        return unavailable(f"The engine is not running: {exc}", "engine_dead")
    if isinstance(exc, EngineNotReadyError):
        return unavailable(str(exc), "model_loading")
    if isinstance(exc, ServerStoppingError):
        return unavailable(f"The server is stopping: {exc}", "server_stopping")
    if isinstance(exc, InvalidRequestError):
        return invalid_input(exc)
    if isinstance(exc, EngineRequestError):  # this request's failure: the engine serves on
        return APIError(500, f"The engine could not serve the request: {exc}", "server_error", code="engine_error",
                        headers={REQUEST_FAILURE_HEADER: "kv_load"})
    return None


async def collect_final(ctx: ServingContext, streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Run non-streaming requests to the end (within the request timeout)."""
    finals: dict[int, RequestOutput] = {}
    async with asyncio.timeout(ctx.request_timeout_s), aclosing(merge_streams(streams)) as merged:
        async for index, output in merged:
            if output.finished:
                finals[index] = output
    return [finals[i] for i in range(len(streams))]


async def final_outputs(
    ctx: ServingContext, raw_request: Request, streams: list[AsyncIterator[RequestOutput]]
) -> list[RequestOutput]:
    """Non-streaming requests: run to the end, aborting on disconnect or timeout;
    engine failures become OpenAI errors."""
    try:
        return await until_disconnected(raw_request, lambda: collect_final(ctx, streams))
    except TimeoutError as exc:
        ctx.count_abort("request_timeout")
        raise timed_out(ctx.request_timeout_s or 0) from exc
    except APIError as exc:
        if exc.status_code == CLIENT_CLOSED_REQUEST:
            ctx.count_abort("client_disconnected")
        raise
    except (RuntimeError, ValueError) as exc:
        error = engine_error(exc)
        if error is None:
            raise
        raise error from exc


def streaming_response(
    ctx: ServingContext, body: AsyncGenerator[str, None], request_id: str, num_prompts: int
) -> GuardedStreamingResponse:
    """The SSE response of a streamed request (of ``num_prompts`` prompts, as
    ``start_generation`` named them), under the stall guard."""
    return GuardedStreamingResponse(
        body, stall_timeout_s=ctx.stream_stall_timeout_s, on_end=ctx.count_abort,
        on_closed=lambda: discard_requests(ctx, request_id, num_prompts), request_id=request_id,
    )


async def sse_stream(
    ctx: ServingContext, chunks: AsyncGenerator[str, None], closing: Callable[[], str | None],
    failure: Callable[[APIError], str] | None = None, done: str = SSE_DONE,
) -> AsyncGenerator[str, None]:
    """Wrap a response's SSE chunks: the request timeout, errors as a final error
    event (``failure(error)``, by default the error object as a data line),
    ``closing()`` (e.g. the usage chunk) after a clean end, then ``done`` ([DONE]
    unless the API has none: the Responses API ends at its last event).

    Invariants: the request timeout bounds the waits for the next chunk (the
    engine's share), never a ``yield``, so it never cancels the consumer in the
    middle of a send (a send that stays pending is the stall guard's to end);
    once it expires one chunk is left to send (the last event and [DONE] go
    together). Closing this generator closes ``chunks`` before ``aclose()``
    returns, so the engine requests are aborted at once."""
    timeout = ctx.request_timeout_s
    async with aclosing(chunks):
        try:
            if timeout is None:
                async for chunk in chunks:
                    yield chunk
            else:
                deadline = asyncio.get_running_loop().time() + timeout
                while (chunk_or_end := await _next_chunk(chunks, deadline)) is not None:
                    yield chunk_or_end
        except TimeoutError:
            ctx.count_abort("request_timeout")
            yield (failure or _error_line)(timed_out(timeout or 0)) + done
            return
        except (RuntimeError, ValueError) as exc:
            error = engine_error(exc)
            if error is None:
                raise
            yield (failure or _error_line)(error) + done
            return
        yield (closing() or "") + done


def _error_line(error: APIError) -> str:
    return sse(error.body())


async def _next_chunk(chunks: AsyncIterator[str], deadline: float) -> str | None:
    """The next chunk (None at the end), or TimeoutError once ``deadline`` (loop time) has passed."""
    if asyncio.get_running_loop().time() >= deadline:  # a chunk ready at once would never time out
        raise TimeoutError
    async with asyncio.timeout_at(deadline):
        return await anext(chunks, None)


async def until_disconnected(raw_request: Request, work: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``work`` but cancel it (aborting its requests) if the client goes away."""
    task = asyncio.create_task(work())

    async def watch() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.create_task(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        raise APIError(CLIENT_CLOSED_REQUEST, "Client disconnected.", "client_closed_request")
    finally:
        watcher.cancel()
