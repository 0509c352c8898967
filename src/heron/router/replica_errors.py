"""A replica's answers read as JSON: the error object of an error answer, its
code, and any body as a JSON object where it is one."""

from __future__ import annotations

import json
from typing import Any

from heron.router.response_writer import error_body


def error_of(status: int, body: bytes) -> dict[str, Any]:
    """A replica's error answer as an error object to end a stream with (its own, if it is one)."""
    answered = json_object(body)
    if answered is not None and isinstance(answered.get("error"), dict):
        return answered
    return error_body(status, f"the replica answered {status} instead of a stream")


def error_code(body: bytes) -> object:
    """The ``error.code`` of an OpenAI-shaped error body (None if it has none)."""
    return code_in(json_object(body))


def code_in(answered: dict[str, Any] | None) -> object:
    """The ``error.code`` of an answer already read (None if it has none)."""
    error = answered.get("error") if answered is not None else None
    return error.get("code") if isinstance(error, dict) else None


# a replica's error codes that refuse a request as a whole (its engine core dead, the server stopping, the
# model still loading), where another replica may serve it
REFUSAL_CODES = frozenset({"engine_dead", "server_stopping", "model_loading"})


def refused_at_the_door(code: object) -> bool:
    """A refusal of a request that never began on that replica (the model still
    loading); another refusal may end one that had begun there (its KV pulled
    from a prefill replica, say)."""
    return code == "model_loading"


def json_object(raw: bytes) -> dict[str, Any] | None:
    """The body's JSON object; None when it is not one (or nested too deeply to
    parse): a request's body then goes to the replica as it is, which answers 400."""
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None
