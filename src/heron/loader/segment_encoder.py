"""Tokenization that remembers long pieces of text it has seen: the shared
system prompt of many chat requests is encoded once, not per request.

A Hugging Face (Rust) tokenizer cuts its added tokens (``<|im_start|>`` and the
like) out of the text before anything else, and encodes the pieces between
them independently. So the ids of a text are the concatenation of its pieces'
ids with the added tokens' ids between them, and a piece seen before can be
looked up instead of encoded. That holds when nothing crosses a piece's
boundary: no normalizer, no added token that strips spaces around it or must
be a single word, and no special tokens added around the whole (a post-processor
adding BOS, say, when the caller asks for special tokens). ``SegmentEncoder.create``
checks these and a sample encoding against the tokenizer, and returns None when
any fails; callers then encode whole texts.
"""

from __future__ import annotations

import re
from typing import Any

# pieces shorter than this are encoded every time: cheap, and they would churn the cache
MIN_CACHED_CHARS = 64
# the cache's bound in characters too: 4,096 entries of any size held gigabytes (a 100 KB piece keeps about
# 0.8 MB of ids), with prompts a server then refused among them
MAX_CACHED_TOTAL_CHARS = 4 << 20

_SAMPLE = ("{s}system\nYou are a careful assistant.  Answer briefly.\n{e}\n{s}user\nWhat's 2+2? "
           "Ünïcode, emoji 🦩 and   spaces\t{e}\n{s}assistant\n")


class SegmentEncoder:
    def __init__(self, backend: Any, added: dict[str, int], max_entries: int = 4096) -> None:
        self.backend = backend
        self.added = added
        self.pattern = re.compile("(" + "|".join(re.escape(text) for text in sorted(added, key=len, reverse=True))
                                  + ")") if added else None
        self.max_entries = max_entries
        self._cache: dict[str, list[int]] = {}
        self._cached_chars = 0
        # a post-processor that adds tokens around the whole text (BOS, say): such encodings go whole
        self._adds_special_tokens = (backend.encode("a", add_special_tokens=True).ids
                                     != backend.encode("a", add_special_tokens=False).ids)

    @staticmethod
    def create(backend: Any, max_entries: int = 4096) -> SegmentEncoder | None:
        """For a ``tokenizers.Tokenizer`` on which piecewise encoding is exact, else None."""
        if backend is None or getattr(backend, "normalizer", None) is not None:
            return None
        try:
            tokens = backend.get_added_tokens_decoder()
        except AttributeError:
            return None
        if any(token.lstrip or token.rstrip or token.single_word for token in tokens.values()):
            return None
        encoder = SegmentEncoder(backend, {token.content: token_id for token_id, token in tokens.items()},
                                 max_entries)
        texts = [token.content for token in tokens.values()]
        sample = _SAMPLE.format(s=texts[1] if len(texts) > 1 else "", e=texts[0] if texts else "")
        for specials in (False, True):
            if encoder.encode(sample, specials) != backend.encode(sample, add_special_tokens=specials).ids:
                return None
        return encoder

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The tokenizer's ids for ``text``."""
        if add_special_tokens and self._adds_special_tokens:
            return list(self.backend.encode(text, add_special_tokens=True).ids)
        ids: list[int] = []
        for piece in self.pieces(text):
            ids.extend(self.piece_ids(piece))
        return ids

    def encodes_whole(self, add_special_tokens: bool) -> bool:
        """Whether ``encode`` takes the text whole (the tokenizer adds tokens around it)."""
        return add_special_tokens and self._adds_special_tokens

    def pieces(self, text: str) -> list[str]:
        """``text`` cut into the pieces the tokenizer encodes independently: each
        added token alone, the non-empty texts between them; their ids in order
        (``piece_ids``) are the text's ids."""
        if self.pattern is None:
            return [text] if text else []
        return [piece for piece in self.pattern.split(text) if piece]

    def piece_ids(self, piece: str) -> list[int]:
        """The ids of one piece of ``pieces`` (do not modify: it may be remembered)."""
        token_id = self.added.get(piece)
        return [token_id] if token_id is not None else self._piece(piece)

    def _piece(self, text: str) -> list[int]:
        if len(text) < MIN_CACHED_CHARS:
            return list(self.backend.encode(text, add_special_tokens=False).ids)
        ids = self._cache.get(text)
        if ids is None:
            ids = list(self.backend.encode(text, add_special_tokens=False).ids)
            if len(text) > MAX_CACHED_TOTAL_CHARS // 16:  # a document, not a shared beginning: not kept
                return ids
            if len(self._cache) >= self.max_entries or self._cached_chars + len(text) > MAX_CACHED_TOTAL_CHARS:
                self._cache.clear()  # simplest bound; a workload's shared pieces come back at once
                self._cached_chars = 0
            self._cache[text] = ids
            self._cached_chars += len(text)
        return ids
