"""The text formats models write tool calls in, and their parsers (vLLM's
names): ``hermes`` (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``:
Qwen2.5/Qwen3, Hermes, and heron's own prompt for templates without tools),
``llama3_json`` (``{"name": ..., "parameters": ...}``, after an optional
``<|python_tag|>``, several joined by ``;``) and ``mistral`` (``[TOOL_CALLS]``
then a JSON list, or ``name[ARGS]{...}`` per call).

A parser reads the whole text, or the text so far while streaming
(``final=False``: only calls already closed count). The calls are the ones that
closed and parse, in order, up to the first that does not; the text before them
and the text after them (a call cut by ``max_tokens``, one whose JSON does not
parse, words after the calls) is content. With no call at all the whole text is
content (the model wrote something else), never an error. So a stream, which
sends each call as it closes, and the whole text agree."""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Collection
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


@dataclass
class FoundCalls:
    calls: list[ToolCall]  # the calls that closed and parse, in order
    end: int  # where the text after them starts (in the text from the first marker)


def call_from_json(value: Any, names: Collection[str] | None = None) -> ToolCall | None:
    """``{"name": str, "arguments"|"parameters": object or JSON text}`` -> a call,
    if its name is one of ``names`` (when given: the request's functions)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    if names is not None and value["name"] not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = _DECODER.decode(arguments)  # NaN and Infinity are not JSON here either
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # Python's json reads NaN and Infinity, which JSON.parse refuses


def _finite(text: str) -> float:
    """A JSON number as a float, refused where it overflows (``1e400``: written
    back, it was ``Infinity``, which is not JSON)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of a float's range")
    return value


_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)


def json_values(text: str, separators: str) -> list[tuple[Any, int]]:
    """The JSON values at the start of ``text``, joined by any of ``separators``
    and whitespace, each with the position just after it (empty if the text does
    not start with one)."""
    values: list[tuple[Any, int]] = []
    position = 0
    while True:
        while position < len(text) and (text[position].isspace() or (values and text[position] in separators)):
            position += 1
        try:
            value, position = _DECODER.raw_decode(text, position)
        except ValueError:
            return values
        values.append((value, position))


class ToolParser:
    """One format. ``markers``: strings that open a call; text before the first
    is content. ``skip_special_tokens``: whether the markers survive detokenizing
    with special tokens skipped (if not, the request keeps special tokens).
    ``names``: the functions the request offers; a call to another is no call
    (OpenAI calls only offered functions: a JSON answer with a "name" key, say
    {"name": "John", "age": 30}, was read as a call to "John" and lost)."""

    name = ""
    markers: tuple[str, ...] = ()
    # what ends a call: text with none of these adds no call to a stream already in its calls (None: any may)
    closers: tuple[str, ...] | None = None
    skip_special_tokens = True

    def __init__(self, names: Collection[str] | None = None) -> None:
        self.names = names

    def call_id(self) -> str:
        """A new id for a call, in the form the format's chat templates take back."""
        return new_call_id()

    def parse(self, text: str, final: bool = True) -> Parsed:
        start = self._first_marker(text)
        if start is None:
            return Parsed(text, [], False)
        found = self._calls(text[start:], final)
        if not final:
            return Parsed(text[:start], found.calls, True)
        if not found.calls:  # not calls after all
            return Parsed(text, [], False)
        rest = text[start + found.end:]
        return Parsed(text[:start] + (rest if rest.strip() else ""), found.calls, True)

    def _first_marker(self, text: str) -> int | None:
        found = [text.find(marker) for marker in self.markers if marker in text]
        return min(found) if found else None

    def _calls(self, text: str, final: bool) -> FoundCalls:
        """The calls at the start of ``text`` (which starts with a marker)."""
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    closers = ("</tool_call>",)
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def _calls(self, text: str, final: bool) -> FoundCalls:
        found = FoundCalls([], 0)
        for match in self._BLOCK.finditer(text):
            if not match.group(0).endswith("</tool_call>") and not final:
                break  # still being written (at the end, a whole call the model did not close counts)
            try:
                call = call_from_json(_DECODER.decode(match.group(1).strip()), self.names)
            except ValueError:
                call = None
            if call is None:
                break
            found.calls.append(call)
            found.end = match.end()
        return found


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>", "{")
    closers = ("}",)
    skip_special_tokens = False

    def parse(self, text: str, final: bool = True) -> Parsed:
        stripped = text.lstrip()
        if not stripped.startswith(self.markers):  # a call is the whole answer, or none is
            return Parsed(text, [], False)
        parsed = super().parse(stripped, final)
        if final and not parsed.calls:  # no call after all: the answer, as written (its leading space too)
            return Parsed(text, [], False)
        return parsed

    def _calls(self, text: str, final: bool) -> FoundCalls:
        body = text.removeprefix("<|python_tag|>")
        found = FoundCalls([], 0)
        for value, end in json_values(body, ";"):
            call = call_from_json(value, self.names)
            if call is None:
                break
            found.calls.append(call)
            found.end = len(text) - len(body) + end
        return found


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    closers = ("}", "]")
    skip_special_tokens = False
    _NAMED = re.compile(r"\s*([A-Za-z0-9_.-]+)\[ARGS\]")

    def call_id(self) -> str:
        """Nine letters and digits: Mistral's chat templates refuse any other id
        in the history (vLLM's mistral parser makes them so too)."""
        return uuid.uuid4().hex[:9]

    def _calls(self, text: str, final: bool) -> FoundCalls:
        body = text.removeprefix("[TOOL_CALLS]").lstrip()
        offset = len(text) - len(body)
        found = FoundCalls([], 0)
        if body.startswith("["):  # [TOOL_CALLS][{"name": ..., "arguments": ...}, ...]: all of the list or none
            values = json_values(body, "")
            listed = [call_from_json(value, self.names) for value in values[0][0]] if values and isinstance(
                values[0][0], list) else []
            if listed and all(call is not None for call in listed):
                found.calls = [call for call in listed if call is not None]
                found.end = offset + values[0][1]
            return found
        position = 0  # [TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
        while True:
            if found.calls:
                after = body[position:].lstrip()
                if not after.startswith("[TOOL_CALLS]"):
                    return found
                position = len(body) - len(after) + len("[TOOL_CALLS]")
            match = self._NAMED.match(body, position)
            values = json_values(body[match.end():], "") if match else []
            if match is None or not values or not isinstance(values[0][0], dict) or (
                    self.names is not None and match.group(1) not in self.names):
                return found
            found.calls.append(ToolCall(match.group(1), json.dumps(values[0][0], ensure_ascii=False)))
            position = match.end() + values[0][1]
            found.end = offset + position


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
