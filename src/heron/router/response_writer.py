"""One HTTP/1.1 answer of the router's front door (``http_front.py``) to its
client: whole or streamed, chunked unless its length is known (bare to an
HTTP/1.0 client), with the connection's flow control, and ended with an
error however far it got (``fail``)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from http import HTTPStatus
from typing import Any


class ResponseWriter:
    """One response to the client: whole (``send``) or streamed (``start``,
    ``write``..., ``end``); streamed with chunked framing unless its length is
    given. What is written is held until ``flush`` or ``end``, so a relay sends
    what one read from its source brought in one system call (the status line
    goes out with the first body bytes, unless flushed before them). Flow
    control: while the client's socket buffer is full, ``on_pause`` is called
    (and ``on_resume`` when it drains) so a relay can stop reading its source
    instead of buffering without bound; ``client_paused`` says whether it is full
    now (it may be from the connection's earlier answers: a relay that starts
    while it is pauses its source at once)."""

    def __init__(self, transport: asyncio.Transport, keep_alive: bool, head_only: bool,
                 http10: bool = False, client_paused: bool = False) -> None:
        """``http10``: the client speaks HTTP/1.0, which has no chunked framing: a
        streamed answer of unknown length is sent bare and ends with the connection.
        ``client_paused``: the connection's state as the response starts."""
        self._transport = transport
        self.keep_alive = keep_alive
        self._head_only = head_only
        self._http10 = http10
        self._chunked = False
        self.started = False
        self.finished = False
        self.on_pause: Callable[[], None] | None = None
        self.on_resume: Callable[[], None] | None = None
        self.client_paused = client_paused  # the client's socket buffer is full (it is not reading)
        self.event_stream = False  # its content type is text/event-stream
        # a Responses API stream: ended by an `error` event, without `[DONE]` (OpenAI's form; set by the relay)
        self.responses_events = False
        self._last_sequence = -1  # the last sequence_number a Responses stream carried
        self._tail = b""  # the last two body bytes written: where a stream cut now stands
        # headers the router's own whole answers carry (CORS, for a page to read its errors); an answer that
        # names the header itself (a replica's, passed on) keeps its own
        self.own_headers: list[tuple[str, str]] = []
        self._pending: list[bytes] = []

    @property
    def client_gone(self) -> bool:
        return self._transport.is_closing()

    def send(self, status: int, body: bytes, content_type: str = "application/json",
             headers: list[tuple[str, str]] | None = None) -> None:
        headers = list(headers or [])
        named = {name.lower() for name, _ in headers}
        headers += [(name, value) for name, value in self.own_headers if name not in named]
        self.start(status, [("content-type", content_type), *headers], content_length=len(body))
        self.write(body)
        self.end()

    def send_json(self, status: int, value: Any) -> None:
        self.send(status, json.dumps(value).encode())

    def start(self, status: int, headers: list[tuple[str, str]], content_length: int | None) -> None:
        assert not self.started, "a response is started once"
        self.started = True
        self.event_stream = is_event_stream(headers)
        reason = _reason(status)
        lines = [f"HTTP/1.1 {status} {reason}"]
        lines += [f"{name}: {value}" for name, value in headers]
        if content_length is not None:
            lines.append(f"content-length: {content_length}")
        elif self._http10:
            self.keep_alive = False  # the end of the connection is the end of the body
        elif not self._head_only and status not in (204, 304):
            self._chunked = True
            lines.append("transfer-encoding: chunked")
        if not self.keep_alive:
            lines.append("connection: close")
        elif self._http10:
            lines.append("connection: keep-alive")
        self._pending.append(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

    def write(self, data: bytes) -> None:
        if not data or self._head_only or self.finished:
            return
        self._tail = (self._tail + data)[-2:]
        if self.responses_events:
            self._last_sequence = _last_sequence_number(data, self._last_sequence)
        if self._chunked:
            self._pending.append(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            self._pending.append(data)

    def flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending) if len(self._pending) > 1 else self._pending[0]
            self._pending.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def end(self) -> None:
        if self.finished:
            return
        self.finished = True
        if self._chunked:
            self._pending.append(b"0\r\n\r\n")
        self.flush()

    def abort(self) -> None:
        """Closes the connection: the answer cannot be completed (its length was promised)."""
        self._pending.clear()
        self.finished = True
        self._transport.close()

    def fail(self, status: int, error: dict[str, Any]) -> None:
        """Ends the answer with ``error`` however far it got: sent as the answer
        (``status``) when none has started; in an event stream, as an event of its
        own (the event it was in closed first) and ``[DONE]`` (a Responses stream:
        OpenAI's ``error`` event, numbered after the stream's last, and no
        ``[DONE]``); any other answer under way is aborted, as a cut JSON or a
        short body would read as whole."""
        if self.finished:
            return
        if not self.started:
            self.send_json(status, error)
        elif self.event_stream:
            if self.responses_events:
                inner = error.get("error")
                detail: dict[str, Any] = inner if isinstance(inner, dict) else {}
                event = {"type": "error", "code": detail.get("code"), "message": detail.get("message", ""),
                         "param": detail.get("param"), "sequence_number": self._last_sequence + 1}
                last = f"event: error\ndata: {json.dumps(event)}\n\n"
            else:
                last = f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n"
            self.write(_event_boundary(self._tail) + last.encode())
            self.end()
        else:
            self.abort()


_SEQUENCE_KEY = b'"sequence_number":'
_SEQUENCE = re.compile(rb'"sequence_number":\s*(\d+)')


def _last_sequence_number(data: bytes, last: int) -> int:
    """The last ``"sequence_number": N`` in ``data``, else ``last`` (best effort:
    a number split between two reads counts as its first part)."""
    match = _SEQUENCE.match(data, at) if (at := data.rfind(_SEQUENCE_KEY)) >= 0 else None
    return int(match.group(1)) if match else last


def is_event_stream(headers: list[tuple[str, str]]) -> bool:
    """Whether an answer's headers name an event stream (SSE)."""
    return any(name.lower() == "content-type" and value.startswith("text/event-stream") for name, value in headers)


def _event_boundary(tail: bytes) -> bytes:
    """What ends the event a cut stream was in (``tail``: its last bytes), so
    that an event written after it is one of its own: nothing at a boundary
    (or before any byte), else the line ends and a blank line follows."""
    if not tail or tail.endswith(b"\n\n"):
        return b""
    return b"\n" if tail.endswith(b"\n") else b"\n\n"


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error object (``param``: the request field at fault)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


_REASONS = {status.value: status.phrase for status in HTTPStatus}


def _reason(status: int) -> str:
    return _REASONS.get(status, "Unknown")
