"""Tools in the prompt. A chat template that takes ``tools`` (Qwen2.5,
Llama 3.1, Mistral...) gets them as it expects and renders the conversation's
calls and results itself. For one that does not (SmolLM2's, any plain ChatML
template), heron writes them in: the tools and the call format (hermes) in the
system message, each assistant call as a ``<tool_call>`` block in its text,
and each tool result as a user turn in ``<tool_response>`` tags, so the model
sees the whole exchange and the hermes parser reads its answer. The server and
the offline ``LLM.chat`` both prepare a conversation here (``template_messages``)."""

from __future__ import annotations

import json
from typing import Any

TOOL_PROMPT = """You can call functions to answer. These are the functions, as JSON schemas:
<tools>
{tools}
</tools>
To call one, write a JSON object with the function's name and its arguments inside tags, one block per call:
<tool_call>
{{"name": "<function name>", "arguments": {{<the arguments>}}}}
</tool_call>"""


def template_takes_tools(template: str | None) -> bool:
    return bool(template) and "tools" in str(template)


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    return TOOL_PROMPT.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))


def call_block(call: dict[str, Any]) -> str:
    function = call.get("function", {})
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        pass  # the client's text, as it gave it
    return "<tool_call>\n" + json.dumps({"name": function.get("name"), "arguments": arguments},
                                        ensure_ascii=False) + "\n</tool_call>"


def _text(content: Any) -> str:
    if isinstance(content, list):  # content parts
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return "" if content is None else str(content)


def write_tools_in(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation as a template without tool support should see it."""
    written: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            blocks = [call_block(call) for call in message["tool_calls"]]
            text = "\n".join(filter(None, [_text(message.get("content")), *blocks]))
            written.append({"role": "assistant", "content": text})
        elif role == "tool":
            written.append({"role": "user", "content": f"<tool_response>\n{_text(message.get('content'))}\n"
                                                       "</tool_response>"})
        else:
            written.append({key: value for key, value in message.items() if key not in ("tool_calls", "tool_call_id")})
    if tools:
        prompt = tools_prompt(tools)
        if written and written[0].get("role") in ("system", "developer"):
            first = written[0]
            written[0] = {**first, "content": f"{_text(first.get('content'))}\n\n{prompt}".lstrip()}
        else:
            written.insert(0, {"role": "system", "content": prompt})
    return written


def template_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template: str | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and template arguments for ``template``: the tools as its
    ``tools`` variable if it takes them, else written into the messages."""
    if template_takes_tools(template):
        return [_arguments_as_objects(message) for message in messages], ({"tools": tools} if tools else {})
    return write_tools_in(messages, tools), {}


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn's call arguments as objects, not JSON text: templates
    that take tools write them with ``| tojson`` (Llama 3.1, Qwen2.5), which
    turned the text into a quoted string (as vLLM does; text that is not JSON
    stays text)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        return message
    parsed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(function, dict) and isinstance(arguments, str):
            try:
                call = {**call, "function": {**function, "arguments": json.loads(arguments)}}
            except ValueError:
                pass
        parsed.append(call)
    return {**message, "tool_calls": parsed}
