"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel


class APIError(Exception):
    """An error a client can act on; rendered as OpenAI's error object."""

    def __init__(
        self,
        status_code: int,
        message: str,
        error_type: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def response(self, close: bool = False) -> JSONResponse:
        """``close``: end the connection after it (a refusal sent before the
        request's body was read: else the server goes on reading and dropping
        the whole body the client declared, gigabytes if it says so)."""
        headers = {**(self.headers or {}), "Connection": "close"} if close else self.headers
        return JSONResponse(self.body(), status_code=self.status_code, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def invalid_body(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """A body that fails its request model, as a 400 whose ``param`` is the
    top-level field and whose message gives the path within it. Of several
    errors (pydantic reports one per member of a union, as ``prompt``'s or
    /tokenize's), a broken constraint (too long, out of range, not one of the
    allowed values) comes before a wrong type or a missing field: it is found in
    the member the client meant, and is the one to fix."""
    if not errors:
        return bad_request("invalid request body")
    first = min(errors, key=_is_shape_error)
    if first.get("type") == "json_invalid":
        return bad_request(f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "))
    path = [str(part) for part in first.get("loc", ())[1:] if not _is_union_member(part)]
    message = str(first.get("msg", "invalid value")) + _given(first)
    if not path:
        return bad_request(message)
    return bad_request(f"{'.'.join(path)}: {message}", path[0])


def _given(error: Mapping[str, Any]) -> str:
    """`` (got 'yaml')`` for a value outside an enum, so the client sees which
    of its values was refused; nothing for long values or other errors."""
    if error.get("type") not in ("literal_error", "enum"):
        return ""
    shown = repr(error.get("input"))
    return f" (got {shown})" if len(shown) <= 60 else ""


def _is_shape_error(error: Mapping[str, Any]) -> bool:
    kind = str(error.get("type", ""))
    return kind == "missing" or kind.endswith(("_type", "_parsing"))


def _is_union_member(part: Any) -> bool:
    """Whether a part of a pydantic error location names the member of a union
    that was tried (``str``, ``list[str]``, ``constrained-int``, a model's class
    name) rather than a field or an index."""
    return isinstance(part, str) and (
        "[" in part or "-" in part or part in ("str", "int", "float", "bool") or part[:1].isupper()
    )


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error object, as every error response carries it (the OpenAPI schema's)."""

    error: ErrorBody


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", "invalid_request_error", "model", "model_not_found")


def unauthorized() -> APIError:
    return APIError(
        401, "Incorrect or missing API key: pass it as 'Authorization: Bearer <key>'.",
        "authentication_error", None, "invalid_api_key",
    )


def body_too_large(max_bytes: int) -> APIError:
    return APIError(413, f"Request body larger than {max_bytes} bytes.", "invalid_request_error", None,
                    "body_too_large")


def headers_too_large(max_bytes: int) -> APIError:
    return APIError(431, f"Request headers larger than {max_bytes} bytes (names and values).",
                    "invalid_request_error", None, "headers_too_large")


def too_many_requests(message: str, retry_after_s: float, code: str) -> APIError:
    retry = max(1, math.ceil(retry_after_s))  # whole seconds, never short of the wait (2.0002 s is 3)
    return APIError(429, message, "rate_limit_error", None, code, headers={"Retry-After": str(retry)})


def unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, "service_unavailable_error", None, code, headers={"Retry-After": "1"})


def timed_out(seconds: float) -> APIError:
    return APIError(
        504,
        f"The request did not finish within {seconds:g} s and was aborted.",
        "timeout_error",
        None,
        "request_timeout",
    )
