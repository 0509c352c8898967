"""Tool calling through a live server with the official `openai` client, on
the embedded model (issue #21, item 1): "required" and a named function give
calls that parse and whose arguments validate against the function's schema,
streamed or not; "none" and "auto" answer in text when the model writes no
call; a conversation that carries a call and its result round-trips through
the template; bad tool requests are 400s naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from tests.e2e.server_process import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "minLength": 2, "maxLength": 12}},
        "required": ["timezone"]}
TOOLS = [
    {"type": "function",
     "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris, and what time is it there?"}]


def check_calls(calls, names=None):
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def merge_streamed(chunks):
    """What a client builds from tool-call deltas: calls by index."""
    calls, content, reasons = {}, "", []
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = entry["id"] or delta.id
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    return calls, content, [r for r in reasons if r]


@pytest.mark.parametrize("parallel", [True, False])
def test_required_gives_valid_calls(default_client, parallel):
    answer = default_client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=parallel, max_tokens=120, temperature=0)
    choice = answer.choices[0]
    assert choice.message.content is None
    check_calls(choice.message.tool_calls)
    if parallel:  # a small model may repeat calls until max_tokens: the calls it closed come back
        assert choice.finish_reason in ("tool_calls", "length")
    else:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1


@pytest.mark.parametrize("seed", range(4))
def test_a_named_function_is_called_with_valid_arguments(default_client, seed):
    """Sampled, not greedy: the grammar holds every token to the schema (the
    string's length bound included)."""
    answer = default_client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=80, temperature=1.0, seed=seed,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    [call] = answer.choices[0].message.tool_calls
    check_calls([call], {"get_time"})
    assert answer.choices[0].finish_reason in ("stop", "length")  # a forced call: OpenAI's and vLLM's "stop"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_arrive_as_openai_deltas(default_client, tool_choice):
    stream = default_client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                                    tool_choice=tool_choice, max_tokens=120, temperature=0,
                                                    stream=True)
    calls, content, reasons = merge_streamed(stream)
    named = isinstance(tool_choice, dict)  # a forced call ends with "stop", as OpenAI's and vLLM's
    assert content == "" and reasons in ([("stop" if named else "tool_calls")], ["length"]) and calls
    for entry in calls.values():
        assert entry["id"].startswith("call_")
        jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS[entry["name"]])
    if isinstance(tool_choice, dict):
        assert [entry["name"] for entry in calls.values()] == ["get_weather"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_call_cut_by_max_tokens_is_the_same_streamed_or_not(default_client, tool_choice):
    # was: non-streamed, the unfinished JSON came back as the message's content; streamed, nothing ("required")
    # or a call with the unfinished arguments (named)
    fields = {"model": MODEL, "messages": QUESTION, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 6,
              "temperature": 0}
    whole = default_client.chat.completions.create(**fields).choices[0]
    calls, content, reasons = merge_streamed(default_client.chat.completions.create(**fields, stream=True))
    assert whole.finish_reason == "length" and reasons == ["length"]
    assert whole.message.content is None and content == ""
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []] == [
        (call["name"], call["arguments"]) for _, call in sorted(calls.items())]
    if tool_choice != "required":  # the named call, with its arguments as far as they got
        assert whole.message.tool_calls[0].function.arguments


def test_none_and_auto_answer_in_text_when_the_model_writes_no_call(default_client):
    for tool_choice in ("none", "auto"):
        answer = default_client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                                        tool_choice=tool_choice, max_tokens=24, temperature=0)
        message = answer.choices[0].message
        if message.tool_calls:  # auto: the model may call, and then validly
            assert tool_choice == "auto"
            check_calls(message.tool_calls)
        else:
            assert message.content and answer.choices[0].finish_reason in ("stop", "length")
    streamed = default_client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="none",
                                              max_tokens=24, temperature=0, stream=True)
    calls, content, _ = merge_streamed(streamed)
    assert not calls and content == message.content or tool_choice == "auto"


def test_a_conversation_with_a_call_and_its_result_round_trips(default_server, default_client):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    answer = default_client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=24,
                                                    temperature=0)
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls
    # the model saw the tools, its call and the result
    tokens = httpx.post(f"{default_server.base_url}/tokenize", json={"messages": messages}).json()["tokens"]
    prompt = httpx.post(f"{default_server.base_url}/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
            '\n</tool_call>') in prompt
    assert "<tool_response>\n18 degrees and sunny\n</tool_response>" in prompt


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has spaces"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    # parameters the grammar compiler rejects are the tools' fault (it named "structured_outputs")
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}], "tool_choice": "required"}, "tools"),
])
def test_bad_tool_requests_are_400s_naming_the_field(default_client, fields, param):
    body = {"tools": TOOLS, **fields}
    with pytest.raises(BadRequestError) as info:
        default_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4,
                                       **{k: v for k, v in body.items() if v is not None})
    assert info.value.body["param"] == param, info.value.body


TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_chat_template_that_takes_tools_renders_them_itself(tmp_path):
    template = tmp_path / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    server = ServerProcess("--max-model-len", "2048", "--chat-template", str(template), "--tool-call-parser", "hermes")
    try:
        tokens = httpx.post(f"{server.base_url}/tokenize", json={"messages": QUESTION, "tools": TOOLS}).json()["tokens"]
        prompt = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens}).json()["prompt"]
        assert (prompt.startswith("<|im_start|>system\nTOOLS: get_weather get_time<|im_end|>")
                and "<tools>" not in prompt)
        answer = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused").chat.completions.create(
            model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            max_tokens=80, temperature=0)
        check_calls(answer.choices[0].message.tool_calls)
    finally:
        server.stop()
