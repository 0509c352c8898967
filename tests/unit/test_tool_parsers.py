"""The tool-call formats: each parser reads what its models write, leaves
what is not a call as content, and the streamed deltas add up to the same
calls as the whole text, however the text is cut into tokens."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from heron.engine.input_processor import InvalidRequestError
from heron.engine.tool_prompting import template_messages, write_tools_in
from heron.entrypoints.openai.tools.chat import ChatTools
from heron.entrypoints.openai.tools.choice import ToolChoice
from heron.entrypoints.openai.tools.parsers import PARSERS, parser_for_template
from heron.entrypoints.openai.tools.streaming import ToolCallStream, held_tail

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FUNCTIONS = {"get_weather": WEATHER, "get_time": {"type": "object"}}

CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me check.\n", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}',  # unclosed at EOS
     "", [("get_weather", {"city": "Oslo"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
                    '{"name": "get_time", "parameters": {}}',
     "", [("get_weather", {"city": "Rome"}), ("get_time", {})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Lima"}}', "", [("get_weather", {"city": "Lima"})]),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Kyiv"}}]',
     "Sure.", [("get_weather", {"city": "Kyiv"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Bern"}[TOOL_CALLS]get_time[ARGS]{}',
     "", [("get_weather", {"city": "Bern"}), ("get_time", {})]),
]

NOT_CALLS = [
    ("hermes", "The weather in Paris is mild."),
    ("hermes", "<tool_call>\nnot json at all\n</tool_call>"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("llama3_json", "Paris is the capital; {not json}"),
    ("llama3_json", '{"city": "Paris"}'),  # JSON, but not a call
    ("mistral", "[TOOL_CALLS] nothing callable here"),
    # JSON naming no offered function: an answer, not a call (it was read as a call to "John", the answer lost)
    ("llama3_json", '{"name": "John", "age": 30}'),
    ("hermes", '<tool_call>{"name": "search_web", "arguments": {"q": "x"}}</tool_call>'),
    ("mistral", '[TOOL_CALLS][{"name": "search_web", "arguments": {}}]'),
    ("mistral", '[TOOL_CALLS]search_web[ARGS]{"q": "x"}'),
]


def calls_of(calls):
    return [(call.name, json.loads(call.arguments)) for call in calls]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_each_format_is_read(name, text, content, calls):
    parsed = PARSERS[name](FUNCTIONS).parse(text)
    assert parsed.content == content and calls_of(parsed.calls) == calls


@pytest.mark.parametrize("name, text", NOT_CALLS)
def test_what_is_not_a_call_stays_content(name, text):
    parsed = PARSERS[name](FUNCTIONS).parse(text)
    assert parsed.calls == [] and parsed.content == text


def stream_all(choice: ToolChoice, parser_name: str, text: str, step: int):
    """The deltas of ``text`` fed ``step`` characters at a time, merged as a client does."""
    content, calls, called = stream_raw(choice, parser_name, text, step)
    return content, [(name, json.loads(arguments)) for name, arguments in calls], called


def stream_raw(choice: ToolChoice, parser_name: str, text: str, step: int):
    """``stream_all`` with each call's arguments as the text streamed."""
    stream = ToolCallStream(choice, PARSERS[parser_name](choice.functions))
    content, calls = "", {}
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    for delta in deltas:
        content += delta.content
        for call in delta.calls:
            entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] += call.get("function", {}).get("name") or ""
            entry["arguments"] += call.get("function", {}).get("arguments") or ""
            assert ("id" in call) == (entry["name"] == call["function"].get("name") and "name" in call["function"])
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], stream.called


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_streamed_deltas_add_up_to_the_same_calls(name, text, content, calls, step):
    assert stream_all(ToolChoice("auto", FUNCTIONS), name, text, step) == (content, calls, True)


@pytest.mark.parametrize("step", [1, 4, 1000])
@pytest.mark.parametrize("name, text", NOT_CALLS)
def test_streamed_text_that_is_not_a_call_comes_out_whole(name, text, step):
    assert stream_all(ToolChoice("auto", FUNCTIONS), name, text, step) == (text, [], False)


def test_content_flows_until_a_marker_may_be_starting():
    stream = ToolCallStream(ToolChoice("auto", FUNCTIONS), PARSERS["hermes"]())
    assert stream.feed("Hello <tool").content == "Hello "  # "<tool" may open a call: held
    assert stream.feed("s are fun").content == "<tools are fun"
    assert held_tail("abc<tool_c", ("<tool_call>",)) == 7 and held_tail("abc", ("<tool_call>",)) == 0


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_constrained_outputs_stream_as_calls(step):
    named = ToolChoice("named", FUNCTIONS, "get_weather")
    assert stream_all(named, "hermes", '{"city": "Paris"}', step) == ("", [("get_weather", {"city": "Paris"})], True)
    required = ToolChoice("required", FUNCTIONS)
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    assert stream_all(required, "hermes", text, step) == ("", [("get_time", {}), ("get_weather", {"city": "Oslo"})],
                                                          True)
    assert calls_of(required.calls_from_constrained(text)) == [("get_time", {}), ("get_weather", {"city": "Oslo"})]
    # cut by max_tokens: the calls it closed
    assert calls_of(required.calls_from_constrained(text[:-5])) == [("get_time", {})]
    assert required.calls_from_constrained(text[:20]) is None


REQUIRED_CALLS = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'


@pytest.mark.parametrize("cut", [1, 4, 20, 45, -5, None])
@pytest.mark.parametrize("mode, text", [("named", '{\n  "city": "Paris"\n}'), ("required", REQUIRED_CALLS)])
def test_a_finished_output_answers_what_its_stream_sent(mode, text, cut):
    # cut short by max_tokens or not: a named call used to come back as content when its arguments were
    # unfinished (streamed: a call), "required" as the raw text (streamed: nothing, or the closed calls)
    choice = ToolChoice(mode, FUNCTIONS, "get_weather" if mode == "named" else None)
    text = text[:cut]
    content, calls = ChatTools(choice, PARSERS["hermes"]()).calls(text)
    streamed_content, streamed_calls, _ = stream_raw(choice, "hermes", text, 3)
    assert content is None and streamed_content == ""
    assert [(call.name, call.arguments) for call in calls] == streamed_calls
    if mode == "named":
        assert calls[0].arguments == text  # as generated, whitespace and all


def test_the_required_grammar_is_one_call_per_listed_function():
    schema = ToolChoice("required", FUNCTIONS, parallel=False).constraint().json
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [item["properties"]["name"]["const"] for item in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    assert ToolChoice("named", FUNCTIONS, "get_weather").constraint().json == WEATHER
    assert ToolChoice("auto", FUNCTIONS).constraint() is None


def test_templates_name_their_format():
    assert parser_for_template("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert parser_for_template("{{ '<|python_tag|>' }} ipython") == "llama3_json"
    assert parser_for_template("[TOOL_CALLS]") == "mistral"
    assert parser_for_template(None) == "hermes"


def test_a_template_without_tools_gets_them_written_into_the_conversation():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    written = write_tools_in(messages, tools)
    assert [m["role"] for m in written] == ["system", "user", "assistant", "user"]
    assert written[0]["content"].startswith("Be brief.\n\n") and '"get_weather"' in written[0]["content"]
    assert written[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert written[3]["content"] == "<tool_response>\n18 C, sunny\n</tool_response>"
    assert write_tools_in(messages[1:2], tools)[0]["role"] == "system"  # none given: one is added
    assert write_tools_in(messages[1:2], None) == messages[1:2]


def test_chat_template_flag_takes_a_file_or_a_template(tmp_path):
    from heron.entrypoints.openai.cli_args import read_chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert read_chat_template(str(path)) == "{{ messages }}"
    assert read_chat_template("{% for m in messages %}{% endfor %}").startswith("{%")
    assert read_chat_template(None) is None
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))


# calls that closed, then text that is not one: a call cut by max_tokens, one that does not parse, words after
MIXED = [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{oops}\n</tool_call>',
     'Sure.\n\n<tool_call>\n{oops}\n</tool_call>', [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "argu',
     '\n<tool_call>\n{"name": "get_time", "argu', [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Lima"}} I hope this helps',
     " I hope this helps", [("get_weather", {"city": "Lima"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Bern"}[TOOL_CALLS]get_time[ARGS]{"broken',
     '[TOOL_CALLS]get_time[ARGS]{"broken', [("get_weather", {"city": "Bern"})]),
]


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize("name, text, content, calls", MIXED)
def test_closed_calls_count_and_the_rest_is_content_streamed_or_not(name, text, content, calls, step):
    # the stream sent the first call as it closed, then at the end the whole text as content, markup of the
    # call already sent included; the whole text gave no call at all
    tools = ChatTools(ToolChoice("auto", FUNCTIONS), PARSERS[name]())
    whole_content, whole_calls = tools.calls(text)
    assert (whole_content, calls_of(whole_calls)) == (content, calls)
    assert stream_all(ToolChoice("auto", FUNCTIONS), name, text, step) == (content, calls, True)


@pytest.mark.parametrize("step", [1, 1000])
@pytest.mark.parametrize("prefix, content", [("Sure.\n", "Sure.\n"), ("  \n", None)])
def test_text_before_a_call_is_the_same_streamed_or_not(prefix, content, step):
    text = prefix + '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    tools = ChatTools(ToolChoice("auto", FUNCTIONS), PARSERS["hermes"]())
    assert tools.calls(text)[0] == content  # it was stripped ("Sure."), where the stream sent "Sure.\n"
    assert stream_all(ToolChoice("auto", FUNCTIONS), "hermes", text, step)[0] == (content or "")


def test_nan_arguments_are_not_a_call():
    # Python's json reads NaN; the arguments would not parse in a client's JSON.parse
    text = '<tool_call>{"name": "get_time", "arguments": {"x": NaN}}</tool_call>'
    assert PARSERS["hermes"]().parse(text).calls == []
    as_text = '<tool_call>{"name": "get_time", "arguments": "{\\"x\\": Infinity}"}</tool_call>'  # arguments as text
    assert PARSERS["hermes"]().parse(as_text).calls == []


@pytest.mark.parametrize("name, text", [
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"x": 1e400}}</tool_call>'),
    ("llama3_json", '{"name": "get_time", "parameters": {"x": -1e999}}'),
    ("mistral", '[TOOL_CALLS]get_time[ARGS]{"x": 1e400}'),
])
def test_a_number_past_a_floats_range_is_not_a_call(name, text):
    """1e400 parsed to inf, and the arguments went out as {"x": Infinity}, which is not JSON."""
    assert PARSERS[name](FUNCTIONS).parse(text).calls == []
    required = ToolChoice("required", FUNCTIONS)
    assert required.calls_from_constrained('[{"name": "get_time", "parameters": {"x": 1e400}}]') is None


@pytest.mark.parametrize("step", [1, 1000])
def test_an_answer_that_only_looks_like_a_call_keeps_its_leading_space(step):
    """llama3_json: the whole answer kept it, the stream's content lost it."""
    text = '\n{"answer": 42}'
    tools = ChatTools(ToolChoice("auto", FUNCTIONS), PARSERS["llama3_json"](FUNCTIONS))
    assert tools.calls(text) == (text, [])
    assert stream_all(ToolChoice("auto", FUNCTIONS), "llama3_json", text, step) == (text, [], False)


@pytest.mark.parametrize("mode", ["auto", "named", "required"])
def test_mistral_call_ids_are_what_its_templates_take(mode):
    """Mistral's templates refuse a tool call id that is not nine letters and
    digits: heron's own answer, sent back in the history, was a 400."""
    choice = ToolChoice(mode, FUNCTIONS, "get_time" if mode == "named" else None)
    texts = {"auto": '[TOOL_CALLS]get_time[ARGS]{}', "named": "{}", "required": '[{"name": "get_time", '
             '"parameters": {}}]'}
    for name, form in (("mistral", r"[A-Za-z0-9]{9}"), ("hermes", r"call_[0-9a-f]{24}")):
        parser = PARSERS[name](FUNCTIONS)
        text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' if (name, mode) == (
            "hermes", "auto") else texts[mode]
        [call] = ChatTools(choice, parser).calls(text)[1]
        stream = ToolCallStream(choice, parser)
        [streamed] = stream.feed(text).calls + stream.finish().calls
        assert re.fullmatch(form, call.id) and re.fullmatch(form, streamed["id"]), (call.id, streamed)


def test_a_long_call_is_parsed_again_only_when_it_may_have_closed(monkeypatch):
    """Every token of a streamed call parsed the whole text so far: a 40 KB
    call's arguments took seconds of the event loop."""
    arguments = json.dumps({"city": "x" * 4000})
    text = f'<tool_call>{{"name": "get_weather", "arguments": {arguments}}}</tool_call>'
    parser = PARSERS["hermes"](FUNCTIONS)
    parses = []
    parse = parser.parse
    monkeypatch.setattr(parser, "parse", lambda *args, **kwargs: parses.append(1) or parse(*args, **kwargs))
    stream = ToolCallStream(ToolChoice("auto", FUNCTIONS), parser)
    calls = [call for i in range(0, len(text), 3) for call in stream.feed(text[i:i + 3]).calls]
    assert [(call["function"]["name"], call["function"]["arguments"]) for call in calls] == [
        ("get_weather", arguments)]
    assert len(parses) < 10  # up to the marker, and the closing tag's pieces (was one per piece: 1,347)


def tool(name: str, parameters: dict):
    return SimpleNamespace(function=SimpleNamespace(name=name, parameters=parameters))


def required_accepts(tools: list, text: str) -> bool:
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    from heron.entrypoints.openai.tools.choice import tool_choice_of

    constraint = tool_choice_of(tools, "required", None).constraint()
    return _is_grammar_accept_string(xgrammar.Grammar.from_json_schema(constraint.key()[1]), text)


def test_required_resolves_each_functions_references_in_its_own_schema():
    """Under "required" the parameters nest in the list of calls: pydantic's
    "#/$defs/..." did not resolve there (every such request a 400), nor draft-07's
    "#/definitions/..." or zod's "#/properties/...", and a root recursion "#"
    pointed at the list. Each function's schema now has a root of its own."""
    from heron.entrypoints.openai.tools.choice import tool_choice_of

    unit = {"$defs": {"Unit": {"enum": ["C", "F"]}}, "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}}}
    kelvin = {**unit, "$defs": {"Unit": {"enum": ["K"]}}}  # the same name defined another way: its own
    assert required_accepts([tool("weather", unit), tool("other", kelvin)],
                            '[{"name": "weather", "parameters": {"city": "Oslo", "unit": "C"}}, '
                            '{"name": "other", "parameters": {"city": "Oslo", "unit": "K"}}]')
    assert not required_accepts([tool("weather", unit), tool("other", kelvin)],
                                '[{"name": "other", "parameters": {"city": "Oslo", "unit": "C"}}]')
    draft_07 = {"definitions": {"n": {"type": "integer"}}, "type": "object",
                "properties": {"x": {"$ref": "#/definitions/n"}, "y": {"$ref": "#/properties/x"}}}
    assert required_accepts([tool("f", draft_07)], '[{"name": "f", "parameters": {"x": 1, "y": 2}}]')
    assert not required_accepts([tool("f", draft_07)], '[{"name": "f", "parameters": {"y": "s"}}]')
    tree = {"type": "object", "properties": {"name": {"type": "string"},
                                             "child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}}
    nested = '{"name": "a", "child": {"name": "b", "child": null}}'
    assert required_accepts([tool("node", tree)], f'[{{"name": "node", "parameters": {nested}}}]')
    assert not required_accepts([tool("node", tree)], f'[{{"name": "node", "parameters": {{"name": "a", '
                                                      f'"child": [{{"name": "node", "parameters": {nested}}}]}}}}]')
    # parameters must describe an object (OpenAI's rule): "required" gave no call at all for a string schema
    with pytest.raises(InvalidRequestError) as info:
        tool_choice_of([tool("get_weather", unit), tool("f", {"type": "string"})], "auto", None)
    assert info.value.param == "tools[1].function.parameters"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_a_constrained_tool_schema_the_grammar_cannot_enforce_is_refused_by_its_own_path(choice):
    """It was refused through the combined "required" schema, named by heron's
    wrapper path ("/$defs/tool_1/properties/n"), a path the client never wrote.
    "auto" does not constrain the output, so it takes such a schema."""
    from heron.entrypoints.openai.tools.choice import tool_choice_of

    number = {"type": "object", "properties": {"n": {"type": "number", "multipleOf": 3}}}
    tools = [tool("g", WEATHER), tool("f", number)]
    named = choice if isinstance(choice, str) else SimpleNamespace(function=SimpleNamespace(name="f"))
    with pytest.raises(InvalidRequestError) as info:
        tool_choice_of(tools, named, None)
    assert info.value.param == "tools[1].function.parameters"
    assert "'multipleOf' at /properties/n cannot be enforced" in str(info.value)
    assert "$defs" not in str(info.value)
    assert tool_choice_of(tools, "auto", None).mode == "auto"


def test_a_template_that_takes_tools_gets_past_arguments_as_objects():
    # templates write them with `| tojson`: the JSON text came out as a quoted string
    template = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}" \
               "{% endfor %}{% endfor %}{{ tools }}"
    turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Paris"}'}},
        {"id": "2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]}
    messages, _ = template_messages([turn], [{"type": "function"}], template)
    assert [call["function"]["arguments"] for call in messages[0]["tool_calls"]] == [{"city": "Paris"}, "not json"]
    assert turn["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the request is not changed


@pytest.mark.parametrize("mode, named", [("named", "get_weather"), ("required", None)])
def test_a_forced_call_is_generated_whole_whatever_the_stop_strings(mode, named):
    """stop=["\\n"] cut a named call at its first line, answered as a finished
    call whose arguments did not parse; the stop strings apply to content."""
    from heron.sampling_params import SamplingParams

    tools = ChatTools(ToolChoice(mode, FUNCTIONS, named), PARSERS["hermes"]())
    params = tools.constrain(SamplingParams(stop=["\n", "}"], stop_token_ids=[7], max_tokens=9))
    assert params.stop == [] and params.structured_outputs is not None
    assert params.stop_token_ids == [7] and params.max_tokens == 9  # the rest as asked
    auto = ChatTools(ToolChoice("auto", FUNCTIONS), PARSERS["hermes"]())
    assert auto.constrain(SamplingParams(stop=["\n"])).stop == ["\n"]
