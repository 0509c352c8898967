"""Incremental detokenization that never emits a broken UTF-8 character.

Byte-level tokens can end in the middle of a multi-byte character (emoji, CJK,
byte-fallback tokens); decoding them alone yields U+FFFD. The detokenizer keeps a
small window of tokens (``prefix_offset`` .. end) and emits only the text that the
newest tokens add to the window's decoded text once it no longer ends in U+FFFD,
so the concatenation of its pieces equals the final text. Decoding a window that
starts a few tokens back (at first, in the prompt) keeps word-initial spaces right
for tokenizers that strip a leading space.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT_CHAR = "\ufffd"
_INITIAL_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self._decode = lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
        else:
            self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        context = list(prompt_token_ids[-_INITIAL_CONTEXT_TOKENS:])
        self._tokens = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is split)."""
        self._tokens.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end: emit whatever is pending, even an incomplete character."""
        if self._read_offset == len(self._tokens):
            return ""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._tokens[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) and not final:
            return ""  # e.g. a special token that is skipped, or a pending byte
        if full_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""
        new_text = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        # keep the window short: older tokens no longer matter for decoding
        if self._prefix_offset > 64:
            del self._tokens[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text
