"""Output constraints are checked before admission: their patterns' written-out
size is bounded (xgrammar's parse time grows with its square), the check runs
off the event loop, and every error names the field the constraint came from."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest

from heron.engine.input_processor import InvalidRequestError
from heron.entrypoints.openai import serving_common
from heron.entrypoints.openai.errors import APIError
from heron.sampling_params import SamplingParams
from heron.structured_output import xgrammar_backend
from heron.structured_output.pattern_size import (
    MAX_PATTERN_EXPANSION,
    PatternTooLarge,
    check_schema_patterns,
    expanded_size,
    schema_patterns,
)


@pytest.mark.parametrize("pattern, size", [
    ("abc", 3),
    ("[a-z]{1,2000}", 2000),
    ("([a-z]{1,30}){1,30}", 900),  # nested bounds multiply
    ("[a-z]{1,1000}[0-9]{1,1000}", 2000),  # a sequence adds up
    ("(abc|def|ghi){1,1000}", 9000),  # so do the branches of an alternation
    (r"\d{4}-\d{2}-\d{2}", 10),
    ("(?:ab){3}", 6),
    ("[]a]{3}", 3),  # a leading ] is in the class
    (r"[\]]{4}", 4),
    ("^[A-Z][a-z]+$", 4),  # loops and anchors add nothing
    ("a{3}{4}", 12),
    ("a{x}", 4),  # a brace that is no bound is a literal
    ("((a", 1),  # unclosed: xgrammar reports it, the size is what was read
    ("x{1,99999999999999999999}", 10**12),
])
def test_expanded_size(pattern, size):
    assert expanded_size(pattern) == size


def test_patterns_are_found_at_any_depth_and_a_property_named_pattern_is_not_one():
    schema = {"type": "object", "properties": {
        "pattern": {"type": "string", "pattern": "x{3}"},
        "list": {"type": "array", "items": [{"pattern": "y+"}]}},
        "patternProperties": {"^a+$": {}}}
    assert sorted(schema_patterns(schema)) == ["^a+$", "x{3}", "y+"]


def test_the_bound_is_on_all_of_a_schemas_patterns_together():
    half = {"type": "string", "pattern": f"[a-z]{{{MAX_PATTERN_EXPANSION // 2}}}"}
    check_schema_patterns({"type": "array", "items": [half, half]})
    with pytest.raises(PatternTooLarge, match="expand to 2001 characters"):
        check_schema_patterns({"type": "array", "items": [half, half, {"pattern": "z"}]})


def test_a_pattern_past_the_bound_is_refused_before_xgrammar_parses_it():
    """Its parse took 53 s (and its compile 44 s more)."""
    xgrammar_backend.validate_constraint.cache_clear()
    spec = json.dumps({"type": "string", "pattern": "[a-z]{1,12000}"})
    with pytest.raises(ValueError, match="patterns expand to 12000 characters"):
        xgrammar_backend.validate_constraint("json", spec)
    # a regex constraint of its own is compiled without expansion: no bound
    xgrammar_backend.validate_constraint("regex", "[a-z]{1,12000}")


@pytest.mark.parametrize("schema, keyword, path", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", "/"),
    ({"type": "object", "properties": {"n": {"allOf": [{"type": "integer"}, {"minimum": 5}]}}}, "allOf",
     "/properties/n"),
    ({"type": "integer", "not": {"const": 3}}, "not", "/"),
    ({"type": "array", "items": [{"type": "object", "if": {}, "then": {}}]}, "if", "/items/0"),
    ({"$defs": {"s": {"type": "string", "pattern": "[a-z]+", "maxLength": 2}}, "$ref": "#/$defs/s"}, "maxLength",
     "/$defs/s"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/i", "minimum": 5}}, "$defs": {"i": {}}}, "minimum",
     "/properties/a"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired", "/"),
    # a required key the object's grammar could never write: it gave {}
    ({"type": "object", "required": ["city"]}, "required", "/"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}, "required", "/"),
    # beside a combinator, dropped: an object with neither "a" nor "b", and 0 for "at least 5 or at most -5"
    ({"properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, "properties", "/"),
    ({"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": -5}]}, "type", "/"),
    ({"type": "object", "properties": {"p": {"type": "number", "multipleOf": 0.7}}}, "multipleOf", "/properties/p"),
    # a required key not among the properties, though more keys are allowed: {"name": "Ben"} without "id"
    ({"properties": {"name": {"type": "string"}}, "required": ["name", "id"], "additionalProperties": True},
     "required", "/"),
    ({"type": "object", "patternProperties": {"^x_": {"type": "integer"}}, "required": ["id"]}, "required", "/"),
    # bounds beside fixed values that a value breaks: dropped (1 for enum [1, 2, 3] and minimum 3)
    ({"type": "integer", "enum": [1, 2, 3], "minimum": 3}, "minimum", "/"),
    ({"const": 5, "maximum": 3}, "maximum", "/"),
    ({"enum": ["ab", "abc"], "maxLength": 2}, "maxLength", "/"),
])
def test_keywords_the_grammar_would_not_enforce_are_refused(schema, keyword, path):
    """xgrammar compiles these and leaves them out: uniqueItems gave [1, 2, 2], an
    allOf of a type and a bound gave {"n": 0} under minimum 5."""
    xgrammar_backend.validate_constraint.cache_clear()
    with pytest.raises(ValueError, match=re.escape(f"'{keyword}' at {path} cannot be enforced")):
        xgrammar_backend.validate_constraint("json", json.dumps(schema))


def test_keywords_it_enforces_or_that_only_annotate_pass():
    schema = {"type": "object", "properties": {
        "not": {"type": "string", "format": "color", "minLength": 1},  # a property named "not"; a custom format
        "choice": {"oneOf": [{"type": "integer"}, {"type": "string"}]},
        "ref": {"$ref": "#/$defs/i", "description": "described"},
        "single": {"allOf": [{"type": "integer", "minimum": 1}]},
        "n": {"type": "integer", "multipleOf": 5},
        # pydantic's shapes: an optional field, a tagged union, a required key named in properties, open objects
        "optional": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "Optional"},
        "tagged": {"oneOf": [{"$ref": "#/$defs/i"}, {"type": "string"}], "discriminator": {"propertyName": "k"}},
        "typed": {"type": "object", "anyOf": [{"type": "object", "properties": {"x": {"type": "integer"}}}]},
        "open": {"type": "object", "properties": {"any": {}}, "required": ["any"], "additionalProperties": True},
        "fixed": {"type": "string", "enum": ["a", "b"], "description": "one of two"},
        # annotations, and bounds every listed value meets, beside enum / const (OpenAPI, pydantic extras)
        "sort": {"type": "string", "enum": ["asc", "desc"], "example": "asc", "nullable": True,
                 "x-enum-varnames": ["ASC", "DESC"], "maxLength": 5},
        "five": {"const": 5, "minimum": 1, "multipleOf": 5},
        "named": {"type": "object", "propertyNames": {"pattern": "^a"}}},
        "required": ["n"], "$defs": {"i": {"type": "integer"}}}
    xgrammar_backend.validate_constraint("json", json.dumps(schema))


def test_the_check_runs_off_the_event_loop_and_names_the_field(monkeypatch):
    def slow_parse(kind: str, spec: str) -> None:
        time.sleep(0.5)
        raise ValueError("invalid json constraint: no")

    monkeypatch.setattr(xgrammar_backend, "validate_constraint", slow_parse)
    params = SamplingParams(structured_outputs={"json": {"type": "object"}})

    async def main() -> tuple[int, APIError]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        with pytest.raises(APIError) as info:
            await serving_common.check_constraints([params], "text.format")
        ticker.cancel()
        return ticks, info.value

    ticks, error = asyncio.run(main())
    assert ticks >= 10  # the loop kept running while the parse slept
    assert error.body()["error"]["param"] == "text.format"


def test_a_compile_failure_after_admission_names_the_field():
    async def engine_stream():
        yield "first"
        raise InvalidRequestError("the output constraint could not be compiled: x", "structured_outputs")

    async def main(param: str) -> tuple[list[str], InvalidRequestError]:
        constrained = SamplingParams(structured_outputs={"regex": "a+"})
        [stream] = serving_common.name_constraint_errors([engine_stream()], [constrained], param)
        seen = []
        with pytest.raises(InvalidRequestError) as info:
            async for output in stream:
                seen.append(output)
        return seen, info.value

    seen, error = asyncio.run(main("tools"))
    assert seen == ["first"] and error.param == "tools" and "could not be compiled" in str(error)
    _, error = asyncio.run(main("structured_outputs"))
    assert error.param == "structured_outputs"


def test_string_length_bounds_have_a_compile_budget():
    """Each distinct maxLength costs seconds of compile against the vocabulary
    and they add up: two requests of 20 such fields held both compile threads,
    and every new structured request, for minutes."""
    many = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 7000 + i} for i in range(20)}}
    xgrammar_backend.validate_constraint.cache_clear()
    with pytest.raises(ValueError, match="20 distinct string length bounds"):
        xgrammar_backend.validate_constraint("json", json.dumps(many))
    shared = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 7000} for i in range(20)}}
    short = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 10 + i} for i in range(20)}}
    for schema in (shared, short):  # one bound shared by every field costs once; small bounds cost little
        xgrammar_backend.validate_constraint("json", json.dumps(schema))


def test_negative_length_bounds_cost_nothing_off_the_budget():
    """A pair like (-100000, -100000) in an unused $defs entry (never compiled,
    so never refused) took its value off the budget, and ten large bounds
    compiled for tens of seconds."""
    many = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 7000 + i} for i in range(20)},
            "$defs": {"unused": {"type": "string", "minLength": -100000, "maxLength": -100000}}}
    xgrammar_backend.validate_constraint.cache_clear()
    with pytest.raises(ValueError, match="distinct string length bounds"):
        xgrammar_backend.validate_constraint("json", json.dumps(many))


def test_a_pattern_beside_a_format_is_compiled_and_holds(embedded_tokenizer):
    """zod writes its own pattern beside each format it names; xgrammar wrote
    the format's grammar alone ("8002-03-04" for date and ^1999-)."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    day = {"type": "string", "format": "date", "pattern": "^1999-[0-9]{2}-[0-9]{2}$"}
    schema = {"type": "object", "properties": {"day": day}, "required": ["day"], "additionalProperties": False}
    spec = json.dumps(schema)
    xgrammar_backend.validate_constraint.cache_clear()
    xgrammar_backend.validate_constraint("json", spec)  # taken: the pattern is enforced
    grammar = xgr.Grammar.from_json_schema(xgrammar_backend._grammar_spec(spec), any_whitespace=False)
    assert _is_grammar_accept_string(grammar, '{"day": "1999-01-02"}')
    assert not _is_grammar_accept_string(grammar, '{"day": "8002-03-04"}')
    # a property named "format" beside one named "pattern" is no keyword
    named = {"type": "object", "properties": {"pattern": {"type": "string"}, "format": {"type": "string"}}}
    assert xgrammar_backend._grammar_spec(json.dumps(named)) == json.dumps(named)
