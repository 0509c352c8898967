"""Request bodies of the OpenAI API (plus vLLM's extra sampling fields), as
pydantic models. Types, ranges, enums and the request limits of ``limits.py``
are field constraints here, so the OpenAPI schema the server publishes states
what it enforces; a value outside them is a 400 naming the field
(``routes.py``). ``SamplingParams`` checks the same ranges again for the
offline API. Checks that need the model or the prompt (the vocabulary, the
context length) are the handlers'. Unknown fields are accepted and reported by
``unknown_fields`` so the server can log them."""

from __future__ import annotations

import functools
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StringConstraints, Tag, model_validator

from heron.entrypoints.openai.limits import (
    MAX_BAD_WORDS,
    MAX_INT,
    MAX_N,
    MAX_PROMPTS_PER_REQUEST,
    MAX_REPETITION_PENALTY,
    MAX_SAMPLING_TEMPERATURE,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
    MIN_INT,
    MIN_REPETITION_PENALTY,
)

Int64 = Annotated[int, Field(ge=MIN_INT, le=MAX_INT)]
TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
MaxTokens = Annotated[int, Field(ge=1)]
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


class OpenAIModel(BaseModel):
    """A request body's model. A ``null`` given for a field that has a default
    means that default, as OpenAI's spec types such fields (``stream``, ``n``,
    ``store``...: ``boolean | null``) and as vLLM takes them: clients and
    wrappers that pass ``stream=None`` on got a 400."""

    # JSON has no NaN or Infinity; Python's parser accepts them, the models do not. The published
    # schema says null is taken where it means the default
    model_config = ConfigDict(extra="allow", allow_inf_nan=False,
                              json_schema_extra=lambda schema, model: _nullable_defaults(schema, model))

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        defaulted = _fields_with_defaults(cls)
        if not any(value is None and name in defaulted for name, value in data.items()):
            return data
        return {name: value for name, value in data.items() if value is not None or name not in defaulted}

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


@functools.cache
def _fields_with_defaults(model: type[BaseModel]) -> frozenset[str]:
    """The names a body gives ``model``'s fields whose default is not None and whose type
    has no None of its own (a required field is not one; completions' ``max_tokens``,
    default 16, takes null as "up to the context's end", as vLLM does)."""
    return frozenset(field.alias or name for name, field in model.model_fields.items()
                     if not field.is_required() and field.get_default(call_default_factory=False) is not None
                     and not _admits_none(field.annotation))


def _nullable_defaults(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """Types each field that takes null as its default (``_fields_with_defaults``)
    as ``T | null`` in ``model``'s JSON Schema, as OpenAI's spec types them (the
    published schema said ``stream`` was a boolean alone, so a client generated
    from it could not send the null heron takes)."""
    properties = schema.get("properties", {})
    for name in _fields_with_defaults(model):
        field = properties.get(name)
        if not isinstance(field, dict):
            continue
        if isinstance(field.get("anyOf"), list):
            if {"type": "null"} not in field["anyOf"]:
                field["anyOf"].append({"type": "null"})
            continue
        annotations = {key: field.pop(key) for key in ("title", "description", "default", "examples") if key in field}
        properties[name] = {"anyOf": [field, {"type": "null"}], **annotations}


def _admits_none(annotation: Any) -> bool:
    if annotation is None or annotation is type(None):
        return True
    if typing.get_origin(annotation) is Annotated:
        return _admits_none(typing.get_args(annotation)[0])
    return any(_admits_none(member) for member in typing.get_args(annotation)
               if typing.get_origin(annotation) in (typing.Union, types.UnionType))


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(OpenAIModel):
    """``response_format.json_schema``: the schema the output must match."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(OpenAIModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=MAX_SAMPLING_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    # keys: token ids as strings (checked against the vocabulary by the handler)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    seed: Int64 | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1, le=MAX_INT)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    stop_token_ids: list[TokenId] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    bad_words: Annotated[list[StopString], Field(max_length=MAX_BAD_WORDS)] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: TopLogprobs | None = None
    structured_outputs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    priority: Int64 = 0
    # an empty salt shared the unsalted cache (vLLM refuses it too)
    cache_salt: Annotated[str, StringConstraints(min_length=1)] | None = None
    request_id: str | None = None
    # prefill/decode disaggregation (vLLM's field): {"do_remote_decode": true} asks a
    # prefill server to keep the prompt's KV; its answer's kv_transfer_params, sent to
    # a decode server, make that server pull it
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    # one prompt (text or token ids) or a list of them
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS_PER_REQUEST)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS_PER_REQUEST)]
    )
    # 0 with echo: the prompt scored, nothing generated (lm-evaluation-harness's loglikelihood asks so)
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    logprobs: TopLogprobs | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    add_special_tokens: bool = True


# OpenAI's rule for function names (they also go into grammars and prompts)
FunctionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionDefinition(OpenAIModel):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(OpenAIModel):
    name: FunctionName


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: ChosenFunction


class CalledFunction(OpenAIModel):
    name: str
    arguments: str  # a JSON object, as text


class MessageToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(OpenAIModel):
    role: ChatRole
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: which call it answers


class ChatPromptFields(OpenAIModel):
    """What a conversation is rendered into a prompt with: chat completions and
    /tokenize take the same fields, checked the same way."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
    # vLLM extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def both_endings(self) -> bool:
        """Both asked for (an explicit add_generation_prompt with
        continue_final_message): the final message was continued and the
        generation prompt silently dropped; vLLM refuses it."""
        return self.continue_final_message and self.add_generation_prompt and (
            "add_generation_prompt" in self.model_fields_set)


class ChatCompletionRequest(SamplingFields, ChatPromptFields):
    max_tokens: MaxTokens | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    echo: bool = False  # a vLLM extension


class TokenizeCompletionRequest(OpenAIModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatPromptFields):
    model: str | None = None
    return_token_strs: bool = False


def _tokenize_kind(body: Any) -> str:
    """Which /tokenize request a body is: a conversation when it has messages (null is none).
    (Tried in turn, a bad conversation was reported as a missing prompt.)"""
    return "Chat" if isinstance(body, dict) and body.get("messages") is not None else "Completion"


TokenizeRequest = Annotated[  # the tags are capitalised: error paths leave them out as union members' names
    Annotated[TokenizeCompletionRequest, Tag("Completion")] | Annotated[TokenizeChatRequest, Tag("Chat")],
    Discriminator(_tokenize_kind),
]


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[TokenId]

