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

Most templates only substitute a message's content into the text (they test
roles and positions, never content). For those, ``ChatSkeletons`` renders each
conversation shape (its roles, in order, and whether a generation prompt is
added) once with marker contents, keeps the text around the markers, and fills
later conversations of that shape by joining strings: the template runs once
per shape instead of once per request. The templates allowed are a whitelist
(``substitutes_content_only``): one that reads content any other way (a
filter, a test, a captured block, a computed key) or calls anything whose
value may change (``strftime_now``) gets no skeletons.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from heron.engine.input_processor import InputProcessor, as_template_role, names_developer

logger = logging.getLogger(__name__)

_PLAIN_KEYS = frozenset({"role", "content"})

# conversations the fast path must render exactly as apply_chat_template does
_SAMPLES: tuple[tuple[tuple[tuple[str, str], ...], bool], ...] = (
    ((("system", "You are a careful guide."), ("user", "Which bird waits in the shallows?")), True),
    ((("user", "Hello  there,\n\tfriend. Ünïcode 🦩"),), True),
    ((("user", "One"), ("assistant", "Two"), ("user", "Three")), True),
    ((("system", "s"), ("user", "u"), ("assistant", "a")), False),
    ((("developer", "Be brief."), ("user", "Hi")), True),
)


class DirectChatRenderer:
    def __init__(self, template: Any, variables: dict[str, Any], source: str | None = None) -> None:
        """``source``: the template's text, to see whether conversations can be
        filled into skeletons (None: every conversation runs the template)."""
        self._template = template
        self._knows_developer = names_developer(source)  # once, not per message of every request
        self._variables = variables
        self._skeletons = (ChatSkeletons(self._render_plain)
                           if source and substitutes_content_only(source, getattr(template, "environment", None))
                           else None)

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

            renderer = DirectChatRenderer(_compile_jinja_template(source), dict(tokenizer.special_tokens_map), source)
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
            # as the replica renders it (a developer message as system, where the template has no developer)
            plain.append(as_template_role({"role": message["role"], "content": message["content"]},
                                          self._knows_developer))
        if self._skeletons is not None:
            return self._skeletons.render(plain, add_generation_prompt)
        return self._render_plain(plain, add_generation_prompt)

    def _render_plain(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return str(self._template.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self._variables))


class ChatSkeletons:
    """Conversations rendered by filling the text a template writes around
    their contents, learnt once per shape from ``render`` (which must only
    substitute contents: ``substitutes_content_only``). A shape is learnt from
    marker contents and kept only if two different sets of markers (one with
    spaces, newlines, quotes and braces) both come out exactly where the
    skeleton puts them; otherwise that shape is always rendered."""

    def __init__(self, render: Callable[[list[dict[str, str]], bool], str], max_shapes: int = 1024) -> None:
        self._render = render
        self.max_shapes = max_shapes
        # (roles, add_generation_prompt) -> the text before each content and after the last, or None
        self._shapes: dict[tuple[tuple[str, ...], bool], tuple[str, ...] | None] = {}

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        key = (tuple(message["role"] for message in messages), add_generation_prompt)
        if key not in self._shapes:
            if len(self._shapes) >= self.max_shapes:
                self._shapes.clear()
            self._shapes[key] = self._learn(key[0], add_generation_prompt)
        skeleton = self._shapes[key]
        if skeleton is None:
            return self._render(messages, add_generation_prompt)
        return _fill(skeleton, [message["content"] for message in messages])

    def _learn(self, roles: tuple[str, ...], add_generation_prompt: bool) -> tuple[str, ...] | None:
        markers = [f"\ue000{index}\ue001" for index in range(len(roles))]
        awkward = [f" \n\t'\"{{{{ {index} }}}}\ue002 \n" for index in range(len(roles))]
        try:
            text = self._render(_messages(roles, markers), add_generation_prompt)
            skeleton = _split_at(text, markers)
            if skeleton is None or self._render(_messages(roles, awkward), add_generation_prompt) != _fill(
                    skeleton, awkward):
                return None
        except Exception:  # noqa: BLE001 (a template refusing a shape refuses it every time: render then)
            return None
        return skeleton


# nodes after which nothing the template writes can be trusted to be the content as it is: a
# block that captures or filters what it writes, a macro (its output is a value), a call
# (a method, a global such as strftime_now, whose value changes), an include or import
_OPAQUE_NODES = (nodes.AssignBlock, nodes.FilterBlock, nodes.Macro, nodes.CallBlock, nodes.Call, nodes.Include,
                 nodes.Import, nodes.FromImport, nodes.Extends, nodes.EvalContextModifier)
_ALLOWED_CALLS = frozenset({"raise_exception"})  # refuses a conversation: learnt as such, rendered each time


def substitutes_content_only(source: str, environment: Any = None) -> bool:
    """Whether a chat template uses a message's content only by writing it out
    (alone or joined with ``+`` / ``~`` into what it writes), and nothing that
    changes between renders: then the text it renders is the same around any
    content, and depends only on the roles and positions of the messages. A
    whitelist: no filter but ``length``, no call but ``raise_exception``, no
    block that captures what it writes, no key but a constant one.
    ``environment``: the Jinja environment the template was compiled in (its
    extensions: ``{% generation %}``, loop controls)."""
    try:
        template = (environment or ImmutableSandboxedEnvironment()).parse(source)
    except Exception:  # noqa: BLE001 (transformers compiled it; a parse that fails here means: no skeletons)
        return False
    return _content_only_written(template, written=False)


def _content_only_written(node: nodes.Node, written: bool) -> bool:
    """``written``: ``node`` is (part of a ``+`` / ``~`` join that is) an item written by an Output."""
    if isinstance(node, nodes.Getitem):
        if isinstance(node.arg, nodes.Slice):
            bounds = (node.arg.start, node.arg.stop, node.arg.step)
            if not all(bound is None or _constant(bound) is not None for bound in bounds):
                return False
        elif (key := _constant(node.arg)) is None:
            return False  # a computed key may be 'content'
        elif key.value == "content":
            return written and _content_only_written(node.node, written=False)
    if isinstance(node, nodes.Getattr) and node.attr == "content":
        return written and _content_only_written(node.node, written=False)
    if isinstance(node, nodes.Const) and node.value == "content":
        return False  # 'content' used some other way: 'content' in message ...
    if isinstance(node, nodes.Call):
        if not (isinstance(node.node, nodes.Name) and node.node.name in _ALLOWED_CALLS):
            return False
    elif isinstance(node, _OPAQUE_NODES):
        return False
    if isinstance(node, nodes.Filter) and node.name not in ("length", "count"):
        return False
    if isinstance(node, nodes.Output):
        return all(_content_only_written(child, written=True) for child in node.nodes)
    joined = written and isinstance(node, (nodes.Add, nodes.Concat))
    return all(_content_only_written(child, written=joined) for child in node.iter_child_nodes())


def _constant(node: nodes.Node) -> nodes.Const | None:
    """The constant ``node`` is, or negates (``messages[-1]``); None if it is not one."""
    inner = node.node if isinstance(node, nodes.Neg) else node
    return inner if isinstance(inner, nodes.Const) else None


def _messages(roles: tuple[str, ...], contents: list[str]) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in zip(roles, contents, strict=True)]


def _split_at(text: str, markers: list[str]) -> tuple[str, ...] | None:
    """The text before each marker and after the last, if each marker is in it once, in order."""
    pieces = []
    start = 0
    for marker in markers:
        found = text.find(marker, start)
        if found < 0 or text.count(marker) != 1:
            return None
        pieces.append(text[start:found])
        start = found + len(marker)
    pieces.append(text[start:])
    return tuple(pieces)


def _fill(skeleton: tuple[str, ...], contents: list[str]) -> str:
    parts = [skeleton[0]]
    for content, after in zip(contents, skeleton[1:], strict=True):
        parts.append(content)
        parts.append(after)
    return "".join(parts)


def _or_none(render: Callable[[list[dict[str, str]], bool], str | None], messages: list[dict[str, str]],
             add_generation_prompt: bool) -> str | None:
    try:
        return render(messages, add_generation_prompt)
    except Exception:  # noqa: BLE001 (a template's own refusal, or the request's error)
        return None
