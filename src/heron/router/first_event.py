"""An event stream's first event, held back until it is whole: a replica that
cannot serve a stream it has accepted (its engine core died, it is stopping,
its model is still loading) answers it with a 200 whose first event is the
error. Passed on, that left the client an error while another replica could
have served the request; held back, the stream is that replica's refusal and
the router tries another, whose events follow the stream's head already sent.

A first event is the stream's first bytes up to a blank line. A chat stream's
role chunk goes out with its first chunk of output (serving_chat.py), so an
error before any output is the first event there too. A Responses stream opens
with ``response.created`` and ``response.in_progress`` before the engine has
done anything (``RESPONSES_HEAD_EVENT_TYPES``): those are held with the first
event, and the gate opens on the event after them (a replica killed during the
prefill cut the stream after them, and the request was not tried again); a
``response.failed`` then, whose error is a refusal (its engine core died), is
that replica's refusal."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from heron.router.replica_errors import REFUSAL_CODES, code_in, json_object, refused_at_the_door

# an event longer than this is no refusal (heron's error events are a few hundred bytes)
MAX_HELD_BYTES = 64 * 1024
# head events held at most (each repeats the request's instructions and tools: large for an agent's request)
MAX_HELD_HEAD_BYTES = 16 * 1024 * 1024
# the events a Responses stream opens with, before any work of the engine's
RESPONSES_HEAD_EVENT_TYPES = frozenset({"response.created", "response.in_progress"})


@dataclass(slots=True)
class FirstEventGate:
    """Feed it the stream's bytes; it says what to pass on. ``refused``: the
    replica's error, when the first event was a refusal (nothing of the stream
    is passed on then). ``head_types``: event types held with the first event
    that follows them."""

    head_types: frozenset[str] = frozenset()
    held: bytearray = field(default_factory=bytearray)
    scanned: int = 0  # the held bytes up to here are whole head events
    is_open: bool = False
    refused: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> bytes:
        """What of the stream to pass on now (b"" while the first event is held, or after a refusal)."""
        if self.is_open:
            return chunk
        if self.refused is not None:
            return b""
        self.held += chunk
        while (found := _next_event(self.held, self.scanned)) is not None:
            event, after = found
            if self.head_types and _event_type(event) in self.head_types:  # held, and no refusal
                self.scanned = after
                continue
            refusal = _refusal(event)
            if refusal is None:
                return self.release()
            self.refused = refusal
            self.held.clear()
            return b""
        too_long = len(self.held) - self.scanned > MAX_HELD_BYTES or self.scanned > MAX_HELD_HEAD_BYTES
        return self.release() if too_long else b""

    def release(self) -> bytes:
        """Opens the gate: the bytes held so far (the stream ended before its first event was whole)."""
        self.is_open = True
        held = bytes(self.held)
        self.held.clear()
        return held

    @property
    def may_have_begun(self) -> bool:
        """The refusal came from a replica that may have begun the request."""
        assert self.refused is not None
        return not refused_at_the_door(code_in(self.refused))


def _next_event(data: bytearray, start: int) -> tuple[bytes, int] | None:
    """The whole event beginning at ``start`` and where the next one begins, or None."""
    ends = [(index, len(mark)) for mark in (b"\n\n", b"\r\n\r\n") if (index := data.find(mark, start)) >= 0]
    if not ends:
        return None
    end, length = min(ends)
    return bytes(data[start:end]), end + length


def _data_of(event: bytes) -> dict[str, Any] | None:
    lines = event.decode("utf-8", "replace").splitlines()
    return json_object("\n".join(line[5:].lstrip() for line in lines if line.startswith("data:")).encode())


def _event_type(event: bytes) -> str | None:
    """An event's ``event:`` name, else its data's ``type``."""
    for line in event.decode("utf-8", "replace").splitlines():
        if line.startswith("event:"):
            return line[6:].strip()
    payload = _data_of(event)
    kind = payload.get("type") if payload is not None else None
    return kind if isinstance(kind, str) else None


def _refusal(event: bytes) -> dict[str, Any] | None:
    """The error object of an event that is a replica's refusal, else None (a
    Responses stream's refusal is a ``response.failed`` holding the error)."""
    payload = _data_of(event)
    if payload is not None and payload.get("type") == "response.failed" and isinstance(payload.get("response"), dict):
        payload = {"error": payload["response"].get("error")}
    code = code_in(payload)
    return payload if isinstance(code, str) and code in REFUSAL_CODES else None
