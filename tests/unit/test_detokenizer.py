"""Incremental detokenization never emits a broken character, and its pieces
concatenate to the full decode."""

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from heron.engine.detokenizer import IncrementalDetokenizer, StreamingDetokenizer, make_detokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "emoji: 🦜🐍👩‍👩‍👧‍👦 and 🇫🇷 flags",
    "CJK 中文字符 日本語のテキスト 한국어",
    "mixed é à ü ß — “quotes” … 12345",
]


@pytest.fixture(params=[IncrementalDetokenizer, StreamingDetokenizer])
def detokenizer_class(request, monkeypatch):
    """Every test runs on both implementations (``stream`` builds the current one)."""
    monkeypatch.setattr(f"{__name__}.DETOKENIZER", request.param)
    return request.param


DETOKENIZER = IncrementalDetokenizer


def stream(tokenizer, prompt_ids, ids, skip_special_tokens=True):
    detok = DETOKENIZER(tokenizer, prompt_ids, skip_special_tokens)
    pieces = [detok.push(token_id) for token_id in ids]
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_pieces_concatenate_and_never_split_characters(detokenizer_class, embedded_tokenizer, text):
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


def test_special_tokens_are_skipped_or_kept(detokenizer_class, embedded_tokenizer):
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


def test_byte_fallback_tokens_wait_for_the_whole_character(detokenizer_class):
    tok = byte_fallback_tokenizer()
    ids = [tok.convert_tokens_to_ids(t)
           for t in ["▁a", "<0xC3>", "<0xA9>", "▁b", "<0xF0>", "<0x9F>", "<0xA6>", "<0x9C>", "c"]]
    pieces = stream(tok, [], ids)
    assert "".join(pieces) == tok.decode(ids) == "aé b🦜c"
    assert not any(p.endswith("\ufffd") for p in pieces)
    assert pieces[1] == "" and pieces[4:7] == ["", "", ""]


def test_a_prompt_ending_in_byte_tokens_leaves_the_output_whole(detokenizer_class):
    """The prompt ends in "你好" (six byte tokens) and the model goes on in byte
    tokens: a five-token window started inside 你, the byte-fallback decoder made
    the whole stray run U+FFFD, and "世界c" came out as six U+FFFD and "c"."""
    tok = byte_fallback_tokenizer()
    to_ids = tok.convert_tokens_to_ids
    prompt = [to_ids("▁a"), to_ids("▁")] + [to_ids(f"<0x{b:02X}>") for b in "你好".encode()]
    output = [to_ids(f"<0x{b:02X}>") for b in "世界".encode()] + [to_ids("c")]
    pieces = stream(tok, prompt, output)
    assert "".join(pieces) == "世界c" and not any("\ufffd" in piece for piece in pieces)


def test_a_dangling_partial_character_is_flushed_at_the_end(detokenizer_class):
    tok = byte_fallback_tokenizer()
    ids = [tok.convert_tokens_to_ids(t) for t in ["▁a", "<0xC3>"]]
    pieces = stream(tok, [], ids)
    assert pieces[1] == "" and pieces[-1] == "\ufffd"


def test_both_implementations_emit_the_same_pieces(embedded_tokenizer):
    tok = embedded_tokenizer
    prompt = tok.encode("Say something:")
    for text in TEXTS:
        ids = tok.encode(text)
        pieces = {}
        for cls in (IncrementalDetokenizer, StreamingDetokenizer):
            detok = cls(tok, prompt, True)
            pieces[cls] = [detok.push(token_id) for token_id in ids] + [detok.flush()]
        assert pieces[IncrementalDetokenizer] == pieces[StreamingDetokenizer], text


def test_fast_tokenizers_get_the_streaming_detokenizer(embedded_tokenizer):
    assert isinstance(make_detokenizer(embedded_tokenizer, [], True), StreamingDetokenizer)

    class SlowTokenizer:  # decode only, no Rust backend
        def decode(self, ids, skip_special_tokens=True):
            return embedded_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    assert isinstance(make_detokenizer(SlowTokenizer(), [], True), IncrementalDetokenizer)


class FailingStream:
    """A DecodeStream that raises from its ``fail_at``-th step on."""

    def __init__(self, stream, fail_at: int) -> None:
        self.stream, self.fail_at, self.calls = stream, fail_at, 0

    def step(self, backend, token_id):
        self.calls += 1
        if self.calls > self.fail_at:
            raise Exception("InvalidPrefix")
        return self.stream.step(backend, token_id)


@pytest.mark.parametrize("fail_at", [0, 3, 7])
def test_a_failing_stream_hands_over_without_losing_text(embedded_tokenizer, fail_at):
    """Should DecodeStream raise mid-stream (a decoder whose text is not
    prefix-stable), the Python detokenizer takes over from the text already out."""
    tok = embedded_tokenizer
    ids = tok.encode(TEXTS[1])  # multi-token characters: the failure may come mid-character
    detok = StreamingDetokenizer(tok, tok.encode("Say something:"), True)
    detok._stream = FailingStream(detok._stream, fail_at)
    pieces = [detok.push(token_id) for token_id in ids] + [detok.flush()]
    assert "".join(pieces) == TEXTS[1]
    assert detok._fallback is not None


@pytest.mark.parametrize("fail_at", [1, 2, 4])
def test_the_hand_over_keeps_word_spaces(fail_at):
    """A tokenizer that strips the text's leading space decodes a word token
    alone without its space: the hand-over must decode after the emitted tokens."""
    tok = byte_fallback_tokenizer()
    tokens = ["▁a", "▁b", "<0xC3>", "<0xA9>", "▁b", "c"]
    ids = [tok.convert_tokens_to_ids(t) for t in tokens]
    detok = StreamingDetokenizer(tok, [], True)
    detok._stream = FailingStream(detok._stream, fail_at)
    pieces = [detok.push(token_id) for token_id in ids] + [detok.flush()]
    assert "".join(pieces) == tok.decode(ids) == "a bé bc"


def test_a_prompt_ending_mid_character_keeps_its_bytes_out_of_the_output(embedded_tokenizer):
    """The prompt's pending bytes are prompt text, never output; but a character
    the output completes is output text, whole (it was lost: a client continuing
    an answer cut inside a character by sending its token ids back got neither
    half). Both detokenizers agree."""
    tok = embedded_tokenizer
    prompt = tok.encode("Tell me 🦜")[:-1]  # cut inside the emoji
    for continuation, expected in ((tok.encode(" hello"), " hello"),
                                   (tok.encode("Tell me 🦜")[-1:] + tok.encode(" hi"), "🦜 hi")):
        pieces = {}
        for cls in (IncrementalDetokenizer, StreamingDetokenizer):
            detok = cls(tok, prompt, True)
            pieces[cls] = [detok.push(token_id) for token_id in continuation] + [detok.flush()]
        assert pieces[StreamingDetokenizer] == pieces[IncrementalDetokenizer]
        assert "".join(pieces[StreamingDetokenizer]) == expected
    emoji = tok.encode("🦜", add_special_tokens=False)
    if len(emoji) > 2:  # completed over two output tokens: nothing until it is whole
        detok = IncrementalDetokenizer(tok, tok.encode("Tell me") + emoji[:1], True)
        assert [detok.push(token_id) for token_id in emoji[1:]] == [""] * (len(emoji) - 2) + ["🦜"]


def test_a_prompt_the_stream_cannot_follow_falls_back_at_once():
    tok = byte_fallback_tokenizer()
    prompt = [tok.convert_tokens_to_ids(t) for t in ["<0x41>", "<0xC3>", "▁a"]]
    ids = [tok.convert_tokens_to_ids(t) for t in ["▁b", "c"]]
    detok = StreamingDetokenizer(tok, prompt, True)
    assert detok._fallback is not None
    python = IncrementalDetokenizer(tok, prompt, True)
    assert [detok.push(i) for i in ids] == [python.push(i) for i in ids]


def random_ids(tokenizer, count: int, seed: int) -> list[int]:
    """Random token ids: for a byte-level vocabulary, also invalid UTF-8."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(len(tokenizer)) for _ in range(count)]


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_push_many_equals_pushing_one_at_a_time(detokenizer_class, embedded_tokenizer, chunk):
    tok = embedded_tokenizer
    prompt = tok.encode("Say something:")
    for ids in [tok.encode(text) for text in TEXTS] + [random_ids(tok, 200, seed) for seed in range(3)]:
        one = DETOKENIZER(tok, prompt, True)
        expected = "".join(one.push(token_id) for token_id in ids) + one.flush()
        many = DETOKENIZER(tok, prompt, True)
        got = "".join(many.push_many(ids[i : i + chunk]) for i in range(0, len(ids), chunk)) + many.flush()
        assert got == expected


@pytest.mark.parametrize("fail_at", [0, 3, 7])
def test_push_many_hands_over_mid_batch_without_losing_text(embedded_tokenizer, fail_at):
    tok = embedded_tokenizer
    ids = tok.encode(TEXTS[1])
    detok = StreamingDetokenizer(tok, tok.encode("Say something:"), True)
    detok._stream = FailingStream(detok._stream, fail_at)
    text = detok.push_many(ids[:5]) + detok.push_many(ids[5:]) + detok.flush()
    assert text == TEXTS[1]
    assert detok._fallback is not None
