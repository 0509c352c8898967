"""Tool calls of one streamed choice as OpenAI's chunk deltas. Content flows
as it comes until a call may be starting (a marker, or the start of one, at
the end of the text so far); from there the text is held, and each call is
sent whole (name and arguments in one delta) once its closing is generated.
Content that is only whitespace so far is held too (before a call it is no
content at all). A named function's arguments stream token by token, as
OpenAI's do. What turns out not to be a call (a cut or broken one, words after
the calls) is sent as content when the choice ends: the same content and calls
as the parse of the whole text (``ChatTools.calls``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from heron.entrypoints.openai.tools.choice import ToolChoice
from heron.entrypoints.openai.tools.parsers import ToolCall, ToolParser


@dataclass
class ToolDeltas:
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def delta(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.content:
            out["content"] = self.content
        if self.calls:
            out["tool_calls"] = self.calls
        return out


def call_delta(index: int, call: ToolCall) -> dict[str, Any]:
    return {"index": index, **call.to_openai()}


def held_tail(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could begin a marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-size:]):
                longest = size
                break
    return longest


class ToolCallStream:
    def __init__(self, choice: ToolChoice, parser: ToolParser) -> None:
        self.choice = choice
        self.parser = parser
        self.text = ""
        self.content_sent = 0
        self.calls_sent = 0
        self.named_id = parser.call_id()
        self.started = False  # a call's marker was seen: the content before it is final

    @property
    def called(self) -> bool:
        return self.calls_sent > 0

    def feed(self, delta: str) -> ToolDeltas:
        fed = len(self.text)
        self.text += delta
        if self.choice.mode == "named":
            return self._named(delta)
        # the text so far is parsed again only when this delta may have closed a call: parsed on every
        # token, a long call's arguments cost time quadratic in their length, on the server's event loop
        if self.choice.mode == "required":
            if not self._may_close(fed, ("}",)):
                return ToolDeltas()
            return self._calls_out(self.choice.calls_from_constrained(self.text) or [])
        if self.started and not self._may_close(fed, self.parser.closers):
            return ToolDeltas()
        parsed = self.parser.parse(self.text, final=False)
        self.started = parsed.started
        if not parsed.started:
            visible = len(self.text) - held_tail(self.text, self.parser.markers)
            return self._content_to(self.text[:visible], [])
        return self._content_to(parsed.content, self._limit(parsed.calls))

    def finish(self) -> ToolDeltas:
        """What is left to send once the choice has ended."""
        if self.choice.constrains:
            return ToolDeltas()
        parsed = self.parser.parse(self.text, final=True)
        calls = self._limit(parsed.calls)
        if calls and not parsed.content.strip():
            return self._calls_out(calls)
        return self._content_to(parsed.content, calls, final=True)

    def _may_close(self, fed: int, closers: tuple[str, ...] | None) -> bool:
        """Whether the text after its first ``fed`` characters holds (the end of) one of ``closers``."""
        if closers is None:
            return True
        longest = max(len(closer) for closer in closers)
        window = self.text[max(0, fed - longest + 1):]
        return any(closer in window for closer in closers)

    def _limit(self, calls: list[ToolCall]) -> list[ToolCall]:
        return calls if self.choice.parallel else calls[:1]

    def _named(self, delta: str) -> ToolDeltas:
        if self.calls_sent == 0:
            self.calls_sent = 1
            name = self.choice.named
            return ToolDeltas(calls=[{"index": 0, "id": self.named_id, "type": "function",
                                      "function": {"name": name, "arguments": delta}}])
        return ToolDeltas(calls=[{"index": 0, "function": {"arguments": delta}}] if delta else [])

    def _content_to(self, content: str, calls: list[ToolCall], final: bool = False) -> ToolDeltas:
        out = ToolDeltas()
        if len(content) > self.content_sent and (final or content.strip()):
            out.content = content[self.content_sent:]
            self.content_sent = len(content)
        return self._calls_out(calls, out)

    def _calls_out(self, calls: list[ToolCall], out: ToolDeltas | None = None) -> ToolDeltas:
        out = out or ToolDeltas()
        for index in range(self.calls_sent, len(calls)):
            out.calls.append(call_delta(index, replace(calls[index], id=self.parser.call_id())))
        self.calls_sent = max(self.calls_sent, len(calls))
        return out
