"""The chat template rendered straight, for the router's hashing of plain chats.

``apply_chat_template`` normalizes, copies and checks a conversation through a
long chain of Python before the compiled Jinja template runs; for the common
request (messages with a string role and string content, nothing else) that
chain changes nothing, and it is most of the router's cost of reading a chat
on a busy machine (its code and data are out of the CPU's caches between
requests). ``DirectChatRenderer`` runs the template transformers compiled,
with the same variables (the tokenizer's special tokens), and is used only
where a start-up self-check renders sample conversations identically both
ways; anything else (content parts, tool calls, template arguments, another
transformers) goes the long way. A wrong rendering here would only cost a
cache match, never an answer: replicas render their own prompts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from heron.engine.input_processor import InputProcessor

logger = logging.getLogger(__name__)

_PLAIN_KEYS = frozenset({"role", "content"})

# conversations the fast path must render exactly as apply_chat_template does
_SAMPLES: tuple[tuple[tuple[tuple[str, str], ...], bool], ...] = (
    ((("system", "You are a careful guide."), ("user", "Which bird waits in the shallows?")), True),
    ((("user", "Hello  there,\n\tfriend. Ünïcode 🦩"),), True),
    ((("user", "One"), ("assistant", "Two"), ("user", "Three")), True),
    ((("system", "s"), ("user", "u"), ("assistant", "a")), False),
)


class DirectChatRenderer:
    def __init__(self, template: Any, variables: dict[str, Any]) -> None:
        self._template = template
        self._variables = variables

    @staticmethod
    def create(processor: InputProcessor) -> DirectChatRenderer | None:
        """For a tokenizer whose chat template renders the samples exactly as
        ``processor.render_chat`` does, else None."""
        tokenizer = processor.tokenizer
        source = getattr(tokenizer, "chat_template", None)
        if not isinstance(source, str):
            return None
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            renderer = DirectChatRenderer(_compile_jinja_template(source), dict(tokenizer.special_tokens_map))
        except Exception as exc:  # noqa: BLE001 (an unusual template or transformers: the long way is always there)
            logger.info("no direct chat rendering (%s): the router takes apply_chat_template", exc)
            return None

        def slow(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
            return processor.render_chat(messages, add_generation_prompt=add_generation_prompt)

        verified = 0
        for sample, add_generation_prompt in _SAMPLES:
            messages = [{"role": role, "content": content} for role, content in sample]
            # a template may refuse a sample (no system role, say): then both ways must refuse it
            expected = _or_none(slow, messages, add_generation_prompt)
            if _or_none(renderer.render, messages, add_generation_prompt) != expected:
                logger.info("the chat template renders differently outside transformers: the router takes "
                            "apply_chat_template for every chat")
                return None
            verified += expected is not None
        return renderer if verified else None

    def render(self, messages: Any, add_generation_prompt: bool) -> str | None:
        """The rendered conversation, or None where the messages are not plain
        (then ``InputProcessor.render_chat`` is the way)."""
        if not isinstance(messages, list) or not messages:
            return None
        plain = []
        for message in messages:
            if (not isinstance(message, dict) or message.keys() != _PLAIN_KEYS
                    or not isinstance(message["role"], str) or not isinstance(message["content"], str)):
                return None
            plain.append({"role": message["role"], "content": message["content"]})
        return str(self._template.render(messages=plain, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self._variables))


def _or_none(render: Callable[[list[dict[str, str]], bool], str | None], messages: list[dict[str, str]],
             add_generation_prompt: bool) -> str | None:
    try:
        return render(messages, add_generation_prompt)
    except Exception:  # noqa: BLE001 (a template's own refusal, or the request's error)
        return None
