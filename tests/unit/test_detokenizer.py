"""Incremental detokenization never emits a broken character, and its pieces
concatenate to the full decode."""

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from heron.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "emoji: 🦜🐍👩‍👩‍👧‍👦 and 🇫🇷 flags",
    "CJK 中文字符 日本語のテキスト 한국어",
    "mixed é à ü ß — “quotes” … 12345",
]


def stream(tokenizer, prompt_ids, ids, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    pieces = [detok.push(token_id) for token_id in ids]
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_pieces_concatenate_and_never_split_characters(embedded_tokenizer, text):
    tok = embedded_tokenizer
    prompt = tok.encode("Say something:")
    ids = tok.encode(text)
    pieces = stream(tok, prompt, ids)
    assert "".join(pieces) == tok.decode(ids)
    assert "".join(pieces) == text
    assert not any(piece.endswith("\ufffd") for piece in pieces)
    # multi-byte characters do span tokens here, so some pushes must have waited
    if any(ord(c) > 0x7FF for c in text):
        assert "" in pieces[:-1]


def test_special_tokens_are_skipped_or_kept(embedded_tokenizer):
    tok = embedded_tokenizer
    ids = tok.encode("Hi<|im_end|>")
    assert "".join(stream(tok, [], ids)) == "Hi"
    assert "".join(stream(tok, [], ids, skip_special_tokens=False)) == "Hi<|im_end|>"


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in ["▁", "a", "b", "▁a", "▁b", "c"]:
        vocab[piece] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a"), ("▁", "b")], byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_byte_fallback_tokens_wait_for_the_whole_character():
    tok = byte_fallback_tokenizer()
    ids = [tok.convert_tokens_to_ids(t) for t in ["▁a", "<0xC3>", "<0xA9>", "▁b", "<0xF0>", "<0x9F>", "<0xA6>", "<0x9C>", "c"]]
    pieces = stream(tok, [], ids)
    assert "".join(pieces) == tok.decode(ids) == "aé b🦜c"
    assert not any(p.endswith("\ufffd") for p in pieces)
    assert pieces[1] == "" and pieces[4:7] == ["", "", ""]


def test_a_dangling_partial_character_is_flushed_at_the_end():
    tok = byte_fallback_tokenizer()
    ids = [tok.convert_tokens_to_ids(t) for t in ["▁a", "<0xC3>"]]
    pieces = stream(tok, [], ids)
    assert pieces[1] == "" and pieces[-1] == "\ufffd"
