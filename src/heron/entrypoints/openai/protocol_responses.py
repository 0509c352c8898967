"""Request body of OpenAI's Responses API (``POST /v1/responses``), as pydantic
models with the constraints the server enforces (``protocol.py`` holds the
shared types)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints

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

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    def listed(self, item_id: str) -> dict[str, Any]:
        """The item as ``GET /v1/responses/{id}/input_items`` lists it."""
        kind = "output_text" if self.role == "assistant" else "input_text"
        parts = [{"type": kind, "text": self.content}] if isinstance(self.content, str) else [
            {"type": kind if part.type == "text" else part.type, "text": part.text} for part in self.content]
        return {"id": item_id, "type": "message", "role": self.role, "content": parts, "status": "completed"}


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

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)

    def listed(self, item_id: str) -> dict[str, Any]:
        output = self.output if isinstance(self.output, str) else [part.model_dump() for part in self.output]
        return {"id": item_id, "type": "function_call_output", "call_id": self.call_id, "output": output,
                "status": "completed"}


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


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
    input: str | Annotated[list[InputItem], Field(min_length=1)]
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
    # OpenAI's bounds: 16 pairs, keys of 64 characters, values of 512 (a stored response keeps them)
    metadata: Annotated[
        dict[Annotated[str, StringConstraints(max_length=64)], Annotated[str, StringConstraints(max_length=512)]],
        Field(max_length=16),
    ] | None = None
    user: Annotated[str, StringConstraints(max_length=512)] | None = None
