"""``tool_choice`` as a constraint on generation. "required" and a named
function are guaranteed, as vLLM does it: the output is constrained (xgrammar)
to JSON a call is read from, so even a small model answers with calls that
parse and whose arguments match the function's schema:

- a named function: the output is its arguments, a JSON object of the
  function's ``parameters`` schema;
- "required": a JSON list of one or more (one, without
  ``parallel_tool_calls``) ``{"name": <a tool's name>, "parameters": {...}}``,
  each object's parameters matching its function's schema.

"auto" leaves generation free and parses what the model writes (``parsers``);
"none" ignores the tools in the answer (the prompt still shows them, as
OpenAI's does)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast

from heron.engine.input_processor import InvalidRequestError
from heron.entrypoints.openai.tools.parsers import ToolCall, call_from_json, json_values
from heron.sampling_params import StructuredOutputsParams
from heron.structured_output.schema_support import UnenforcedSchema, check_schema_support

Mode = Literal["none", "auto", "required", "named"]
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass
class ToolChoice:
    mode: Mode
    functions: dict[str, dict[str, Any]]  # name -> the parameters' JSON schema
    named: str | None = None
    parallel: bool = True

    @property
    def constrains(self) -> bool:
        """Whether the output is constrained to calls (``constraint`` is not None)."""
        return self.mode in ("named", "required")

    def constraint(self) -> StructuredOutputsParams | None:
        if self.mode == "named":
            assert self.named is not None
            return StructuredOutputsParams(json=self.functions[self.named])
        if self.mode == "required":
            # each function's parameters under $defs of their own, their references ("#", "#/$defs/...",
            # "#/definitions/...", "#/properties/...") rebased there: nested in the list of calls they
            # resolved against its root (400s, or a root recursion pointing at the list)
            definitions = {f"tool_{index}": _rebased(schema, f"#/$defs/tool_{index}")
                           for index, schema in enumerate(self.functions.values())}
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "parameters": {"$ref": f"#/$defs/tool_{index}"}},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for index, name in enumerate(self.functions)
            ]
            array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, "$defs": definitions}
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutputsParams(json=array)
        return None

    def calls_from_constrained(self, text: str) -> list[ToolCall] | None:
        """The calls in a "required" output (a JSON list of calls). One cut
        short (by ``max_tokens`` or a stop string) keeps the calls it closed
        (None if it closed none)."""
        start = text.find("[")
        found = json_values(text[start + 1:], ",") if start >= 0 else []
        calls = [call_from_json(item) for item, _ in found]
        return [call for call in calls if call is not None] or None


def _rebased(schema: Any, root: str) -> Any:
    """``schema`` with each local reference (``#``, ``#/...``) made relative to
    ``root`` instead of the document's root."""
    if isinstance(schema, list):
        return [_rebased(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased = {key: _rebased(value, root) for key, value in schema.items()}
    reference = schema.get("$ref")
    if isinstance(reference, str) and (reference == "#" or reference.startswith("#/")):
        rebased["$ref"] = root + reference[1:]
    return rebased


def _parameters(tool: Any, index: int) -> dict[str, Any]:
    """A function's parameters schema, which must describe an object (as OpenAI
    requires): arguments are a JSON object."""
    parameters = tool.function.parameters
    if not parameters:  # none, or {}
        return ANY_OBJECT
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise InvalidRequestError(f"tools[{index}].function.parameters must be the JSON schema of an object "
                                  '({"type": "object", ...})', f"tools[{index}].function.parameters")
    return parameters


def tool_choice_of(tools: list[Any] | None, choice: Any, parallel: bool | None) -> ToolChoice | None:
    """The request's tools and tool_choice, checked (the request model has
    checked their shapes). None when the request has no tools."""
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools", "tool_choice")
        return None
    functions = {tool.function.name: _parameters(tool, index) for index, tool in enumerate(tools)}
    if len(functions) != len(tools):
        raise InvalidRequestError("tools: function names must be unique", "tools")
    if choice is None or isinstance(choice, str):
        mode = cast(Mode, choice or "auto")  # the request model allows none, auto, required
        if mode == "required":
            _check_enforced(functions, list(functions))
        return ToolChoice(mode, functions, None, parallel is not False)
    name = choice.function.name
    if name not in functions:
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not one of the tools", "tool_choice")
    _check_enforced(functions, [name])
    return ToolChoice("named", functions, name, parallel is not False)


def _check_enforced(functions: dict[str, dict[str, Any]], names: list[str]) -> None:
    """Refuse a constrained function whose parameters the grammar could not
    enforce, naming the tool and the path within its parameters (checked in
    the combined "required" schema, the path named heron's own wrapper,
    ``/$defs/tool_0/...``)."""
    for index, name in enumerate(functions):
        if name in names:
            try:
                check_schema_support(functions[name])
            except UnenforcedSchema as exc:
                param = f"tools[{index}].function.parameters"
                raise InvalidRequestError(f"{param}: {exc}", param) from exc
