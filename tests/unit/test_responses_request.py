"""What a Responses request body may say (protocol_responses.py) and what heron
refuses to pretend it serves (serving_responses.refuse_unserved); nulls for
fields with defaults in every request body (protocol.OpenAIModel)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from heron.entrypoints.openai.errors import APIError
from heron.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from heron.entrypoints.openai.protocol_responses import ResponsesRequest
from heron.entrypoints.openai.serving_responses import listed_input_items, refuse_unserved
from tests.unit.test_openapi_schema import app  # noqa: F401  (the routes, no engine behind them)


def test_a_null_for_a_field_with_a_default_means_the_default():
    """OpenAI's spec types stream, n, store... as ``boolean | null``: store=None
    from a wrapper was a 400 "Input should be a valid boolean"."""
    chat = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "stream": None, "n": None, "presence_penalty": None,
        "logprobs": None, "stream_options": {"include_usage": None}})
    assert (chat.stream, chat.n, chat.presence_penalty, chat.logprobs) == (False, 1, 0.0, False)
    assert chat.stream_options is not None and chat.stream_options.include_usage is False
    assert CompletionRequest.model_validate({"prompt": "hi", "echo": None, "ignore_eos": None}).echo is False
    responses = ResponsesRequest.model_validate({"input": "hi", "store": None, "stream": None})
    assert responses.store is True and responses.stream is False
    # a null of a field whose type has one keeps its meaning: completions' max_tokens (default 16) null is
    # "up to the context's end"
    assert CompletionRequest.model_validate({"prompt": "hi", "max_tokens": None}).max_tokens is None
    # an input item's null type is a message's default (the discriminator read it as no type at all)
    item = ResponsesRequest.model_validate({"input": [{"type": None, "role": "user", "content": "hi"}]}).input
    assert isinstance(item, list) and item[0].type == "message"


def test_the_published_schema_says_null_is_taken_where_it_means_the_default(app):  # noqa: F811
    """The schema typed stream, n, store... as non-null, so a client generated
    from it could not send the null heron takes (and OpenAI's spec allows)."""
    schemas = TestClient(app).get("/openapi.json").json()["components"]["schemas"]
    null = {"type": "null"}
    for model, field in (("ChatCompletionRequest", "stream"), ("ChatCompletionRequest", "n"),
                         ("CompletionRequest", "echo"), ("ResponsesRequest", "store"),
                         ("StreamOptions", "include_usage")):
        prop = schemas[model]["properties"][field]
        assert null in prop["anyOf"] and "default" in prop, (model, field, prop)
    # a field whose null has its own meaning is typed as before; a required field takes no null
    assert schemas["CompletionRequest"]["properties"]["max_tokens"]["anyOf"].count(null) == 1
    assert "anyOf" not in schemas["ChatCompletionRequest"]["properties"]["messages"]


@pytest.mark.parametrize("body, param, fragment", [
    # the item's own field is named (it read "input.1.type: Input should be 'message'")
    ({"input": [{"role": "user", "content": "x"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]},
     "input", "input.1.arguments"),
    ({"input": [{"role": "user", "content": None}]}, "input", "input.0.content"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", "input.0: an input item's type is"),
])
def test_an_input_item_error_names_the_items_field(app, body, param, fragment):  # noqa: F811
    response = TestClient(app).post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


@pytest.mark.parametrize("fields, param", [
    ({"background": True}, "background"),
    ({"conversation": "conv_123"}, "conversation"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"prompt": {"id": "pmpt_1", "variables": {"city": "Paris"}}}, "prompt"),
])
def test_what_heron_does_not_serve_is_refused_not_ignored(fields, param):
    """Each was answered 200 as if it had not been asked (background ran in the
    foreground, a conversation's history was dropped, logprobs came back empty)."""
    with pytest.raises(APIError) as refused:
        refuse_unserved(ResponsesRequest.model_validate({"input": "hi", **fields}))
    assert refused.value.status_code == 400 and refused.value.param == param


def test_a_stored_prompt_is_refused_without_a_log_line_saying_it_was_ignored(app, caplog):  # noqa: F811
    body = {"input": "hi", "prompt": {"id": "pmpt_1"}}
    with caplog.at_level("WARNING"):
        response = TestClient(app).post("/v1/responses", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
    assert "ignoring unknown request fields" not in caplog.text


def test_what_costs_nothing_to_honour_is_accepted():
    refuse_unserved(ResponsesRequest.model_validate({
        "input": "hi", "background": False, "include": ["reasoning.encrypted_content"], "truncation": "auto",
        "top_logprobs": 0, "reasoning": {"effort": "low", "summary": "auto"}}))  # (Codex sends reasoning)


def test_listed_items_keep_their_own_ids_once():
    """An id given twice paged for ever: ``after`` found its first copy."""
    request = ResponsesRequest.model_validate({"input": [
        {"type": "message", "id": "msg_given", "role": "user", "content": "hi"},
        {"type": "function_call_output", "id": "fco_given", "call_id": "c", "output": "42"},
        {"role": "user", "content": "no id"},
        {"type": "message", "id": "msg_given", "role": "user", "content": "again"}]})
    ids = [item["id"] for item in listed_input_items(request)]
    assert ids[:2] == ["msg_given", "fco_given"] and ids[2].startswith("msg_") and ids[3] != "msg_given"
    assert len(set(ids)) == 4


def test_the_chat_page_answers_head_as_the_router_does(app):  # noqa: F811
    """HEAD / was a 405 on heron serve (FastAPI's GET route) and a 200 on heron router."""
    client = TestClient(app)
    page = client.get("/")
    assert page.status_code == 200 and "<html" in page.text.lower()
    head = client.head("/")
    assert head.status_code == 200 and head.content == b""
