"""POST /v1/responses: OpenAI's Responses API, on the chat machinery. The
input items (and, with ``previous_response_id``, the stored conversation
before them) become chat messages, ``instructions`` a system message, function
tools and ``text.format`` the chat request's tools and response format; the
answer's text and calls become output items. Streamed, it sends the Responses
event types (``response.created``, ``response.output_text.delta``,
``response.function_call_arguments.delta``, ``response.completed``...), each
with its ``sequence_number``."""

from __future__ import annotations

import itertools
import json
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from heron.engine.input_processor import InvalidRequestError
from heron.entrypoints.openai.errors import APIError, bad_request
from heron.entrypoints.openai.gateway import key_owner
from heron.entrypoints.openai.off_loop import prepare
from heron.entrypoints.openai.protocol import ChatCompletionRequest
from heron.entrypoints.openai.protocol_responses import FunctionCallItem, MessageItem, ResponsesRequest
from heron.entrypoints.openai.responses_store import StoredResponse
from heron.entrypoints.openai.serving_chat import chat_prompt, request_tools
from heron.entrypoints.openai.serving_common import (
    ServingContext,
    check_constraints,
    check_request,
    constraint_param,
    final_outputs,
    invalid_input,
    merge_streams,
    name_constraint_errors,
    resolve_max_tokens,
    sampling_params,
    sse_stream,
    start_generation,
    streaming_response,
)
from heron.entrypoints.openai.tools.chat import ChatTools
from heron.entrypoints.openai.tools.parsers import ToolCall
from heron.entrypoints.openai.tools.streaming import ToolDeltas
from heron.outputs import RequestOutput


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def input_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input items as chat messages (a function call joins the
    assistant turn right before it, with its text or the calls before it: the
    one turn ``output_as_messages`` makes of a stored response's output, so a
    client replaying the items itself renders the same prompt)."""
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    messages: list[dict[str, Any]] = []
    for item in request.input:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


def check_call_outputs(conversation: list[dict[str, Any]]) -> None:
    """A 400, as OpenAI answers, for a function call output that answers no
    call before it (in the input or the previous response): the model was
    shown a tool result for a call nobody made."""
    called: set[str] = set()
    for message in conversation:
        called.update(call["id"] for call in message.get("tool_calls") or ())
        if message["role"] == "tool" and message["tool_call_id"] not in called:
            raise bad_request(f"No tool call found for function call output with call_id "
                              f"{message['tool_call_id']!r}.", "input")


def listed_input_items(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as ``input_items`` lists it: items with ids (an
    item's own id where it has one, the first time it comes)."""
    items = [MessageItem(role="user", content=request.input)] if isinstance(request.input, str) else request.input
    listed, seen = [], set()
    for item in items:
        entry = item.listed(f"{'fc' if item.type == 'function_call' else 'msg'}_{uuid.uuid4().hex}")
        if entry["id"] in seen:  # an id the client gave twice: pages found its first copy, and paged for ever
            entry["id"] = f"{entry['id']}_{uuid.uuid4().hex[:8]}"
        seen.add(entry["id"])
        listed.append(entry)
    return listed


def chat_request(request: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request a Responses request amounts to."""
    fmt = request.text.format if request.text else None
    response_format: dict[str, Any] | None = None
    if fmt is not None and fmt.type == "json_object":
        response_format = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise bad_request("text.format.schema is required when type is json_schema", "text")
        response_format = {"type": "json_schema", "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_}}
    choice = request.tool_choice
    tools = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
             for tool in request.tools or []]
    return ChatCompletionRequest.model_validate({
        "model": request.model,
        "messages": messages,
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "tools": tools or None,
        "tool_choice": choice if choice is None or isinstance(choice, str)
        else {"type": "function", "function": {"name": choice.name}},
        "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": response_format,
        "user": request.user,
    })


_CHAT_TOOL_FIELD = re.compile(r"tools\[(\d+)\]\.function\.")


def _in_responses_terms(error: APIError) -> APIError:
    """A tools error of the chat request this one amounts to, naming the
    Responses request's own fields: its tools have no ``function`` wrapper
    (``tools[1].parameters``, not ``tools[1].function.parameters``)."""
    if error.param is None or not _CHAT_TOOL_FIELD.search(error.param):
        return error
    return bad_request(_CHAT_TOOL_FIELD.sub(r"tools[\1].", error.message),
                       _CHAT_TOOL_FIELD.sub(r"tools[\1].", error.param))


# what ``include`` may name here: the rest asks for what heron does not produce (logprobs), or for the
# outputs of OpenAI's built-in tools, which it refuses anyway; reasoning.encrypted_content (Codex sends
# it) has nothing to carry, with no reasoning items
_INCLUDABLE = frozenset({"reasoning.encrypted_content"})


def refuse_unserved(request: ResponsesRequest) -> None:
    """A 400 for OpenAI fields heron does not serve, when the request asks for them:
    answering as if they were not there looked like what was asked."""
    if request.background:
        raise bad_request("background responses are not supported: leave background out (or false) and "
                          "stream the response instead", "background")
    if request.conversation is not None:
        raise bad_request("conversation objects are not supported: continue a conversation with "
                          "previous_response_id, or send it whole as input", "conversation")
    unserved = [name for name in request.include or [] if name not in _INCLUDABLE]
    if unserved:
        raise bad_request(f"include: {unserved[0]!r} is not available here (logprobs are, on "
                          "/v1/chat/completions)", "include")
    if request.top_logprobs:
        raise bad_request("top_logprobs is not available here (it is, on /v1/chat/completions)", "top_logprobs")
    if (request.model_extra or {}).get("prompt") is not None:
        raise bad_request("stored prompt templates are not supported: send the prompt's text as input and "
                          "instructions", "prompt")


async def create_response(ctx: ServingContext, request: ResponsesRequest, raw_request: Request) -> Any:
    refuse_unserved(request)  # first: `prompt` is no unknown field to log as ignored
    check_request(ctx, request, request.model)
    owner = key_owner(raw_request)
    history: list[dict[str, Any]] = []
    if request.previous_response_id is not None:
        previous = ctx.responses.get(request.previous_response_id, owner)
        if previous is None:
            raise bad_request(f"Previous response with id {request.previous_response_id!r} not found.",
                              "previous_response_id", "previous_response_not_found")
        history = previous.conversation
    conversation = history + input_messages(request)
    check_call_outputs(conversation)
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    chat = chat_request(request, system + conversation)
    try:
        tools = request_tools(ctx, chat)
    except APIError as exc:
        raise _in_responses_terms(exc) from exc
    prompt = await prepare(raw_request, lambda: chat_prompt(ctx, chat))
    max_tokens = resolve_max_tokens(ctx, len(prompt.token_ids), request.max_output_tokens, "max_output_tokens", "input")
    params = sampling_params(chat, max_tokens, None, None, request.stream)
    if tools is not None:
        try:
            params = tools.constrain(params)
        except ValueError as exc:
            raise bad_request(str(exc).replace("response_format", "text.format"), "tool_choice") from exc
    response_id = f"resp_{uuid.uuid4().hex}"
    param = constraint_param(chat, tools is not None and tools.choice.constrains, "text.format")
    await check_constraints([params], param)
    try:
        streams = start_generation(ctx, [prompt], [params], response_id, 0, None)
    except InvalidRequestError as exc:
        raise invalid_input(exc) from exc
    streams = name_constraint_errors(streams, [params], param)
    builder = ResponseBuilder(ctx, request, response_id, tools, conversation, owner)
    if request.stream:
        # a failure mid-stream ends it with response.failed; the Responses API has no [DONE]
        events = sse_stream(ctx, builder.events(streams), lambda: None, failure=builder.failed_event, done="")
        return streaming_response(ctx, events, response_id, 1)
    [final] = await final_outputs(ctx, raw_request, streams)
    completion = final.outputs[0]
    content, calls = tools.calls(completion.text) if tools else (completion.text, [])
    # a message item where there is text (with tools, only then: as the stream of the same output has it)
    output = [*([message_item(item_id("msg"), content)] if content is not None and (content or tools is None) else []),
              *(call_item(item_id("fc"), call) for call in calls)]
    if cuts_last_item(tools, completion.finish_reason) and output:
        output[-1]["status"] = "incomplete"  # the item max_output_tokens cut, as OpenAI marks it
    return JSONResponse(builder.finish(output, final, completion.finish_reason, len(completion.token_ids)))


def cuts_last_item(tools: ChatTools | None, finish_reason: str | None) -> bool:
    """Whether max_output_tokens ended the output inside its last item. Under
    tool_choice "required" only the calls the output closed become items (a
    call cut short is dropped), so every item it has is complete; the response
    itself is still "incomplete"."""
    return finish_reason == "length" and not (tools is not None and tools.choice.mode == "required")


def message_item(identifier: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": identifier, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def call_item(identifier: str, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": identifier, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status == "completed" else "", "status": status}


def output_as_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the assistant turn a follow-up continues."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                      "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


class ResponseBuilder:
    def __init__(self, ctx: ServingContext, request: ResponsesRequest, response_id: str, tools: ChatTools | None,
                 conversation: list[dict[str, Any]], owner: str | None = None) -> None:
        self.ctx = ctx
        self.owner = owner  # of the API key that asked: only it reads the stored response
        self.request = request
        self.response_id = response_id
        self.tools = tools
        self.conversation = conversation
        self.created = int(time.time())
        self._sequence = itertools.count()
        self._items: StreamedItems | None = None

    def event(self, kind: str, **fields: Any) -> str:
        """One streamed event, numbered in order."""
        payload = {"type": kind, "sequence_number": next(self._sequence), **fields}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def failed_event(self, error: APIError) -> str:
        """The event that ends a stream the server could not finish (a timeout, the
        engine gone): the response as far as it got, ``failed``, with the error."""
        output = self._items.output if self._items is not None else []
        for item in output:
            if item["status"] == "in_progress":
                item["status"] = "incomplete"
        response = self.response("failed", output, None)
        # the engine gone or the server stopping keeps its code: a router tries another replica on those
        response["error"] = {"code": error.code or "server_error", "message": error.message}
        return self.event("response.failed", response=response)

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                 incomplete: str | None = None) -> dict[str, Any]:
        request = self.request
        choice = request.tool_choice
        named = choice is not None and not isinstance(choice, str)
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "model": self.ctx.served_model_name,
            "output": output,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "tool_choice": choice.model_dump() if named else choice or "auto",  # type: ignore[union-attr]
            "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
            "text": request.text.model_dump(by_alias=True, exclude_none=True) if request.text
            else {"format": {"type": "text"}},
            "store": request.store,
            "metadata": request.metadata or {},
            "user": request.user,
            "usage": usage,
        }

    def finish(self, output: list[dict[str, Any]], final: RequestOutput, reason: str | None,
               output_tokens: int) -> dict[str, Any]:
        """The finished response (kept in the store unless ``store`` is false)."""
        input_tokens = len(final.prompt_token_ids)
        usage = {
            "input_tokens": input_tokens,
            # cache_write_tokens: the SDK's type requires it (heron's prefix cache has no write charge)
            "input_tokens_details": {"cached_tokens": final.num_cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        }
        incomplete = "max_output_tokens" if reason == "length" else None
        response = self.response("incomplete" if incomplete else "completed", output, usage, incomplete)
        if self.request.store:
            conversation = self.conversation + output_as_messages(output)
            self.ctx.responses.put(self.response_id,
                                   StoredResponse(response, conversation, listed_input_items(self.request),
                                                  self.owner))
        return response

    async def events(self, streams: list[AsyncIterator[RequestOutput]]) -> AsyncGenerator[str, None]:
        event = self.event
        yield event("response.created", response=self.response("in_progress", [], None))
        yield event("response.in_progress", response=self.response("in_progress", [], None))
        tool_stream = self.tools.stream() if self.tools else None
        items = self._items = StreamedItems(event)
        final: RequestOutput | None = None
        output_tokens = 0
        async with aclosing(merge_streams(streams)) as merged:
            async for _, output in merged:
                final = output
                completion = output.outputs[0]
                output_tokens += len(completion.token_ids)
                deltas = ToolDeltas(content=completion.text)
                if tool_stream is not None:
                    deltas = tool_stream.feed(completion.text)
                    if completion.finish_reason is not None:
                        rest = tool_stream.finish()
                        deltas.content += rest.content
                        deltas.calls += rest.calls
                for chunk in items.add(deltas):
                    yield chunk
        assert final is not None
        if self.tools is None:  # an output of no text is an empty message, as the answer not streamed has it
            for chunk in items.open_message():
                yield chunk
        for chunk in items.close(cut=cuts_last_item(self.tools, final.outputs[0].finish_reason)):
            yield chunk
        response = self.finish(items.output, final, final.outputs[0].finish_reason, output_tokens)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield event(kind, response=response)


class StreamedItems:
    """The output items of a streamed response as they grow: the message's
    text, and each call's arguments, with the events that announce them."""

    def __init__(self, event: Any) -> None:
        self.event = event
        self.output: list[dict[str, Any]] = []
        self.message: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # the call's index -> its item

    def open_message(self) -> list[str]:
        """The message item's opening events (none once it is open)."""
        if self.message is not None:
            return []
        self.message = message_item(item_id("msg"), "", "in_progress")
        events = self._added(self.message)
        events.append(self.event("response.content_part.added", item_id=self.message["id"],
                                 output_index=self._index(self.message), content_index=0,
                                 part={"type": "output_text", "text": "", "annotations": []}))
        self.message["content"] = [{"type": "output_text", "text": "", "annotations": []}]
        return events

    def add(self, deltas: ToolDeltas) -> list[str]:
        events = []
        if deltas.content:
            events += self.open_message()
            assert self.message is not None
            self.message["content"][0]["text"] += deltas.content
            events.append(self.event("response.output_text.delta", item_id=self.message["id"],
                                     output_index=self._index(self.message), content_index=0, delta=deltas.content,
                                     logprobs=[]))
        for call in deltas.calls:
            function = call.get("function", {})
            if "id" in call:
                item = call_item(item_id("fc"), ToolCall(function["name"], "", call["id"]), "in_progress")
                self.calls[call["index"]] = item
                events += self._added(item)
            item = self.calls[call["index"]]
            if function.get("arguments"):
                item["arguments"] += function["arguments"]
                events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                         output_index=self._index(item), delta=function["arguments"]))
        return events

    def close(self, cut: bool = False) -> list[str]:
        """The events that end every item; ``cut``: max_output_tokens ended the
        last one (``incomplete``, as OpenAI marks it)."""
        events = []
        for item in self.output:
            index = self._index(item)
            item["status"] = "incomplete" if cut and item is self.output[-1] else "completed"
            if item["type"] == "message":
                part = item["content"][0]
                events.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                         content_index=0, text=part["text"], logprobs=[]))
                events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                         content_index=0, part=part))
            else:
                events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                         output_index=index, arguments=item["arguments"]))
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def _added(self, item: dict[str, Any]) -> list[str]:
        self.output.append(item)
        return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))]

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, candidate in enumerate(self.output) if candidate is item)
