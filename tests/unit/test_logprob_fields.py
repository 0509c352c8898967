"""Logprob parts of response bodies: each token's real bytes (a token may hold
part of a character) and vLLM's prompt_logprobs shape."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

from heron.entrypoints.openai.errors import APIError
from heron.entrypoints.openai.logprob_fields import (
    TextOffsets,
    chat_logprobs,
    check_prompt_logprobs,
    completion_token_label,
    prompt_logprobs_field,
)
from heron.loader.token_bytes import TokenBytes
from heron.outputs import Logprob

TEXT = "Write three emoji: 🌟🍕 and é, 中文"


def test_byte_level_tokens_give_back_the_text_bytes(embedded_tokenizer):
    ids = embedded_tokenizer.encode(TEXT, add_special_tokens=False)
    table = TokenBytes(embedded_tokenizer)
    pieces = [table.of(token_id) for token_id in ids]
    assert b"".join(pieces) == TEXT.encode()
    # some tokens hold part of a character: their text is U+FFFD, their bytes are not
    partial = [token_id for token_id, piece in zip(ids, pieces) if "\ufffd" in embedded_tokenizer.decode([token_id])]
    assert partial and all(b"\xef\xbf\xbd" not in table.of(token_id) for token_id in partial)
    im_end = embedded_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert table.of(im_end) == b"<|im_end|>"


def sentencepiece_style_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-2-like: ▁ for spaces, <0xNN> byte fallback for characters not in the vocabulary."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("▁Hello", "▁world", "▁", "é"):
        vocab[piece] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_sentencepiece_byte_fallback_tokens_are_their_bytes():
    tokenizer = sentencepiece_style_tokenizer()
    ids = tokenizer.encode("Hello world 🌟é", add_special_tokens=False)
    table = TokenBytes(tokenizer)
    assert b"".join(table.of(token_id) for token_id in ids) == " Hello world 🌟é".encode()
    assert table.of(tokenizer.convert_tokens_to_ids("<0xF0>")) == b"\xf0"


def test_chat_logprobs_bytes_rebuild_a_split_character(embedded_tokenizer):
    ids = embedded_tokenizer.encode(" 🌟", add_special_tokens=False)
    assert len(ids) > 1  # the emoji spans several tokens
    entries = [{token_id: Logprob(-0.5, 1, embedded_tokenizer.decode([token_id]))} for token_id in ids]
    content = chat_logprobs(embedded_tokenizer, ids, entries, 1)["content"]
    assert bytes(b for item in content for b in item["bytes"]).decode() == " 🌟"
    assert all(item["top_logprobs"][0]["bytes"] == item["bytes"] for item in content)


def test_prompt_logprobs_field_keeps_the_own_token_and_the_top_n():
    entries = [None, {7: Logprob(-3.0, 9, "a"), 1: Logprob(-0.1, 1, "b"), 2: Logprob(-2.0, 2, "c")},
               {5: Logprob(float("-inf"), 1, "d")}]
    assert prompt_logprobs_field(entries, [4, 7, 5], 1) == [
        None,
        {"7": {"logprob": -3.0, "rank": 9, "decoded_token": "a"},
         "1": {"logprob": -0.1, "rank": 1, "decoded_token": "b"}},
        {"5": {"logprob": -9999.0, "rank": 1, "decoded_token": "d"}},
    ]
    assert prompt_logprobs_field(None, [1], 1) is None


def test_prompt_logprobs_are_refused_in_streams():
    check_prompt_logprobs(2, stream=False)
    check_prompt_logprobs(None, stream=True)
    with pytest.raises(APIError) as raised:
        check_prompt_logprobs(0, stream=True)
    assert raised.value.param == "prompt_logprobs"


def test_completion_labels_name_a_partial_character_by_its_bytes(embedded_tokenizer):
    # the completions API keys top_logprobs by token text: every byte piece of an emoji decoded to U+FFFD, so
    # alternatives that were different pieces overwrote each other
    ids = embedded_tokenizer.encode("I love \U0001f999 so much", add_special_tokens=False)
    labels = [completion_token_label(embedded_tokenizer, token_id) for token_id in ids]
    assert labels == ["I", " love", "bytes: \\xf0\\x9f", "bytes:\\xa6", "bytes:\\x99", " so", " much"]
    partial = [token_id for token_id in range(300) if "\ufffd" in embedded_tokenizer.decode([token_id])]
    assert len(partial) > 10
    assert len({completion_token_label(embedded_tokenizer, token_id) for token_id in partial}) == len(partial)


def test_text_offsets_count_a_split_character_once(embedded_tokenizer):
    """Each offset is the number of whole characters before the token; the
    pieces of a character split over tokens each counted one U+FFFD, so the
    offsets ran past the text (and disagreed with a stream's)."""
    ids = embedded_tokenizer.encode(TEXT, add_special_tokens=False)
    offsets = TextOffsets(embedded_tokenizer, 7)
    got = [offsets.advance(token_id, embedded_tokenizer.decode([token_id])) for token_id in ids]
    assert got == [7 + len(embedded_tokenizer.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
    assert offsets.offset == 7 + len(TEXT)
