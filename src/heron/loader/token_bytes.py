"""The raw UTF-8 bytes each token stands for, as OpenAI's logprobs ``bytes``
field needs them: a token may hold part of a character (an emoji is often
three or four byte tokens), and its decoded text is then U+FFFD, whose bytes
say nothing. Joined in order, the tokens' bytes give the text back.

Two vocabulary kinds cover the models heron loads:

* byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM: the tokenizer's decoder is
  ``ByteLevel``): each character of a token's piece stands for one byte
  through GPT-2's printable-character table;
* SentencePiece-style (Llama 2, Mistral): ``<0xNN>`` pieces are single bytes
  (byte fallback) and ``▁`` is a space.

Special and added tokens are their text. Anything else falls back to the
token's decoded text, which is right for every token that holds whole
characters.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPIECE_SPACE = "\u2581"


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's table, inverted: the printable character that stands for each byte.
    Bytes that print as themselves keep their code point; the others (controls,
    space, and so on) take code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table: dict[str, int] = {chr(byte): byte for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in printable:
            table[chr(256 + extra)] = byte
            extra += 1
    return table


def _decoder_types(tokenizer: Any) -> set[str]:
    """The decoder component types of a fast tokenizer (empty if it has none)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders") or [decoder]
    return {str(part.get("type")) for part in parts if isinstance(part, dict)}


class TokenBytes:
    """``of(token_id)``: the bytes the token stands for (built lazily, one token
    at a time, and remembered)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        kinds = _decoder_types(tokenizer)
        self._byte_level = "ByteLevel" in kinds
        self._sentencepiece = not self._byte_level and bool(kinds & {"Metaspace", "ByteFallback", "Replace"})
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        added = getattr(tokenizer, "get_added_vocab", None)
        self._special.update((added() if callable(added) else {}).values())
        self._known: dict[int, bytes] = {}

    def of(self, token_id: int) -> bytes:
        known = self._known.get(token_id)
        if known is None:
            known = self._known[token_id] = self._compute(token_id)
        return known

    def _compute(self, token_id: int) -> bytes:
        piece = None if token_id in self._special else self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and self._byte_level:
            table = _byte_level_decoder()
            if all(char in table for char in piece):
                return bytes(table[char] for char in piece)
        elif isinstance(piece, str) and self._sentencepiece:
            match = _BYTE_PIECE.fullmatch(piece)
            return bytes([int(match.group(1), 16)]) if match else piece.replace(_SPIECE_SPACE, " ").encode()
        return str(self._tokenizer.decode([token_id])).encode()  # special and added tokens, other vocabularies
