"""The OpenAPI schema heron publishes states the constraints it enforces (issue
#20, item 4), and a body outside them is a 400 in OpenAI's shape naming the
field: the routes' request models, without an engine behind them."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from heron.entrypoints.openai.limits import (
    MAX_INT,
    MAX_N,
    MAX_PROMPTS_PER_REQUEST,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    MIN_INT,
)
from heron.entrypoints.openai.routes import install_error_handlers, install_openapi, router


@pytest.fixture(scope="module")
def app() -> FastAPI:
    app = FastAPI()
    app.state.serving = None  # no engine: only requests that fail validation are sent
    install_error_handlers(app)
    app.include_router(router)
    install_openapi(app)
    return app


@pytest.fixture(scope="module")
def schemas(app):
    return app.openapi()["components"]["schemas"]


def member(prop: dict, kind: str) -> dict:
    """The member of a property's ``anyOf`` of JSON type ``kind`` (or the property itself)."""
    if "anyOf" not in prop:
        return prop
    [found] = [m for m in prop["anyOf"] if m.get("type") == kind]
    return found


def test_sampling_fields_state_their_ranges(schemas):
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[request]["properties"]
        n = member(props["n"], "integer")
        assert (n["minimum"], n["maximum"]) == (1, MAX_N)
        temperature = member(props["temperature"], "number")
        assert (temperature["minimum"], temperature["maximum"]) == (0, 1e6)
        top_p = member(props["top_p"], "number")
        assert (top_p["exclusiveMinimum"], top_p["maximum"]) == (0, 1)
        top_k = member(props["top_k"], "integer")
        assert (top_k["minimum"], top_k["maximum"]) == (-1, MAX_INT)
        for field in ("seed", "priority"):
            integer = member(props[field], "integer")
            assert (integer["minimum"], integer["maximum"]) == (MIN_INT, MAX_INT), field
            assert int(integer["maximum"]) == MAX_INT  # exact, though FastAPI writes it as a float
        assert (member(props["min_p"], "number")["minimum"], member(props["min_p"], "number")["maximum"]) == (0, 1)
        for penalty in ("presence_penalty", "frequency_penalty"):
            number = member(props[penalty], "number")
            assert (number["minimum"], number["maximum"]) == (-2, 2)
        repetition = member(props["repetition_penalty"], "number")
        assert (repetition["minimum"], repetition["maximum"]) == (1e-6, 1e6)
        assert member(props["min_tokens"], "integer")["minimum"] == 0
        assert member(props["prompt_logprobs"], "integer")["maximum"] == MAX_TOP_LOGPROBS
        bias = member(props["logit_bias"], "object")["additionalProperties"]
        assert (bias["minimum"], bias["maximum"]) == (-100, 100)
        stop = props["stop"]["anyOf"]
        [single] = [m for m in stop if m.get("type") == "string"]
        [several] = [m for m in stop if m.get("type") == "array"]
        assert (single["minLength"], single["maxLength"]) == (1, MAX_STOP_STRING_CHARS)
        assert several["maxItems"] == MAX_STOP_STRINGS and several["items"] == single
        assert member(props["stop_token_ids"], "array")["items"]["minimum"] == 0


def test_completion_and_chat_fields(schemas):
    completion = schemas["CompletionRequest"]
    assert completion["required"] == ["prompt"]
    batches = [m for m in completion["properties"]["prompt"]["anyOf"] if m.get("type") == "array"]
    assert len(batches) == 3 and all(m["minItems"] == 1 for m in batches)
    # a list of texts or of token-id lists is a batch; one token-id list is one prompt
    assert sorted(m.get("maxItems", 0) for m in batches) == [0, MAX_PROMPTS_PER_REQUEST, MAX_PROMPTS_PER_REQUEST]
    props = completion["properties"]
    assert (member(props["logprobs"], "integer")["minimum"], member(props["logprobs"], "integer")["maximum"]) == (
        0, MAX_TOP_LOGPROBS)
    assert member(props["max_tokens"], "integer")["minimum"] == 0  # 0 with echo: the prompt scored
    chat = schemas["ChatCompletionRequest"]
    assert chat["required"] == ["messages"] and chat["properties"]["messages"]["minItems"] == 1
    assert member(chat["properties"]["top_logprobs"], "integer")["maximum"] == MAX_TOP_LOGPROBS
    for field in ("max_tokens", "max_completion_tokens"):
        assert member(chat["properties"][field], "integer")["minimum"] == 1
    assert set(schemas["ChatMessage"]["properties"]["role"]["enum"]) == {
        "system", "developer", "user", "assistant", "tool"}
    assert schemas["ChatMessage"]["required"] == ["role"]
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["minimum"] == 0


def test_invalid_bodies_are_documented_as_400_in_openai_shape(app, schemas):
    paths = app.openapi()["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        responses = paths[path]["post"]["responses"]
        assert "422" not in responses
        schema = responses["400"]["content"]["application/json"]["schema"]
        assert schema == {"$ref": "#/components/schemas/ErrorResponse"}
    assert set(schemas["ErrorBody"]["properties"]) == {"message", "type", "param", "code"}
    assert "HTTPValidationError" not in schemas


@pytest.mark.parametrize("body, param, fragment", [
    ({"n": MAX_N + 1}, "n", f"less than or equal to {MAX_N}"),
    ({"prompt": ["x"] * (MAX_PROMPTS_PER_REQUEST + 1)}, "prompt", f"at most {MAX_PROMPTS_PER_REQUEST} items"),
    ({"prompt": [[1]] * (MAX_PROMPTS_PER_REQUEST + 1)}, "prompt", f"at most {MAX_PROMPTS_PER_REQUEST} items"),
    ({"prompt": []}, "prompt", "at least 1 item"),
    ({"prompt": [-1]}, "prompt", "greater than or equal to 0"),
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop", f"at most {MAX_STOP_STRINGS} items"),
    ({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop", f"at most {MAX_STOP_STRING_CHARS} characters"),
    ({"stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop", f"at most {MAX_STOP_STRING_CHARS} characters"),
    ({"logprobs": MAX_TOP_LOGPROBS + 1}, "logprobs", f"less than or equal to {MAX_TOP_LOGPROBS}"),
    ({"max_tokens": -1}, "max_tokens", "greater than or equal to 0"),  # 0: the prompt scored (with echo)
    ({"temperature": "hot"}, "temperature", "valid number"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "less than or equal to 100"),
])
def test_a_completion_past_a_limit_is_a_400_naming_the_field(app, body, param, fragment):
    response = TestClient(app).post("/v1/completions", json={"prompt": "hi", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    assert error["type"] == "invalid_request_error" and set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body, param, fragment", [
    ({"top_logprobs": MAX_TOP_LOGPROBS + 1, "logprobs": True}, "top_logprobs", f"{MAX_TOP_LOGPROBS}"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages", "'user'"),
    ({"messages": []}, "messages", "at least 1 item"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "greater than or equal to 1"),
])
def test_a_chat_past_a_limit_is_a_400_naming_the_field(app, body, param, fragment):
    response = TestClient(app).post("/v1/chat/completions",
                                    json={"messages": [{"role": "user", "content": "hi"}], **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


@pytest.mark.parametrize("field, value", [("temperature", "NaN"), ("temperature", "Infinity"),
                                          ("repetition_penalty", "Infinity"), ("top_k", str(2**63)),
                                          ("seed", str(2**64)), ("priority", str(-(2**63) - 1)),
                                          ("seed", str(MAX_INT + 1)),
                                          # float32 overflows in the sampler: a NaN row, token 0 every step
                                          ("temperature", "1e39"), ("repetition_penalty", "1e-40")])
def test_numbers_the_engine_cannot_carry_are_400s(app, field, value):
    """Python's JSON parser reads NaN, Infinity and integers of any size; the
    engine would get them (a top_k of 2**63 stopped the engine core)."""
    body = f'{{"prompt": "hi", "{field}": {value}}}'.encode()
    response = TestClient(app).post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_malformed_json_and_a_missing_body_are_400s(app):
    client = TestClient(app)
    response = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    response = client.post("/v1/completions")
    assert response.status_code == 400 and response.json()["error"]["param"] is None


def test_tokenize_reports_the_error_of_the_body_shape_meant(app):
    """/tokenize takes a prompt or a conversation: a bad role is reported as
    such, not as a missing prompt."""
    response = TestClient(app).post("/tokenize", json={"messages": [{"role": "wizard", "content": "hi"}]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages" and "messages.0.role" in error["message"], error


@pytest.mark.parametrize("messages, path", [
    ([{"role": "user", "content": ["a string, not a part"]}], "messages.0.content"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {"a": 1}}}]}],
     "messages.0.tool_calls.0.function.arguments"),
])
def test_tokenize_reports_a_bad_conversation_as_such(app, messages, path):
    """A conversation whose parts were the wrong type was reported as "prompt:
    Field required": each member of the union was tried, and the prompt's error won."""
    response = TestClient(app).post("/tokenize", json={"messages": messages})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "messages" and path in error["message"], error
    # a null conversation is none (null means the default): a prompt beside it is what is tokenized
    response = TestClient(app).post("/tokenize", json={"prompt": 5, "messages": None})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
def test_chat_template_kwargs_must_be_an_object(app, path):
    """/tokenize had no chat_template_kwargs field, and a string there was a 500."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": "x"}
    response = TestClient(app).post(path, json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template_kwargs"
