"""The log-probability parts of response bodies: chat's ``logprobs.content``
(OpenAI's shape, with each token's real UTF-8 ``bytes``) and vLLM's
``prompt_logprobs`` (one entry per prompt token: null for the first, else
``{token id: {logprob, rank, decoded_token}}``)."""

from __future__ import annotations

import codecs
from functools import lru_cache
from typing import Any

from heron.entrypoints.openai.errors import bad_request
from heron.loader.token_bytes import TokenBytes
from heron.outputs import Logprob, PromptLogprobs, SampleLogprobs

# OpenAI's floor for a logprob in JSON (-inf does not serialise)
MIN_LOGPROB = -9999.0


def check_prompt_logprobs(prompt_logprobs: int | None, stream: bool) -> None:
    """400 for ``prompt_logprobs`` in a streamed request, as vLLM answers: they
    come in the final body, which a stream does not have."""
    if prompt_logprobs is not None and stream:
        raise bad_request("prompt_logprobs is not available when stream is true", "prompt_logprobs")


@lru_cache(maxsize=8)
def token_bytes(tokenizer: Any) -> TokenBytes:
    """One byte table per tokenizer (a server has one), filled as tokens are asked for."""
    return TokenBytes(tokenizer)


def chat_logprobs(tokenizer: Any, token_ids: list[int], logprobs: SampleLogprobs, num_top: int) -> dict[str, Any]:
    """``{"content": [...]}``: per sampled token its text, logprob, bytes and its
    ``num_top`` most likely alternatives (by rank)."""
    table = token_bytes(tokenizer)
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        ranked = sorted(entry.items(), key=lambda item: item[1].rank or 0)
        top = [
            {
                "token": lp.decoded_token or "",
                "logprob": max(lp.logprob, MIN_LOGPROB),
                "bytes": list(table.of(top_id)),
            }
            for top_id, lp in ranked[:num_top]
        ]
        content.append({
            "token": tokenizer.decode([token_id]),
            "logprob": max(entry[token_id].logprob, MIN_LOGPROB),
            "bytes": list(table.of(token_id)),
            "top_logprobs": top,
        })
    return {"content": content}


def completion_token_label(tokenizer: Any, token_id: int, text: str | None = None) -> str:
    """A token as the completions API's ``tokens`` and ``top_logprobs`` keys show it:
    its text, or, for a token holding part of a character (its text alone is
    U+FFFD), ``bytes:`` and its bytes, as OpenAI's completions write them (printable
    ASCII as itself, the rest as ``\\xNN``). Without that, alternatives that are
    different byte pieces all became "\ufffd" and overwrote each other in the
    ``top_logprobs`` dict."""
    if text is None:
        text = tokenizer.decode([token_id])
    if "\ufffd" not in text:
        return text
    raw = token_bytes(tokenizer).of(token_id)
    if not _is_partial(raw):
        return text  # a real U+FFFD
    return "bytes:" + "".join(chr(byte) if 0x20 <= byte < 0x7F else f"\\x{byte:02x}" for byte in raw)


class TextOffsets:
    """Completions' ``text_offset``: where each token's text starts in the
    answer, in characters. A token holding part of a character adds nothing
    until the token that completes it adds the character (its text alone,
    U+FFFD, counted one character per piece: the offsets ran past the text and
    disagreed with a stream's, which counts the text delivered)."""

    def __init__(self, tokenizer: Any, start: int) -> None:
        self._table = token_bytes(tokenizer)
        self._pending = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.offset = start

    def advance(self, token_id: int, text: str) -> int:
        """The offset of this token (``text``: its text alone); moves past it."""
        here = self.offset
        raw = self._table.of(token_id) if "\ufffd" in text else None
        if raw is not None and _is_partial(raw):
            self.offset += len(self._pending.decode(raw))
        else:
            self.offset += len(self._pending.decode(b"", final=True)) + len(text)
            self._pending.reset()
        return here


def _is_partial(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def _logprob_entry(lp: Logprob) -> dict[str, Any]:
    return {"logprob": max(lp.logprob, MIN_LOGPROB), "rank": lp.rank, "decoded_token": lp.decoded_token}


def prompt_logprobs_field(
    prompt_logprobs: PromptLogprobs | None, prompt_ids: list[int], num_top: int
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first has no
    context) or its own token's entry and the ``num_top`` most likely ones,
    keyed by token id (the engine may have computed more: an echo asked for more)."""
    if prompt_logprobs is None:
        return None
    return [
        None if entry is None else {
            str(token_id): _logprob_entry(lp)
            for token_id, lp in entry.items()
            if token_id == own_id or (lp.rank is not None and lp.rank <= num_top)
        }
        for own_id, entry in zip(prompt_ids, prompt_logprobs)
    ]
