"""Structured output on the embedded model: every finished output parses and
validates against its constraint, across prompts and seeds, offline and through
the server (response_format and structured_outputs), and bad constraints get a
clear 400 before any work."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from heron import LLM, SamplingParams
from heron.engine.input_processor import InvalidRequestError
from heron.sampling_params import StructuredOutputsParams

MODEL = "SmolLM2-135M-Instruct"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "employed"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a person as JSON.",
    "Invent a character for a novel and give their details as JSON:",
    "A customer record:",
    "Here is a JSON object describing a famous scientist:",
    "The user profile is",
    "Output JSON only.",
]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512)


def test_every_output_validates_across_prompts_and_seeds(llm):
    params = [
        SamplingParams(max_tokens=160, temperature=1.0, top_p=0.95, seed=seed,
                       structured_outputs=StructuredOutputsParams(json=PERSON))
        for seed in range(4)
    ]
    prompts = [prompt for prompt in PROMPTS for _ in params]
    outputs = llm.generate(prompts, params * len(PROMPTS), use_tqdm=False)
    finished = [o.outputs[0] for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert len(finished) >= 0.9 * len(outputs)  # the rest ran out of max_tokens
    for completion in finished:
        jsonschema.validate(json.loads(completion.text), PERSON)
    texts = {completion.text for completion in finished}
    assert len(texts) > len(PROMPTS)  # sampling still varies inside the constraint
    scheduler = llm.engine.engine_core.scheduler
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks
    assert not llm.engine.engine_core.structured_output.matchers  # forgotten when finished


def test_regex_choice_grammar_and_any_json(llm):
    constraints = [
        {"regex": r"\d{3}-\d{4}"},
        {"choice": ["positive", "negative", "neutral"]},
        {"grammar": 'root ::= "The answer is " ("yes" | "no") "."'},
        {"json_object": True},
    ]
    params = [SamplingParams(max_tokens=80, temperature=0.7, seed=3, structured_outputs=c) for c in constraints]
    phone, sentiment, answer, anything = [
        o.outputs[0] for o in llm.generate(["Give me a value:"] * 4, params, use_tqdm=False)
    ]
    assert re.fullmatch(r"\d{3}-\d{4}", phone.text) and phone.finish_reason == "stop"
    assert sentiment.text in {"positive", "negative", "neutral"}
    assert answer.text in {"The answer is yes.", "The answer is no."}
    if anything.finish_reason == "stop":
        assert isinstance(json.loads(anything.text), dict)
    else:  # cut by max_tokens: still an object being written
        assert anything.text.lstrip().startswith("{")


def test_a_grammar_ends_its_output_before_min_tokens(llm):
    # min_tokens bans EOS, and a complete choice allows nothing but EOS: the grammar wins (this used to leave
    # no token to sample and end the request with "abort")
    params = [SamplingParams(max_tokens=8, temperature=0, min_tokens=4, structured_outputs={"choice": ["yes", "no"]}),
              SamplingParams(max_tokens=8, temperature=0, min_tokens=4, ignore_eos=False)]
    choice, plain = [o.outputs[0] for o in llm.generate(["Is the sky blue?"] * 2, params, use_tqdm=False)]
    assert choice.text in {"yes", "no"} and choice.finish_reason == "stop"
    assert len(plain.token_ids) >= 4  # min_tokens still holds where no grammar is


def test_greedy_structured_output_is_deterministic_mixed_with_plain_requests(llm):
    structured = SamplingParams(max_tokens=60, temperature=0, structured_outputs={"json": PERSON})
    alone = llm.generate(["A customer record:"], structured, use_tqdm=False)[0].outputs[0].text
    mixed = llm.generate(
        ["Tell me a story.", "A customer record:", "Count to ten."],
        [SamplingParams(max_tokens=40, temperature=0), structured, SamplingParams(max_tokens=40, temperature=0)],
        use_tqdm=False,
    )
    assert mixed[1].outputs[0].text == alone
    assert not mixed[0].outputs[0].text.startswith("{")  # the mask stays on its own row


def test_bad_constraint_fails_before_any_work(llm):
    with pytest.raises(InvalidRequestError, match="regex") as info:
        llm.generate(["x"], SamplingParams(structured_outputs={"regex": "(unclosed"}), use_tqdm=False)
    assert info.value.param == "structured_outputs"
    assert not llm.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_chat_response_format_json_schema(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        max_tokens=160,
        temperature=0.8,
        seed=11,
    )
    assert response.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(response.choices[0].message.content), PERSON)


def test_streamed_json_object_and_completions_structured_outputs(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A JSON object about Paris."}],
        response_format={"type": "json_object"}, max_tokens=120, temperature=0, stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    if chunks[-1].choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")
    completion = client.completions.create(
        model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert completion.choices[0].text in {"yes", "no"}
    # a plain-text response_format (some clients always send one) goes with structured_outputs: it was a 400
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=8,
        response_format={"type": "text"}, extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert chat.choices[0].message.content in {"yes", "no"}


def test_a_constraint_that_fails_to_compile_ends_its_stream_with_the_reason(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True,
            "structured_outputs": {"grammar": "root ::= root"}}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=30) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]" and "could not be compiled" in json.loads(lines[-2])["error"]["message"]


@pytest.mark.parametrize(
    "endpoint, body, param, fragment",
    [
        ("completions", {"structured_outputs": {"regex": "(oops"}}, "structured_outputs", "regex"),
        ("completions", {"structured_outputs": {"json": "{bad"}}, "structured_outputs", "not valid JSON"),
        ("completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        # an empty schema or pattern counts as given on both sides: the API server passed these (empty looked
        # unset there) and the engine core, counting two, stopped for everyone
        ("chat/completions", {"structured_outputs": {"json": {}, "choice": ["a", "b"]}}, "structured_outputs",
         "got json, choice"),
        ("completions", {"structured_outputs": {"regex": "", "json_object": True}}, "structured_outputs",
         "got regex, json_object"),
        # well-formed, but no output satisfies it: the compile against the vocabulary fails after admission,
        # which answered 200 with empty text and finish_reason "abort", the reason only in the server's log
        ("chat/completions", {"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs",
         "could not be compiled"),
        ("completions", {"structured_outputs": {"colour": "red"}}, "structured_outputs", "colour"),
        # the request's own token restrictions leave none the grammar allows: a 500 "engine error" before
        ("completions", {"structured_outputs": {"choice": ["yes", "no"]}, "allowed_token_ids": [100, 200]},
         "structured_outputs", "allowed_token_ids or bad_words"),
        ("completions", {"structured_outputs": {"choice": ["a"]}, "bad_words": ["a"]}, "structured_outputs",
         "allowed_token_ids or bad_words"),
        ("chat/completions", {"response_format": {"type": "yaml"}}, "response_format", "yaml"),
        ("chat/completions", {"response_format": {"schema": {}}}, "response_format", "type"),
        ("chat/completions", {"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format", "schema"),
        ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}},
         "response_format", "json"),
        # xgrammar's parse of this 60-byte schema took 53 s and its compile 44 s more, on threads nothing can
        # stop: patterns are bounded by their written-out size before xgrammar sees them
        ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "pattern": "[a-z]{1,12000}"}}}}, "response_format",
         "patterns expand to 12000 characters"),
        ("completions", {"structured_outputs": {"json": {"type": "object", "patternProperties": {
            "^(ab|cd){1,5000}$": {"type": "string"}}}}}, "structured_outputs", "patterns expand"),
    ],
)
def test_bad_constraints_get_400(server, endpoint, body, param, fragment):
    payload = {"model": MODEL, "max_tokens": 4, **body}
    payload.update({"prompt": "hi"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "hi"}]})
    response = httpx.post(f"{server.base_url}/v1/{endpoint}", json=payload, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_a_complete_choice_whose_end_is_not_allowed_stops_there(llm):
    """allowed_token_ids naming the choices' tokens but not the end: the answer
    was complete, and was thrown away as an error."""
    tokenizer = llm.get_tokenizer()
    allowed = [*tokenizer.encode("yes", add_special_tokens=False), *tokenizer.encode("no", add_special_tokens=False)]
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"choice": ["yes", "no"]},
                            allowed_token_ids=allowed)
    [output] = llm.generate(["Is the sky blue? Answer yes or no:"], params, use_tqdm=False)
    assert output.outputs[0].text in {"yes", "no"} and output.outputs[0].finish_reason == "stop"
