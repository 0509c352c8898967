"""The text formats models write tool calls in, and their parsers (vLLM's
names): ``hermes`` (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``:
Qwen2.5/Qwen3, Hermes, and heron's own prompt for templates without tools),
``llama3_json`` (``{"name": ..., "parameters": ...}``, after an optional
``<|python_tag|>``, several joined by ``;``) and ``mistral`` (``[TOOL_CALLS]``
then a JSON list, or ``name[ARGS]{...}`` per call).

A parser reads the whole text, or the text so far while streaming
(``final=False``: only calls already closed count). Text that is not a call
stays content; a call whose JSON does not parse makes the whole text content
(the model wrote something else), never an error."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Parsed:
    content: str  # the text that is not a call (before the first call, while streaming)
    calls: list[ToolCall]
    started: bool  # a call's marker has been seen (while streaming: hold the text back)


def call_from_json(value: Any) -> ToolCall | None:
    """``{"name": str, "arguments"|"parameters": object or JSON text}`` -> a call."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def json_values(text: str, separators: str) -> tuple[list[Any], str] | None:
    """The JSON values at the start of ``text``, joined by any of ``separators``
    and whitespace, and the text after the last whole one; None if the text does
    not start with one."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    position = 0
    while True:
        while position < len(text) and (text[position].isspace() or (values and text[position] in separators)):
            position += 1
        try:
            value, position = decoder.raw_decode(text, position)
        except ValueError:
            return (values, text[position:]) if values else None
        values.append(value)


class ToolParser:
    """One format. ``markers``: strings that open a call; text before the first
    is content. ``skip_special_tokens``: whether the markers survive detokenizing
    with special tokens skipped (if not, the request keeps special tokens)."""

    name = ""
    markers: tuple[str, ...] = ()
    skip_special_tokens = True

    def parse(self, text: str, final: bool = True) -> Parsed:
        start = self._first_marker(text)
        if start is None:
            return Parsed(text, [], False)
        calls = self._calls(text[start:], final)
        if calls is None:  # not calls after all
            return Parsed(text if final else text[:start], [], not final)
        return Parsed(text[:start], calls, True)

    def _first_marker(self, text: str) -> int | None:
        found = [text.find(marker) for marker in self.markers if marker in text]
        return min(found) if found else None

    def _calls(self, text: str, final: bool) -> list[ToolCall] | None:
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def _calls(self, text: str, final: bool) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        for match in self._BLOCK.finditer(text):
            closed = match.group(0).endswith("</tool_call>")
            if not closed and not final:
                break  # still being written
            try:
                call = call_from_json(json.loads(match.group(1)))
            except ValueError:
                call = None
            if call is None:
                return None if final else calls
            calls.append(call)
        return calls


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>", "{")
    skip_special_tokens = False

    def parse(self, text: str, final: bool = True) -> Parsed:
        stripped = text.lstrip()
        if not stripped.startswith(self.markers):  # a call is the whole answer, or none is
            return Parsed(text, [], False)
        return super().parse(stripped, final)

    def _calls(self, text: str, final: bool) -> list[ToolCall] | None:
        found = json_values(text.removeprefix("<|python_tag|>"), ";")
        if found is None:
            return None if final else []
        values, rest = found
        calls = [call_from_json(value) for value in values]
        if any(call is None for call in calls) or (final and rest.strip()):
            return None if final else []
        return [call for call in calls if call is not None]


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    skip_special_tokens = False
    _NAMED = re.compile(r"\s*([A-Za-z0-9_.-]+)\[ARGS\]")

    def _calls(self, text: str, final: bool) -> list[ToolCall] | None:
        body = text.removeprefix("[TOOL_CALLS]").strip()
        if body.startswith("["):  # [TOOL_CALLS][{"name": ..., "arguments": ...}, ...]
            found = json_values(body, "")
            if found is None or not isinstance(found[0][0], list):
                return None if final else []
            listed = [call_from_json(value) for value in found[0][0]]
            return None if any(c is None for c in listed) else [c for c in listed if c is not None]
        calls: list[ToolCall] = []  # [TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
        for piece in body.split("[TOOL_CALLS]"):
            match = self._NAMED.match(piece)
            found = json_values(piece[match.end():], "") if match else None
            if match is None or found is None or not isinstance(found[0][0], dict):
                return None if final else calls
            calls.append(ToolCall(match.group(1), json.dumps(found[0][0], ensure_ascii=False)))
        return calls


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def parser_for_template(template: str | None) -> str:
    """The format a chat template teaches its model (hermes where it teaches
    none: heron's own tool prompt is in that format)."""
    template = template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"
