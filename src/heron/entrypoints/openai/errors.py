"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


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

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", "invalid_request_error", "model", "model_not_found")


def unauthorized() -> APIError:
    return APIError(
        401, "Incorrect or missing API key: pass it as 'Authorization: Bearer <key>'.",
        "authentication_error", None, "invalid_api_key",
    )


def too_many_requests(message: str, retry_after_s: float, code: str) -> APIError:
    retry = max(1, int(retry_after_s + 0.999))
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
