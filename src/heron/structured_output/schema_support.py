"""The JSON-schema keywords xgrammar compiles without enforcing them.

A schema keyword the grammar leaves out is a promise the output may break:
``uniqueItems`` gave ``[1, 2, 2]``, an ``allOf`` of a type and a bound gave
``{"n": 0}`` for ``minimum: 5``. OpenAI's strict structured outputs refuse a
schema they cannot guarantee, and so does heron: a request whose schema uses
one of these is a 400 naming the keyword and where it is, before any work.

Found by compiling a schema with each keyword (xgrammar 0.2.8) and offering the
grammar an instance that breaks it: these were accepted. ``oneOf`` is taken as
``anyOf`` (an instance matching two branches passes), which disjoint branches,
as generated unions have, do not notice; ``format`` is an annotation in JSON
Schema, and unknown formats stay allowed.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator
from typing import Any

_IGNORED = ("uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else",
            "dependentRequired", "dependentSchemas", "dependencies")
# keywords whose value is a schema, a list of schemas, or a map of names to schemas
_SCHEMA = ("items", "additionalProperties", "contains", "not", "if", "then", "else", "propertyNames",
           "additionalItems", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# the string formats xgrammar writes out (their grammar then takes no length bounds)
_FORMATS = {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
            "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}
# what may stand beside a $ref (xgrammar drops anything else there)
_REF_SIBLINGS = {"$ref", "$defs", "definitions", "$schema", "$id", "$comment", "title", "description", "default",
                 "examples", "deprecated", "readOnly", "writeOnly"}


# what may stand beside anyOf / oneOf / allOf: xgrammar compiles the combinator alone and drops the rest (an
# anyOf of two "required" lists beside "properties" gave an object with neither key); "type" too where every
# branch names its own kind (a branch of bounds alone, {"minimum": 5}, took any value)
_COMBINATOR_SIBLINGS = _REF_SIBLINGS | {"anyOf", "oneOf", "allOf", "discriminator", "type"}
_BRANCH_KINDS = ("type", "$ref", "enum", "const")


class UnenforcedSchema(ValueError):
    """A schema keyword the grammar cannot enforce."""


def check_schema_support(schema: Any) -> None:
    """UnenforcedSchema naming the first keyword xgrammar would not enforce."""
    found = next(unenforced_keywords(schema), None)
    if found is not None:
        path, keyword = found
        raise UnenforcedSchema(f"the JSON schema's {keyword!r} at {path or '/'} cannot be enforced by heron's "
                               "grammar engine (xgrammar): the output could break it; remove it and check that "
                               "part of the output yourself")


def unenforced_keywords(schema: Any) -> Iterator[tuple[str, str]]:
    """(path, keyword) of each keyword that would be compiled but not enforced."""
    for path, node in _subschemas(schema):
        yield from _unenforced_in(node, path)


def grammar_schema(schema: Any) -> Any:
    """The schema as the grammar is compiled from it: a known ``format`` beside a
    ``pattern`` is left out, so the pattern holds (xgrammar wrote the format's
    grammar alone: "8002-03-04" for date and ^1999-). JSON Schema makes a
    format an annotation, and zod writes its own pattern beside each format it
    names (``z.email()``, ``z.uuid()``, ``z.iso.date()``)."""
    if not any("pattern" in node and node.get("format") in _FORMATS for _, node in _subschemas(schema)):
        return schema
    schema = copy.deepcopy(schema)
    for _, node in _subschemas(schema):
        if "pattern" in node and node.get("format") in _FORMATS:
            del node["format"]
    return schema


def _subschemas(schema: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(path, schema) of the schema and of every schema within it, by the
    keywords that hold schemas (a property named "pattern" is no keyword)."""
    if not isinstance(schema, dict):
        return
    yield path, schema
    for keyword in _SCHEMA + _SCHEMA_LISTS:  # ("items" may also be a list: draft-04 tuples)
        members = schema.get(keyword)
        if isinstance(members, list):
            for index, member in enumerate(members):
                yield from _subschemas(member, f"{path}/{keyword}/{index}")
        else:
            yield from _subschemas(members, f"{path}/{keyword}")
    for keyword in _SCHEMA_MAPS:
        members = schema.get(keyword)
        if isinstance(members, dict):
            for name, member in members.items():
                yield from _subschemas(member, f"{path}/{keyword}/{name}")


def _unenforced_in(schema: dict[str, Any], path: str) -> Iterator[tuple[str, str]]:
    """The keywords of this one schema (not those within it) left unenforced."""
    for keyword in _IGNORED:
        if keyword in schema:
            yield path, keyword
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        yield path, "allOf"
    yield from _dropped_beside_combinators(schema, path)
    if schema.get("type") == "number" and "multipleOf" in schema:
        yield path, "multipleOf"  # enforced on integers only
    missing = _required_not_allowed(schema)
    if missing:
        yield path, "required"
    generative = "pattern" in schema or schema.get("format") in _FORMATS
    if generative and ("minLength" in schema or "maxLength" in schema):
        yield path, "minLength" if "minLength" in schema else "maxLength"  # beside a pattern or format
    broken = _bound_beside_fixed_values(schema)
    if broken is not None:
        yield path, broken
    if "$ref" in schema:
        extra = sorted(set(schema) - _REF_SIBLINGS)
        if extra:
            yield path, extra[0]  # beside a $ref


def _bound_beside_fixed_values(schema: dict[str, Any]) -> str | None:
    """A keyword beside ``enum`` / ``const`` that one of the listed values
    breaks: the grammar writes the values as listed (1 for enum [1, 2, 3] and
    minimum 3). Annotations (``example``, ``x-...``) and bounds every value
    meets are no matter."""
    if "enum" in schema:
        values = schema["enum"] if isinstance(schema["enum"], list) else []
    elif "const" in schema:
        values = [schema["const"]]
    else:
        return None
    for keyword in sorted(schema):
        bound = schema[keyword]
        check = _VALUE_CHECKS.get(keyword)
        if check is not None:
            try:
                if not all(check(value, bound) for value in values):
                    return keyword
            except (TypeError, ValueError, ZeroDivisionError, re.error):
                return keyword  # a bound that cannot be read: it cannot be promised either
        elif keyword in _STRUCTURE_KEYWORDS and any(isinstance(value, (dict, list)) for value in values):
            return keyword
    return None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _multiple(value: float, of: float) -> bool:
    quotient = value / of
    return abs(quotient - round(quotient)) < 1e-9


# how a listed value meets a bound beside enum / const (a bound of another kind of value does not apply to it)
_VALUE_CHECKS: dict[str, Callable[[Any, Any], bool]] = {
    "minimum": lambda value, bound: not _number(value) or value >= bound,
    "maximum": lambda value, bound: not _number(value) or value <= bound,
    "exclusiveMinimum": lambda value, bound: not _number(value) or value > bound,
    "exclusiveMaximum": lambda value, bound: not _number(value) or value < bound,
    "multipleOf": lambda value, bound: not _number(value) or _multiple(value, bound),
    "minLength": lambda value, bound: not isinstance(value, str) or len(value) >= bound,
    "maxLength": lambda value, bound: not isinstance(value, str) or len(value) <= bound,
    "pattern": lambda value, bound: not isinstance(value, str) or re.search(bound, value) is not None,
}
# bounds on arrays and objects beside enum / const: refused where a listed value is an array or an object
_STRUCTURE_KEYWORDS = {"items", "prefixItems", "minItems", "maxItems", "properties", "patternProperties",
                       "additionalProperties", "required", "minProperties", "maxProperties", "propertyNames"}


def _dropped_beside_combinators(schema: dict[str, Any], path: str) -> Iterator[tuple[str, str]]:
    for combinator in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(combinator)
        if isinstance(branches, list):
            extra = sorted(set(schema) - _COMBINATOR_SIBLINGS)
            if extra:
                yield path, extra[0]
            elif "type" in schema and not all(
                    isinstance(branch, dict) and any(kind in branch for kind in _BRANCH_KINDS) for branch in branches):
                yield path, "type"
            return


def _required_not_allowed(schema: dict[str, Any]) -> list[str]:
    """The ``required`` keys not among an object's ``properties``: xgrammar
    requires only named properties; it gave ``{}`` for a required key it did
    not know, also where ``additionalProperties`` or ``patternProperties``
    would have allowed it."""
    required = schema.get("required")
    if not isinstance(required, list):
        return []
    properties = schema.get("properties")
    named: dict[str, Any] = properties if isinstance(properties, dict) else {}
    return [key for key in required if isinstance(key, str) and key not in named]
