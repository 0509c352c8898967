"""Byte-level BPE tokenizers rebuilt from GGUF metadata (loader/tokenizer.py),
on small made-up vocabularies: the pre-tokenizer each ``tokenizer.ggml.pre``
name means (llama.cpp's names, aliases included), Llama 3's whole-word rule
and BOS default, and which added tokens are special."""

from __future__ import annotations

import logging

import pytest

from heron.loader.tokenizer import _byte_level_bpe_tokenizer

TOKENS = ["<s>", "</s>", "c", "d", "cd", "Ġ", "1", "2", "3", "12", "<tool_call>"]
TYPES = [3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 4]  # 3: control, 4: user-defined, 1: normal


def tokenizer(pre: str, **metadata):
    return _byte_level_bpe_tokenizer({
        "tokenizer.ggml.tokens": TOKENS, "tokenizer.ggml.token_type": TYPES, "tokenizer.ggml.merges": ["1 2"],
        "tokenizer.ggml.pre": pre, "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1, **metadata,
    })


def split(pre: str, text: str) -> list[str]:
    return [piece for piece, _ in tokenizer(pre).backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize("alias, name", [("deepseek-r1-qwen", "qwen2"), ("megrez", "qwen2"),
                                         ("llama-v3", "llama3"), ("falcon3", "llama3"), ("pixtral", "llama-bpe")])
def test_llama_cpps_aliases_split_as_their_pre_tokenizer(alias, name):
    # they fell back to GPT-2's split: DeepSeek-R1-Distill-Qwen's GGUFs tokenized numbers and symbols differently
    text = "ied 4 ½ months 12345 don't"
    assert split(alias, text) == split(name, text) != split("default", text)


def test_llama3_takes_a_word_it_holds_whole_before_its_merges():
    assert tokenizer("llama3").encode("cd", add_special_tokens=False) == [4]  # "cd" is in the vocabulary
    assert tokenizer("default").encode("cd", add_special_tokens=False) == [2, 3]  # no merge reaches it
    assert tokenizer("llama3").encode("12", add_special_tokens=False) == [9]


def test_llama3_adds_bos_unless_the_file_says_otherwise():
    assert tokenizer("llama3").encode("c") == [0, 2]  # older conversions have no add_bos_token key
    assert tokenizer("llama3", **{"tokenizer.ggml.add_bos_token": False}).encode("c") == [2]
    assert tokenizer("qwen2").encode("c") == [2]


def test_user_defined_tokens_are_added_but_not_special():
    # a user-defined token (Qwen2.5's <tool_call>) is text: skip_special_tokens used to drop it
    tok = tokenizer("qwen2")
    ids = tok.encode("c<tool_call>d", add_special_tokens=False)
    assert ids == [2, 10, 3]
    assert tok.decode(ids, skip_special_tokens=True) == "c<tool_call>d"
    assert tok.decode([0, 2], skip_special_tokens=True) == "c"  # control tokens stay special


def test_an_unknown_pre_tokenizer_is_named_in_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="heron.loader.tokenizer"):
        tokenizer("some-new-model")
        tokenizer("gpt-2")
    assert [record.getMessage().count("some-new-model") for record in caplog.records] == [1]
