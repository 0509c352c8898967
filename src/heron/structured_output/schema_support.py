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

from collections.abc import Iterator
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
# what may stand beside enum / const: xgrammar writes one of the values as listed and drops any other bound
_FIXED_VALUE_SIBLINGS = _REF_SIBLINGS - {"$ref"} | {"enum", "const", "type"}


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


def unenforced_keywords(schema: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(path, keyword) of each keyword that would be compiled but not enforced."""
    if not isinstance(schema, dict):
        return
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
    if "pattern" in schema and schema.get("format") in _FORMATS:
        yield path, "pattern"  # the format's grammar stands alone: "8002-03-04" for date and ^1999-
    for fixed in ("enum", "const"):
        if fixed in schema:
            beside = sorted(set(schema) - _FIXED_VALUE_SIBLINGS)
            if beside:
                yield path, beside[0]  # the values are written as listed: 1 for enum [1, 2, 3] and minimum 3
            break
    if "$ref" in schema:
        extra = sorted(set(schema) - _REF_SIBLINGS)
        if extra:
            yield path, extra[0]  # beside a $ref
    for keyword in _SCHEMA + _SCHEMA_LISTS:  # ("items" may also be a list: draft-04 tuples)
        members = schema.get(keyword)
        if isinstance(members, list):
            for index, member in enumerate(members):
                yield from unenforced_keywords(member, f"{path}/{keyword}/{index}")
        else:
            yield from unenforced_keywords(members, f"{path}/{keyword}")
    for keyword in _SCHEMA_MAPS:
        members = schema.get(keyword)
        if isinstance(members, dict):
            for name, member in members.items():
                yield from unenforced_keywords(member, f"{path}/{keyword}/{name}")


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
