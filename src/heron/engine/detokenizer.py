"""Incremental detokenization that never emits a broken UTF-8 character.

Byte-level tokens can end in the middle of a multi-byte character (emoji, CJK,
byte-fallback tokens); decoding them alone yields U+FFFD. The detokenizer keeps a
small window of tokens (``prefix_offset`` .. end) and emits only the text that the
newest tokens add to the window's decoded text once it no longer ends in U+FFFD,
so the concatenation of its pieces equals the final text. Decoding a window that
starts a few tokens back (at first, in the prompt) keeps word-initial spaces right
for tokenizers that strip a leading space.

``StreamingDetokenizer`` runs the same window algorithm inside the Rust
``tokenizers`` library (``DecodeStream``): one call per token instead of two
decodes from Python, about a third of the host time (it runs for every token
of every request). ``make_detokenizer`` picks it for fast tokenizers; should a
tokenizer's decoder ever make it fail (text that is not a prefix of the longer
text), it hands over to ``IncrementalDetokenizer`` mid-stream, losing nothing,
and a prompt that ends mid-character goes to the Python one from the start. On
valid UTF-8 the two emit identical pieces; after invalid byte sequences (garbage
output) the number of U+FFFD they emit may differ.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers older than 0.21
    DecodeStream = None  # type: ignore[misc,assignment]

_REPLACEMENT_CHAR = "\ufffd"
_INITIAL_CONTEXT_TOKENS = 5
_MAX_CONTEXT_TOKENS = 24


def clean_context(decode: Callable[[list[int]], str], token_ids: list[int]) -> list[int]:
    """The prompt tokens to decode new tokens after: the shortest suffix of at
    least 5 (up to 24) whose text has no U+FFFD, so it starts on a character
    boundary; else the last 5. A byte-fallback decoder (Llama 2, Mistral) turns
    a whole run of stray bytes into U+FFFD: a window starting inside a
    character made every byte token that followed come out as U+FFFD."""
    for length in range(_INITIAL_CONTEXT_TOKENS, min(len(token_ids), _MAX_CONTEXT_TOKENS) + 1):
        window = token_ids[-length:]
        if _REPLACEMENT_CHAR not in decode(window):
            return list(window)
    return list(token_ids[-_INITIAL_CONTEXT_TOKENS:])


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self._decode = lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
        else:
            self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        context = clean_context(self._decode, prompt_token_ids)
        self._tokens = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        # a prompt ending inside a character: its bytes decode as U+FFFD here; the output's first bytes may
        # complete it (a client continuing an answer cut there), and the whole character is then output text
        prompt_text = self._decode(context) if context else ""
        self._split_prompt_chars = len(prompt_text) - len(prompt_text.rstrip(_REPLACEMENT_CHAR))

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is split)."""
        self._tokens.append(token_id)
        return self._advance(final=False)

    def push_many(self, token_ids: list[int]) -> str:
        """``push`` each token in turn; the concatenated text."""
        return "".join([self.push(token_id) for token_id in token_ids])

    def flush(self) -> str:
        """At the end: emit whatever is pending, even an incomplete character."""
        if self._read_offset == len(self._tokens):
            return ""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._tokens[self._prefix_offset :])
        prefix_length = len(prefix_text)
        if self._split_prompt_chars:  # the prompt's split character: completed by the output, or left as it was
            start = prefix_length - self._split_prompt_chars
            if not full_text[start:].startswith(_REPLACEMENT_CHAR * self._split_prompt_chars):
                prefix_length = start
        if len(full_text) <= prefix_length and not final:
            return ""  # e.g. a special token that is skipped, or a pending byte
        if full_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""
        new_text = full_text[prefix_length:]
        self._split_prompt_chars = 0  # from here on the window starts at the output's own text
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        # keep the window short: older tokens no longer matter for decoding
        if self._prefix_offset > 64:
            del self._tokens[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text


class StreamingDetokenizer:
    """``IncrementalDetokenizer``'s contract on ``tokenizers.decoders.DecodeStream``."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        assert DecodeStream is not None
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        context = clean_context(self._decode, prompt_token_ids)
        self._emitted_tail = context  # the newest tokens whose text is out: context for a hand-over
        self._pending: list[int] = []  # tokens pushed since the last emitted text
        self._fallback: IncrementalDetokenizer | None = None
        text: str | None = ""
        try:
            for token_id in context:  # the prompt's text is not ours to emit
                text = self._stream.step(self._backend, token_id)
        except Exception:  # noqa: BLE001 (a decoder the stream cannot follow)
            text = None
        if text is None and context:
            # the prompt ends mid-character (or the stream failed on it): the stream
            # would emit the prompt's pending bytes as output; the Python detokenizer
            # treats them as prompt text
            self._fallback = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)

    def push(self, token_id: int) -> str:
        if self._fallback is not None:
            return self._fallback.push(token_id)
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception:  # noqa: BLE001 (the decoder broke the stream's prefix rule, or an unknown id)
            return self._hand_over(token_id)
        self._pending.append(token_id)
        if text is None:  # a character still split, or a skipped special token
            return ""
        self._emitted_tail = (self._emitted_tail + self._pending)[-_MAX_CONTEXT_TOKENS:]
        self._pending = []
        return text

    def push_many(self, token_ids: list[int]) -> str:
        """``push`` each token in turn; the concatenated text. The loop stays in the
        stream's calls: the emitted tail and pending tokens are settled once."""
        if self._fallback is not None:
            return self._fallback.push_many(token_ids)
        step, backend = self._stream.step, self._backend
        pieces: list[str] = []
        settled = 0  # token_ids[:settled] have had their text emitted
        for index, token_id in enumerate(token_ids):
            try:
                text = step(backend, token_id)
            except Exception:  # noqa: BLE001 (as in push: hand the rest over to Python)
                self._settle(token_ids[:index], settled)
                pieces.append(self._hand_over(token_id))
                assert self._fallback is not None  # _hand_over made it
                pieces.append(self._fallback.push_many(token_ids[index + 1 :]))
                return "".join(pieces)
            if text is not None:
                pieces.append(text)
                settled = index + 1
        self._settle(token_ids, settled)
        return "".join(pieces)

    def _settle(self, token_ids: list[int], settled: int) -> None:
        """Book ``token_ids`` as pushed, of which the first ``settled`` emitted their text."""
        if settled:
            self._emitted_tail = (self._emitted_tail + self._pending + token_ids[:settled])[-_MAX_CONTEXT_TOKENS:]
            self._pending = list(token_ids[settled:])
        else:
            self._pending.extend(token_ids)

    def flush(self) -> str:
        if self._fallback is not None:
            return self._fallback.flush()
        if not self._pending:
            return ""
        context = clean_context(self._decode, self._emitted_tail)
        prefix = self._decode(context)
        full = self._decode(context + self._pending)
        self._emitted_tail, self._pending = (self._emitted_tail + self._pending)[-_MAX_CONTEXT_TOKENS:], []
        return full[len(prefix) :]

    def _decode(self, token_ids: list[int]) -> str:
        return str(self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens))

    def _hand_over(self, token_id: int) -> str:
        """Continue in Python from the text emitted so far."""
        self._fallback = IncrementalDetokenizer(self._tokenizer, self._emitted_tail, self._skip_special_tokens)
        return "".join(self._fallback.push(pending) for pending in [*self._pending, token_id])


def make_detokenizer(
    tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True
) -> IncrementalDetokenizer | StreamingDetokenizer:
    """The Rust-backed detokenizer for fast tokenizers, the Python one otherwise."""
    if DecodeStream is not None and getattr(tokenizer, "backend_tokenizer", None) is not None:
        return StreamingDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
