"""A chat request's tools, from its prompt to its answer: which format the
model writes calls in, how the tools reach the template, what generation is
constrained to, and the calls read back from the output."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from heron.engine.tool_prompting import template_takes_tools
from heron.entrypoints.openai.tools.choice import ToolChoice, tool_choice_of
from heron.entrypoints.openai.tools.parsers import PARSERS, ToolCall, ToolParser, parser_for_template
from heron.entrypoints.openai.tools.streaming import ToolCallStream
from heron.sampling_params import SamplingParams


@dataclass
class ChatTools:
    choice: ToolChoice
    parser: ToolParser

    @classmethod
    def of(cls, request: Any, template: str | None, parser_name: str | None) -> ChatTools | None:
        choice = tool_choice_of(request.tools, request.tool_choice, request.parallel_tool_calls)
        if choice is None:
            return None
        name = parser_name or parser_for_template(template if template_takes_tools(template) else None)
        return cls(choice, PARSERS[name](frozenset(choice.functions)))

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """Generation as the tool choice needs it (a ``ValueError`` if the
        request constrains its output otherwise too). Calls that the choice
        forces are generated whole: stop strings end content, not a call's
        arguments (as OpenAI's do), and ``"\n"`` cut a named call at its first
        line, answered as a finished call whose arguments did not parse."""
        constraint = self.choice.constraint()
        if constraint is not None:
            if params.structured_outputs is not None:
                raise ValueError("tool_choice 'required' or a named function cannot be combined with response_format")
            return params.clone(structured_outputs=constraint, stop=None)
        if self.choice.mode == "auto" and not self.parser.skip_special_tokens:
            return params.clone(skip_special_tokens=False)  # the parser's markers are special tokens
        return params

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output, each call with an id of the
        parser's form (``_calls``)."""
        content, calls = self._calls(text)
        return content, [replace(call, id=self.parser.call_id()) for call in calls]

    def _calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output: what the stream of the same
        output sends (``ToolCallStream``), whole. A constrained output is never
        content: a named function's call carries the generated arguments as
        they are (unfinished ones too, when ``max_tokens`` cut them, as OpenAI
        and vLLM answer), "required" the calls it closed (perhaps none)."""
        if self.choice.mode == "none":
            return text, []
        if self.choice.mode == "named":
            assert self.choice.named is not None
            return None, [ToolCall(self.choice.named, text)] if text else []
        if self.choice.mode == "required":
            return None, self.choice.calls_from_constrained(text) or []
        parsed = self.parser.parse(text, final=True)
        calls = parsed.calls if self.choice.parallel else parsed.calls[:1]
        if not calls:
            return text, []
        return (parsed.content if parsed.content.strip() else None), calls

    def stream(self) -> ToolCallStream | None:
        return None if self.choice.mode == "none" else ToolCallStream(self.choice, self.parser)


def finish_reason(reason: str | None, called: bool, mode: str = "auto") -> str | None:
    """OpenAI's ``tool_calls`` for an answer that ended on its calls, but for
    a named function's: the call was forced, and OpenAI (and vLLM) answer
    ``stop`` for it."""
    return "tool_calls" if called and reason == "stop" and mode != "named" else reason
