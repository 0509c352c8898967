"""Request body of OpenAI's Responses API (``POST /v1/responses``), as pydantic
models with the constraints the server enforces (``protocol.py`` holds the
shared types)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StringConstraints, Tag

from heron.entrypoints.openai.limits import MAX_TOOLS
from heron.entrypoints.openai.protocol import FunctionName, MaxTokens, OpenAIModel


class InputText(OpenAIModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(OpenAIModel):
    """A turn: ``{"role", "content"}``, with or without ``"type": "message"``."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    def listed(self, item_id: str) -> dict[str, Any]:
        """The item as ``GET /v1/responses/{id}/input_items`` lists it."""
        kind = "output_text" if self.role == "assistant" else "input_text"
        parts = [{"type": kind, "text": self.content}] if isinstance(self.content, str) else [
            {"type": kind if part.type == "text" else part.type, "text": part.text} for part in self.content]
        return {"id": self.id or item_id, "type": "message", "role": self.role, "content": parts,
                "status": "completed"}


class FunctionCallItem(OpenAIModel):
    """A call the model made earlier (as a response's output gave it)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None

    def listed(self, item_id: str) -> dict[str, Any]:
        return {"id": self.id or item_id, "type": "function_call", "call_id": self.call_id, "name": self.name,
                "arguments": self.arguments, "status": "completed"}


class FunctionCallOutputItem(OpenAIModel):
    """What a function returned, for the call ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]  # text, or text parts (OpenAI's newer form)
    id: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)

    def listed(self, item_id: str) -> dict[str, Any]:
        output = self.output if isinstance(self.output, str) else [part.model_dump() for part in self.output]
        return {"id": self.id or item_id, "type": "function_call_output", "call_id": self.call_id, "output": output,
                "status": "completed"}


def _item_kind(item: Any) -> str | None:
    """Which model an input item is read as, from its ``type`` (a message may
    leave it out). The tags are class-like names, which an error's ``param``
    leaves out (``input.1.arguments``). A null type is a message's default, as
    null is elsewhere."""
    if isinstance(item, dict):
        kind = "message" if item.get("type") is None else item["type"]
    else:
        kind = getattr(item, "type", None)
    return _ITEM_TAGS.get(kind) if isinstance(kind, str) else None


_ITEM_TAGS = {"message": "Message", "function_call": "FunctionCall", "function_call_output": "FunctionCallOutput"}

# by its type, so an error names the field of the item the client meant (a function_call whose arguments
# were an object read "input.1.type: Input should be 'message'")
InputItem = Annotated[
    Annotated[MessageItem, Tag("Message")] | Annotated[FunctionCallItem, Tag("FunctionCall")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")],
    Discriminator(_item_kind, custom_error_type="invalid_input_item",
                  custom_error_message="an input item's type is message, function_call or function_call_output"),
]


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(OpenAIModel):
    type: Literal["function"]
    name: FunctionName


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(OpenAIModel):
    format: TextFormat | None = None


class ResponsesRequest(OpenAIModel):
    model: str | None = None
    input: Annotated[list[InputItem], Field(min_length=1)] | str  # the list first: its errors are the ones named
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: TextOptions | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    # OpenAI's fields heron does not serve: refused when asked for (a 200 looked like what was asked);
    # truncation "auto" is taken as "disabled" (an input too long is a 400 either way)
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # OpenAI's bounds: 16 pairs, keys of 64 characters, values of 512 (a stored response keeps them)
    metadata: Annotated[
        dict[Annotated[str, StringConstraints(max_length=64)], Annotated[str, StringConstraints(max_length=512)]],
        Field(max_length=16),
    ] | None = None
    user: Annotated[str, StringConstraints(max_length=512)] | None = None
