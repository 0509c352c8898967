"""Piecewise tokenization with remembered pieces gives the tokenizer's own ids,
and is refused for tokenizers on which it would not."""

import random

from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from heron.loader.segment_encoder import MIN_CACHED_CHARS, SegmentEncoder

WORDS = ["heron", " egret", "  ", "\n", "\t", "Ünï", "🦩", "2+2", "'s", "<|im_start|>", "<|im_end|>", "<|im", "|>",
         "<|endoftext|>", "system", " user", "assistant", "mud-flat", "...", " ", "x" * 70]


def test_matches_the_tokenizer_on_random_chat_like_texts(embedded_tokenizer):
    backend = embedded_tokenizer._tokenizer
    encoder = SegmentEncoder.create(backend, max_entries=8)
    assert encoder is not None
    rng = random.Random(7)
    shared = "You are a guide to the birds of estuaries. " * 4  # long enough to be remembered
    for _ in range(300):
        text = "".join(rng.choice(WORDS + [shared]) for _ in range(rng.randint(0, 25)))
        for add_special_tokens in (False, True):
            expected = backend.encode(text, add_special_tokens=add_special_tokens).ids
            assert encoder.encode(text, add_special_tokens) == expected, repr(text)
    assert 0 < len(encoder._cache) <= 8  # remembered, and bounded
    assert all(len(piece) >= MIN_CACHED_CHARS for piece in encoder._cache)


def _word_tokenizer() -> Tokenizer:
    vocab = {"[UNK]": 0, "a": 1, "b": 2, "<x>": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def test_refused_where_pieces_would_not_encode_alone():
    plain = _word_tokenizer()
    plain.add_special_tokens([AddedToken("<x>", special=True)])
    assert SegmentEncoder.create(plain) is not None

    normalized = _word_tokenizer()
    normalized.normalizer = normalizers.Lowercase()
    assert SegmentEncoder.create(normalized) is None

    stripping = _word_tokenizer()
    stripping.add_special_tokens([AddedToken("<x>", special=True, lstrip=True)])
    assert SegmentEncoder.create(stripping) is None

    assert SegmentEncoder.create(None) is None
