"""POST /v1/chat/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from heron.engine.input_processor import InvalidRequestError, ProcessedPrompt, flatten_content
from heron.engine.tool_prompting import template_messages
from heron.entrypoints.openai.errors import bad_request
from heron.entrypoints.openai.logprob_fields import chat_logprobs, check_prompt_logprobs, prompt_logprobs_field
from heron.entrypoints.openai.off_loop import prepare
from heron.entrypoints.openai.protocol import ChatCompletionRequest
from heron.entrypoints.openai.serving_common import (
    ServingContext,
    check_constraints,
    check_kv_transfer_params,
    check_request,
    constraint_param,
    final_outputs,
    invalid_input,
    kv_transfer_field,
    merge_streams,
    name_constraint_errors,
    request_ids,
    resolve_max_tokens,
    sampling_params,
    sse,
    sse_stream,
    start_generation,
    streaming_response,
    usage,
)
from heron.entrypoints.openai.tools.chat import ChatTools, finish_reason
from heron.entrypoints.openai.tools.parsers import ToolCall
from heron.entrypoints.openai.tools.streaming import ToolCallStream
from heron.outputs import CompletionOutput, RequestOutput, SampleLogprobs


def chat_template_of(ctx: ServingContext, request: Any) -> str | None:
    """The template a request is rendered with: its own (if the server trusts
    requests' templates), else --chat-template, else the model's."""
    if request.chat_template is not None and not ctx.trust_request_chat_template:
        raise bad_request(
            "this server does not render chat templates sent in requests (a template is code the server runs); "
            "start it with --trust-request-chat-template to allow them",
            "chat_template",
        )
    return request.chat_template or ctx.chat_template


def chat_prompt(ctx: ServingContext, request: Any) -> ProcessedPrompt:
    """Apply the chat template to ``request.messages`` and its tools (chat and
    /tokenize; the request model has checked the roles)."""
    if request.both_endings():  # a 400 naming the field (a model validator's names none)
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true: continue the "
                          "last message, or start a new one after it", "continue_final_message")
    template = chat_template_of(ctx, request)
    messages = [message.model_dump(exclude_none=True) for message in request.messages]
    tools = [tool.model_dump(exclude_none=True) for tool in getattr(request, "tools", None) or []]
    model_template = template or getattr(ctx.engine.tokenizer, "chat_template", None)
    messages, template_kwargs = template_messages(messages, tools or None, model_template)
    try:
        return ctx.engine.input_processor.process_chat(
            messages,
            chat_template=template,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template_kwargs={**(getattr(request, "chat_template_kwargs", None) or {}), **template_kwargs},
        )
    except InvalidRequestError as exc:
        raise invalid_input(exc) from exc


def request_tools(ctx: ServingContext, request: ChatCompletionRequest) -> ChatTools | None:
    template = chat_template_of(ctx, request) or getattr(ctx.engine.tokenizer, "chat_template", None)
    try:
        return ChatTools.of(request, template, ctx.tool_call_parser)
    except InvalidRequestError as exc:
        raise invalid_input(exc) from exc


async def create_chat_completion(ctx: ServingContext, request: ChatCompletionRequest, raw_request: Request) -> Any:
    check_request(ctx, request, request.model)
    tools = request_tools(ctx, request)
    top_logprobs = request.top_logprobs or 0
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    check_prompt_logprobs(request.prompt_logprobs, request.stream)
    prompt = await prepare(raw_request, lambda: chat_prompt(ctx, request))
    check_kv_transfer_params(ctx, request)
    requested = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(ctx, len(prompt.token_ids), requested, param, "messages")
    params = sampling_params(
        request, max_tokens, top_logprobs if request.logprobs else None, request.prompt_logprobs, request.stream
    )
    if tools is not None:
        try:
            params = tools.constrain(params)
        except ValueError as exc:
            raise bad_request(str(exc), "tool_choice") from exc
    request_id, engine_id = request_ids(request.request_id, "chatcmpl")
    param = constraint_param(request, tools is not None and tools.choice.constrains)
    await check_constraints([params], param)
    try:
        streams = start_generation(ctx, [prompt], [params], engine_id, request.priority, request.cache_salt)
    except InvalidRequestError as exc:
        raise invalid_input(exc) from exc
    streams = name_constraint_errors(streams, [params], param)
    builder = _ChatBuilder(ctx, request, prompt, request_id, int(time.time()), top_logprobs, tools)
    if request.stream:
        return streaming_response(ctx, builder.stream(streams), engine_id, 1)
    [final] = await final_outputs(ctx, raw_request, streams)
    return JSONResponse(builder.response(final))


class _ChatBuilder:
    def __init__(self, ctx: ServingContext, request: ChatCompletionRequest, prompt: ProcessedPrompt,
                 request_id: str, created: int, top_logprobs: int, tools: ChatTools | None = None) -> None:
        self.ctx = ctx
        self.tools = tools
        self.request = request
        self.prompt = prompt
        self.request_id = request_id
        self.created = created
        self.top_logprobs = top_logprobs
        self.tokenizer = ctx.engine.tokenizer
        last = request.messages[-1]
        # as the template saw it: content parts joined (a list of text parts echoed nothing)
        self.echo_text = (
            str(flatten_content(last.model_dump(exclude_none=True))["content"])
            if request.echo and last.role == "assistant"
            else ""
        )

    def _logprobs(self, token_ids: list[int], logprobs: SampleLogprobs | None) -> dict[str, Any] | None:
        if not self.request.logprobs:
            return None
        return chat_logprobs(self.tokenizer, token_ids, logprobs or [], self.top_logprobs)

    def _message_choice(self, completion: CompletionOutput) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.echo_text + completion.text}
        calls: list[ToolCall] = []
        if self.tools is not None:
            content, calls = self.tools.calls(completion.text)
            if calls:
                # the echoed text too, as the stream of the same answer sends it
                message = {"role": "assistant", "content": self.echo_text + (content or "") or None,
                           "tool_calls": [call.to_openai() for call in calls]}
            else:
                message["content"] = self.echo_text + content if content is not None else self.echo_text or None
        return {
            "index": completion.index,
            "message": message,
            "logprobs": self._logprobs(completion.token_ids, completion.logprobs),
            "finish_reason": finish_reason(completion.finish_reason, bool(calls),
                                           self.tools.choice.mode if self.tools else "auto"),
            "stop_reason": completion.stop_reason,
        }

    def response(self, final: RequestOutput) -> dict[str, Any]:
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        body = {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.ctx.served_model_name,
            "choices": [self._message_choice(c) for c in final.outputs],
            "usage": usage(len(final.prompt_token_ids), completion_tokens, final.num_cached_tokens),
            **kv_transfer_field(final),
        }
        if self.request.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_field(final.prompt_logprobs, final.prompt_token_ids,
                                                            self.request.prompt_logprobs)
        return body

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.ctx.served_model_name,
            "choices": choices,
        }

    def stream(self, streams: list[AsyncIterator[RequestOutput]]) -> AsyncGenerator[str, None]:
        options = self.request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous_usage_stats)
        prompt_tokens = len(self.prompt.token_ids)
        counts = {"completion": 0, "cached": 0}
        tool_streams = {index: self.tools.stream() for index in range(self.request.n)} if self.tools else {}

        async def chunks() -> AsyncGenerator[str, None]:
            announced = False
            async with aclosing(merge_streams(streams)) as merged:
                async for _, output in merged:
                    counts["cached"] = output.num_cached_tokens
                    for completion in output.outputs:
                        if not completion.text and not completion.token_ids and completion.finish_reason is None:
                            continue
                        counts["completion"] += len(completion.token_ids)
                        delta: dict[str, Any] = {"content": completion.text} if completion.text else {}
                        reason = completion.finish_reason
                        tool_stream = tool_streams.get(completion.index)
                        if tool_stream is not None:
                            delta, reason = tool_delta(tool_stream, completion.text, reason)
                            if not delta and reason is None and not self.request.logprobs:
                                continue  # text held back: a call may be starting
                        chunk = self._chunk([{
                            "index": completion.index,
                            "delta": delta,
                            "logprobs": self._logprobs(completion.token_ids, completion.logprobs),
                            "finish_reason": reason,
                            "stop_reason": completion.stop_reason,
                        }])
                        if continuous:
                            chunk["usage"] = usage(prompt_tokens, counts["completion"], counts["cached"])
                        if not announced:
                            # the first chunk of every choice announces the role (and any echoed text), sent with
                            # the first chunk of output: an engine that fails before leaves its error as the
                            # stream's first event, which a router in front retries on another replica
                            announced = True
                            for index in range(self.request.n):
                                role = {"role": "assistant", "content": self.echo_text}
                                yield sse(self._chunk([{"index": index, "delta": role, "logprobs": None,
                                                        "finish_reason": None}]))
                        yield sse(chunk)

        def closing() -> str | None:
            if not include_usage:
                return None
            chunk = self._chunk([])
            chunk["usage"] = usage(prompt_tokens, counts["completion"], counts["cached"])
            return sse(chunk)

        return sse_stream(self.ctx, chunks(), closing)


def tool_delta(stream: ToolCallStream, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
    """One streamed step's delta with tools: content and whole calls, and at the
    end what was held back; ``tool_calls`` as the reason if the choice called."""
    out = stream.feed(text)
    if reason is not None:
        rest = stream.finish()
        out.content += rest.content
        out.calls += rest.calls
    return out.delta(), finish_reason(reason, stream.called, stream.choice.mode)
