"""The Responses API through a live server with the official `openai`
client, on the embedded model (issue #21, item 2): text answers with
instructions, multi-turn through previous_response_id, the bounded store and
`store: false`, json_schema output, function tools and their results,
streamed events in order (and the SDK's own stream helper building the
final response from them), incomplete answers, and 400s naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import BadRequestError, NotFoundError

from heron.entrypoints.openai.responses_store import ResponseStore, StoredResponse

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}]


def test_a_text_answer_is_stored_continued_and_deleted(default_client):
    first = default_client.responses.create(model=MODEL, input="What is the capital of France?",
                                    instructions="Answer in one sentence.", max_output_tokens=40, temperature=0)
    assert first.status == "completed" and first.id.startswith("resp_") and "Paris" in first.output_text
    assert (first.usage.input_tokens > 0
            and first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens)
    [item] = first.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    # the follow-up sees the first turn: "And of Germany?" only makes sense after it
    second = default_client.responses.create(model=MODEL, input="And of Germany?", previous_response_id=first.id,
                                     max_output_tokens=40, temperature=0)
    assert "Berlin" in second.output_text and second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert default_client.responses.retrieve(first.id).output_text == first.output_text
    with pytest.raises(BadRequestError, match="not created in the background"):  # it was a bare 404 "Not Found"
        default_client.responses.cancel(first.id)
    default_client.responses.delete(first.id)
    with pytest.raises(NotFoundError):
        default_client.responses.retrieve(first.id)
    with pytest.raises(NotFoundError):
        default_client.responses.cancel(first.id)
    with pytest.raises(BadRequestError) as info:
        default_client.responses.create(model=MODEL, input="And Italy?", previous_response_id=first.id,
                                        max_output_tokens=4)
    assert info.value.body["param"] == "previous_response_id"


def test_a_responses_input_items_are_listed_as_openai_lists_them(default_client, default_server):
    """GET /v1/responses/{id}/input_items (the SDK's input_items.list) was a 404."""
    single = default_client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    [item] = default_client.responses.input_items.list(single.id).data
    assert item.type == "message" and item.role == "user" and item.id.startswith("msg_")
    assert [(part.type, part.text) for part in item.content] == [("input_text", "Hi")]
    turns = [{"role": "user", "content": "Say a"}, {"role": "assistant", "content": "a"},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}',
              "id": "fc_given"},
             {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "cold"}]}]
    answer = default_client.responses.create(model=MODEL, input=turns, tools=TOOLS, max_output_tokens=2)
    newest_first = default_client.responses.input_items.list(answer.id).data  # "desc", OpenAI's default
    assert [item.type for item in newest_first] == ["function_call_output", "function_call", "message", "message"]
    assert newest_first[1].id == "fc_given" and newest_first[2].content[0].type == "output_text"
    assert newest_first[0].output[0].text == "cold"
    url = f"{default_server.base_url}/v1/responses/{answer.id}/input_items"
    first = httpx.get(url, params={"order": "asc", "limit": 3}).json()
    assert [item["id"] for item in first["data"]] == [item.id for item in newest_first[::-1][:3]]
    assert first["has_more"] and first["first_id"] == first["data"][0]["id"]
    rest = httpx.get(url, params={"order": "asc", "after": first["last_id"]}).json()
    assert [item["type"] for item in rest["data"]] == ["function_call_output"] and not rest["has_more"]
    for params, param in [({"after": "msg_nope"}, "after"), ({"limit": 0}, "limit"), ({"order": "up"}, "order")]:
        bad = httpx.get(url, params=params)
        assert bad.status_code == 400 and param in json.dumps(bad.json()["error"]), bad.text
    assert httpx.get(f"{default_server.base_url}/v1/responses/resp_nope/input_items").status_code == 404


def test_a_function_outputs_text_parts_are_its_result():
    """OpenAI's newer form of a function's output (a list of text parts) got a
    400 saying "Input should be 'message'"."""
    from heron.entrypoints.openai.protocol_responses import ResponsesRequest
    from heron.entrypoints.openai.serving_responses import input_messages

    request = ResponsesRequest.model_validate({"input": [{"type": "function_call_output", "call_id": "c", "output": [
        {"type": "input_text", "text": "co"}, {"type": "input_text", "text": "ld"}]}]})
    assert input_messages(request) == [{"role": "tool", "tool_call_id": "c", "content": "cold"}]


def test_replayed_output_items_render_the_turn_a_stored_response_continues():
    """A client keeping its own history (store false) sends back an answer's
    message and its function call: one assistant turn, as previous_response_id
    continues it. The call made a second assistant turn of its own."""
    from heron.entrypoints.openai.protocol_responses import ResponsesRequest
    from heron.entrypoints.openai.serving_responses import input_messages, output_as_messages

    output = [{"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
               "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
              {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "get_weather",
               "arguments": '{"city": "Paris"}', "status": "completed"},
              {"type": "function_call", "id": "fc_2", "call_id": "c2", "name": "get_weather",
               "arguments": '{"city": "Rome"}', "status": "completed"}]
    request = ResponsesRequest.model_validate({"input": [{"role": "user", "content": "Weather?"}, *output]})
    assert input_messages(request) == [{"role": "user", "content": "Weather?"}, *output_as_messages(output)]


def test_store_false_keeps_nothing(default_client):
    answer = default_client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=4)
    with pytest.raises(NotFoundError):
        default_client.responses.retrieve(answer.id)


def test_json_schema_output(default_client):
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    answer = default_client.responses.create(model=MODEL, input="Describe a person as JSON.", max_output_tokens=80,
                                     temperature=0,
                                     text={"format": {"type": "json_schema", "name": "person", "schema": person}})
    jsonschema.validate(json.loads(answer.output_text), person)


def test_a_function_call_and_its_output_round_trip(default_client):
    answer = default_client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=TOOLS,
                                     tool_choice="required", parallel_tool_calls=False, max_output_tokens=60,
                                     temperature=0)
    [call] = answer.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    follow_up = default_client.responses.create(
        model=MODEL, previous_response_id=answer.id, tools=TOOLS, max_output_tokens=30, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}])
    assert follow_up.status in ("completed", "incomplete") and follow_up.output
    # the same conversation given whole, without the store
    whole = default_client.responses.create(
        model=MODEL, tools=TOOLS, max_output_tokens=30, temperature=0, store=False,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}])
    assert whole.output_text == follow_up.output_text
    # an output for a call nobody made (a typo in call_id) was shown to the model as a tool result
    for history in ({"previous_response_id": answer.id}, {}):
        with pytest.raises(BadRequestError, match="No tool call found for function call output with call_id") as info:
            default_client.responses.create(
                model=MODEL, tools=TOOLS, max_output_tokens=4, **history,
                input=[{"type": "function_call_output", "call_id": call.call_id + "x", "output": "18 degrees"}])
        assert info.value.body["param"] == "input"


def test_streamed_events_come_in_order_and_add_up(default_client):
    events = list(default_client.responses.create(model=MODEL, input="Name three colours.", max_output_tokens=200,
                                          temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas and deltas == final.output_text == events[-4].text
    assert final.status == "completed" and final.usage.output_tokens > 0


def test_the_sdk_stream_helper_builds_the_final_response(default_client):
    with default_client.responses.stream(model=MODEL, input="What is the weather in Paris?", tools=TOOLS,
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
                                 temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    [call] = final.output
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_a_cut_answer_is_incomplete(default_client, default_server):
    answer = default_client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=3)
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    assert answer.usage.output_tokens == 3
    # the item the limit cut is incomplete too (it said completed), in the body, the stream and the store
    assert answer.output[-1].status == "incomplete"
    assert default_client.responses.retrieve(answer.id).output[-1].status == "incomplete"
    body = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{default_server.base_url}/v1/responses", json=body, timeout=60) as stream:
        lines = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert "[DONE]" not in lines  # the Responses API ends at its last event: a JSON reader of every line choked
    events = [json.loads(line) for line in lines]
    [done] = [event for event in events if event["type"] == "response.output_item.done"]
    assert done["item"]["status"] == "incomplete" and events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["output"][-1]["status"] == "incomplete"
    assert all(event["logprobs"] == [] for event in events if event["type"].startswith("response.output_text."))


def test_calls_closed_before_the_limit_are_complete_under_required(default_server):
    """Under tool_choice "required" a call cut short is dropped, so the calls
    there are all whole: the response is incomplete, its items complete. The
    first call (closed at the 25th token, the second cut at the 30th) said
    incomplete, in the body and in the stream."""
    body = {"model": MODEL, "input": "What is the weather in Paris and in Rome?", "tools": TOOLS,
            "tool_choice": "required", "temperature": 0, "max_output_tokens": 30}
    whole = httpx.post(f"{default_server.base_url}/v1/responses", json={**body, "max_output_tokens": 100},
                       timeout=60).json()
    assert [json.loads(item["arguments"])["city"] for item in whole["output"]] == ["Paris", "Rome"], whole
    assert whole["usage"]["output_tokens"] > 40  # the second call ends well after the cut
    answer = httpx.post(f"{default_server.base_url}/v1/responses", json=body, timeout=60).json()
    assert answer["status"] == "incomplete" and answer["incomplete_details"]["reason"] == "max_output_tokens"
    [call] = answer["output"]
    assert json.loads(call["arguments"]) == {"city": "Paris"} and call["status"] == "completed"
    with httpx.stream("POST", f"{default_server.base_url}/v1/responses", json={**body, "stream": True},
                      timeout=60) as stream:
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: ")]
    [done] = [event for event in events if event["type"] == "response.output_item.done"]
    assert done["item"]["status"] == "completed" and events[-1]["type"] == "response.incomplete"


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name"}]}, "tools"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    # a schema xgrammar rejects, or whose pattern it would take minutes over, is the format's fault (it named
    # vLLM's "structured_outputs", a field this API does not have)
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "no-such-type"}}}},
     "text.format"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                         "schema": {"type": "string", "pattern": "[a-z]{1,12000}"}}}}, "text.format"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    # a tool's errors name this request's fields (they named the chat request's tools[0].function.parameters)
    ({"input": "hi", "tool_choice": "required", "tools": [{"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "number", "multipleOf": 3}}}}]}, "tools[0].parameters"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]},
     "tools[0].parameters"),
    ({"input": "hi", "metadata": {f"key{i}": "v" for i in range(17)}}, "metadata"),  # OpenAI's bounds: kept whole
    ({"input": "hi", "metadata": {"k": "v" * 513}}, "metadata"),
])
def test_bad_requests_are_400s_naming_the_field(default_server, body, param):
    response = httpx.post(f"{default_server.base_url}/v1/responses", json={"model": MODEL, **body}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text
    assert "function." not in response.json()["error"]["message"] and "response_format" not in response.text


def test_responses_and_their_events_are_what_the_sdk_types_require(default_server):
    """Strict validation against the SDK's own types: usage lacked
    input_tokens_details.cache_write_tokens, which they require (a typed
    consumer rejected every response; the lenient parse read None)."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    body = {"model": MODEL, "input": "Say hi.", "max_output_tokens": 8, "temperature": 0}
    answer = httpx.post(f"{default_server.base_url}/v1/responses", json=body, timeout=60).json()
    Response.model_validate(answer, strict=False)
    with httpx.stream("POST", f"{default_server.base_url}/v1/responses", json={**body, "stream": True},
                      timeout=60) as stream:
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: ")]
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event)
    assert events[-1]["response"]["usage"]["input_tokens_details"]["cache_write_tokens"] == 0


def test_text_format_beside_a_required_tool_is_named_as_this_api_names_it(default_server):
    body = {"model": MODEL, "input": "hi", "tools": TOOLS, "tool_choice": "required",
            "text": {"format": {"type": "json_object"}}}
    response = httpx.post(f"{default_server.base_url}/v1/responses", json=body, timeout=30)
    assert response.status_code == 400 and "text.format" in response.json()["error"]["message"], response.text


def test_the_store_is_bounded():
    store = ResponseStore(max_entries=2)
    for name in ("a", "b"):
        store.put(name, StoredResponse({"id": name}, []))
    assert store.get("a", None) is not None  # used: "b" is now the oldest
    store.put("c", StoredResponse({"id": "c"}, []))
    assert len(store) == 2 and store.get("b", None) is None and store.get("a", None) and store.get("c", None)
    with pytest.raises(ValueError):
        ResponseStore(max_entries=0)
