"""An event stream's first event, held back until it is whole: a replica that
cannot serve a stream it has accepted (its engine core died, it is stopping,
its model is still loading) answers it with a 200 whose first event is the
error. Passed on, that left the client an error while another replica could
have served the request; held back, the stream is that replica's refusal and
the router tries another, whose events follow the stream's head already sent.

A first event is the stream's first bytes up to a blank line. A chat stream's
role chunk goes out with its first chunk of output (serving_chat.py), so an
error before any output is the first event there too."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from heron.router.replica_errors import REFUSAL_CODES, code_in, json_object, refused_at_the_door

# a first event longer than this is no refusal (heron's error events are a few hundred bytes)
MAX_HELD_BYTES = 64 * 1024


@dataclass(slots=True)
class FirstEventGate:
    """Feed it the stream's bytes; it says what to pass on. ``refused``: the
    replica's error, when the first event was a refusal (nothing of the stream
    is passed on then)."""

    held: bytearray = field(default_factory=bytearray)
    is_open: bool = False
    refused: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> bytes:
        """What of the stream to pass on now (b"" while the first event is held, or after a refusal)."""
        if self.is_open:
            return chunk
        if self.refused is not None:
            return b""
        self.held += chunk
        end = _event_end(self.held)
        if end is None and len(self.held) <= MAX_HELD_BYTES:
            return b""
        refusal = _refusal(bytes(self.held[:end])) if end is not None else None
        if refusal is not None:
            self.refused = refusal
            self.held.clear()
            return b""
        return self.release()

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


def _event_end(data: bytearray) -> int | None:
    ends = [index for index in (data.find(b"\n\n"), data.find(b"\r\n\r\n")) if index >= 0]
    return min(ends) if ends else None


def _refusal(event: bytes) -> dict[str, Any] | None:
    """The error object of an event that is a replica's refusal, else None."""
    lines = event.decode("utf-8", "replace").splitlines()
    payload = json_object("\n".join(line[5:].lstrip() for line in lines if line.startswith("data:")).encode())
    code = code_in(payload)
    return payload if isinstance(code, str) and code in REFUSAL_CODES else None
